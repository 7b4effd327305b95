"""HiLoRe around verl's ``forward_backward_batch``: one learner microbatch per verl micro-batch.

verl's loop (``FSDPEngine.forward_backward_batch``) calls ``forward_step`` (model forward,
log-probs, the configured loss) and then ``loss.backward()`` itself, for each micro-batch. The
learner room's microbatch (``learner/microbatch_run.py``: meter -> plan sized to the tokens ->
recovery-engine step -> actions -> peak report -> tighten) must span both, so here a
microbatch opens in ``forward_step`` and closes when the engine's per-micro-batch context
exits (``fsdp_engine.py``), or at the latest when the next one opens or the batch ends.
Between loss and backward, inside verl's loss call, the actions are set from omega = d loss /
d log-prob (Eq. 4; ``token_weights.py``), plus |d loss / d entropy| per token when the recipe
has an entropy term (it reaches the weights through the logits, not the log-probs; the same
rule as the OpenRLHF drop-in).

Imports torch and this package only; verl's objects come in as arguments.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Callable, Dict, Optional

import torch

from ..learner.microbatch_run import report, run_microbatch
from .token_weights import differentiable, flat_gradient, flat_mask, to_input_layout


class Microbatches:
    def __init__(
        self, plan, engine, device, coordinator=None, rank: int = 0, resident: Optional[Callable[[], int]] = None
    ):
        self.plan, self.engine, self.device = plan, engine, torch.device(device)
        self.coordinator, self.rank = coordinator, rank
        self.resident = resident or (lambda: 0)
        self.active = False
        self.step = 0  # verl mini-batches seen (the coordinator's step)
        self.index = 0  # microbatches seen in this step
        self.last: Dict = {}  # the last closed microbatch: peak, actions (tests, metrics)
        self.batch_peaks = []  # peak / B of each microbatch of the current (or last) batch
        self.weights: Dict = {}  # the last microbatch's token weights (tests, diagnostics)
        self._open = None  # (ExitStack, record) of the running microbatch
        self._metrics = None  # the running micro-batch's metrics dict, as verl's loss returned it
        self.overrides: Dict = {}
        self.skip: Optional[Dict] = None  # the skip's metrics of the current (or last) batch

    @contextlib.contextmanager
    def batch(self, overrides: Optional[Dict] = None, skip: Optional[Dict] = None):
        """One ``forward_backward_batch`` (a verl mini-batch); yields the loss wrapper.
        ``overrides``: non-tensor keys set on each micro-batch before verl's loss (the whole
        mini-batch's counts when the zero-advantage skip left responses out, ``skip.py``);
        ``skip``: that skip's metrics, reported with every micro-batch."""
        self.active, self.index, self.batch_peaks = True, 0, []
        self.overrides, self.skip = dict(overrides or {}), skip
        try:
            yield self.wrap
        finally:
            self.close()
            self.active = False
            self.step += 1
            self.overrides = {}

    def open(self, micro_batch) -> None:
        """Called by the engine's ``forward_step`` before verl's forward."""
        self.close()
        tokens = self.tokens(micro_batch)
        resident = self.resident() if self.plan.scope == "device" else 0
        stack = contextlib.ExitStack()
        rec = stack.enter_context(run_microbatch(self.plan, self.engine, self.device, tokens, resident))
        self._open, self._metrics = (stack, rec), None

    def tokens(self, micro_batch) -> int:
        """The micro-batch's tokens on this rank (the plan is sized to them)."""
        ids = micro_batch["input_ids"]
        return ids.values().numel() if ids.is_nested else ids.numel()

    def close(self) -> None:
        if self._open is None:
            return
        stack, rec = self._open
        self._open = None
        stack.close()
        self.last = {
            "peak_bytes": rec.scope_peak,
            "peak_over_budget": rec.scope_peak / self.plan.budget,
            "actions": rec.actions,
            "counts": rec.counts,
        }
        self.batch_peaks.append(self.last["peak_over_budget"])
        if self._metrics is not None:
            self._metrics.update(metrics(self.last, self.skip))
            self._metrics = None
        report(self.plan, self.coordinator, self.rank, self.step, self.index, rec)
        self.index += 1

    def wrap(self, loss_function):
        """verl's loss, with the actions set between it and verl's backward."""

        def loss_with_actions(model_output, data, dp_group=None):
            if self.overrides:
                from verl.utils import tensordict_utils as tu

                tu.assign_non_tensor(data, **self.overrides)
            originals = dict(model_output)
            held = differentiable(model_output)
            loss, out = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            model_output.update(originals)  # verl's nested outputs back, for whoever reads them after
            rec = self._open[1] if self._open is not None else None
            if rec is not None and rec.step is not None and "log_probs" in held and loss.requires_grad:
                rec.step.set_actions(self._choose(rec, loss, held, data))
            if rec is not None and isinstance(out, dict):
                self._metrics = out  # filled in when the micro-batch closes, after its backward
            return loss, out

        return loss_with_actions

    def _choose(self, rec, loss, held: Dict, data) -> Dict[str, str]:
        """Actions from the token weights of verl's whole loss (see the module docstring)."""
        grads = torch.autograd.grad(loss, list(held.values()), retain_graph=True, allow_unused=True)
        g = {k: flat_gradient(v, held[k]) for k, v in zip(held, grads)}
        del grads
        omega = g["log_probs"]
        weight = omega.abs()
        if "entropy" in g:
            weight = weight + g["entropy"].abs()
        nnz = weight.numel()
        mask = flat_mask(data, nnz).to(weight.device, weight.dtype)
        from verl.utils import tensordict_utils as tu

        norms = rec.step.token_norms() if self.plan.track_tokens else {}
        packed = bool(tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True))
        width = next(iter(norms.values())).shape[-1] if norms and not packed else None
        offsets = data["input_ids"].offsets()
        self.weights = {"omega": omega, "weight": weight, "mask": mask}
        out = SimpleNamespace(
            omega=to_input_layout(weight, offsets, packed, width), mask=to_input_layout(mask, offsets, packed, width)
        )
        return self.plan.actions(SimpleNamespace(token_norms=lambda: norms), out, rec.sp)


def metrics(last: Dict, skip: Optional[Dict] = None) -> Dict:
    """A micro-batch's HiLoRe metrics for verl's logger, under the OpenRLHF drop-in's names
    with verl's ``actor/`` prefix: peak / B (max over micro-batches and ranks) and the fraction
    of units per action (mean); under the zero-advantage skip, the mini-batch's shares of
    responses and tokens left out and its pad responses (the same on every rank)."""
    from verl.utils.metric import Metric

    n = max(1, len(last["actions"]))
    out = {"actor/hilore_peak_over_budget": Metric("max", last["peak_over_budget"])}
    out.update({f"actor/hilore_fraction_{a}": Metric("mean", c / n) for a, c in last["counts"].items()})
    if skip is not None:
        out.update({f"actor/hilore_{k}": Metric("max" if k == "pad_samples" else "mean", v) for k, v in skip.items()})
    return out
