"""HiLoRe around OpenRLHF's ``ActorPPOTrainer.training_step``, without changing it.

OpenRLHF's step runs ``Actor.forward`` (log-probs of the response tokens), ``PolicyLoss`` (+ the
KL loss), ``strategy.backward`` and ``strategy.optimizer_step``. The wrapper

1. opens a recovery-engine step (the plan's storage) around the whole call;
2. records the action log-probs with a forward hook on the ``Actor``;
3. intercepts ``strategy.backward``: there it computes omega = dL/d(log-prob) (Eq. 4) with
   ``torch.autograd.grad`` through the loss only (token-level ops, cheap), whatever loss
   OpenRLHF was configured with, turns it into actions (Eq. 7 -> Eq. 13) and sets them
   before the real backward;
4. measures the step's peak up to its optimizer step (which DeepSpeed runs at the
   accumulation boundary; B bounds the microbatch, as the job's planning measured it) and
   reports it to the budget coordinator; on ``tighten`` the rank re-plans before its next
   microbatch.

Steps 1 and 4 are the learner room's microbatch sequence (``learner/microbatch_run.py``).
Under the zero-advantage skip (``skip.py``) a pad micro-batch reports no action tokens and no
samples, so ``ppo_train``'s weighted metrics cover the trained responses.

Imports torch and this package only: the tests drive it with OpenRLHF's real trainer code.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, Optional

import torch

from ..learner.lockstep import agree_actions, agree_max
from ..learner.scope import resident_now
from ..learner.microbatch_run import report, run_microbatch
from ..recovery.policies import stores_nothing
from .patching import shadowed


def _aligned(action_values: torch.Tensor, seq_len: int) -> torch.Tensor:
    """OpenRLHF's ``[B, A]`` action tensors hold the last A positions of the ``[B, T-1]``
    next-token layout this package uses; place them there (zeros elsewhere)."""
    out = action_values.new_zeros(action_values.shape[0], seq_len - 1)
    out[:, seq_len - 1 - action_values.shape[1] :] = action_values
    return out


class HiLoReTrainingStep:
    def __init__(self, plan, engine, coordinator=None, rank: int = 0, device: Optional[torch.device] = None):
        self.plan, self.engine, self.coordinator, self.rank = plan, engine, coordinator, rank
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.last: Dict = {}
        self.weights: Dict = {}
        self.zero3 = False  # set by install: ranks agree on every unit's action (lockstep.agree_actions)
        self.skip = None  # the zero-advantage skip (skip.py), when it runs

    def install(self, trainer) -> None:
        """Replace ``trainer.training_step`` (an instance attribute shadows the method)."""
        original = trainer.training_step
        # ZeRO-3 (partitioned weights): the ranks' backward passes are collectives
        self.zero3 = torch.distributed.is_initialized() and any(
            hasattr(p, "ds_id") for p in trainer.actor.model.parameters()
        )

        def training_step(experience, kl_ctl, step, loss_batch_info=None):
            return self(trainer, original, experience, kl_ctl, step, loss_batch_info)

        trainer.training_step = training_step

    def _choose(self, rec, captured: Dict, loss: torch.Tensor, experience) -> Dict[str, str]:
        """Actions from the token weights of OpenRLHF's whole loss: omega = d loss / d log-prob
        (Eq. 4, by autograd, whatever policy loss and KL the recipe uses), plus, when the
        recipe has an entropy term (``--actor.entropy_coef``), |d loss / d entropy_t| per token:
        that term reaches the weights through the full logits, not the log-probs, so it is
        added to the token's exposure weight (Eq. 7 takes |omega|). An auxiliary (MoE router)
        loss has no per-token weight and is not counted."""
        T = experience.sequences.shape[1]
        omega = _aligned(torch.autograd.grad(loss, captured["logp"], retain_graph=True)[0].detach().float(), T)
        entropy = getattr(captured.get("output"), "entropy", None)
        eta = None
        if isinstance(entropy, torch.Tensor) and entropy.requires_grad:
            eta = torch.autograd.grad(loss, entropy, retain_graph=True, allow_unused=True)[0]
        if eta is not None and eta.shape != omega.shape:
            eta = None  # packed samples: entropy is [1, nnz]; the exposure weighs omega only
        weight = omega if eta is None else omega.abs() + eta.detach().float().abs()
        self.weights = {"omega": omega, "eta": eta}  # the last microbatch's token weights (tests, diagnostics)
        out = SimpleNamespace(omega=weight, mask=_aligned(experience.action_mask.float(), T))
        norms = rec.step.token_norms() if self.plan.track_tokens else {}
        B = experience.sequences.shape[0]
        if any(v.shape[0] != B or v.shape[-1] < T - 1 for v in norms.values()):
            # packed samples: activations are unpadded [1, nnz]; weigh tokens uniformly
            norms = {k: torch.ones(B, T) for k in norms}
        return self.plan.actions(SimpleNamespace(token_norms=lambda: norms), out, rec.sp)

    def _all_r_somewhere(self, tokens: int) -> bool:
        """ZeRO-3: whether any rank's plan for this microbatch stores nothing. Such a rank runs
        torch's layer checkpointing instead of the engine (``run_microbatch``) and so neither joins
        ``agree_actions`` nor replays through the engine's gathers: every rank must take that path
        together. Plans differ by rank (each tightens and sizes by its own peaks), but where one
        rank's is all R the agreed actions are all R anyway, so all-R everywhere loses nothing."""
        if not self.zero3 or self.engine is None or self.plan.planner is None:
            return False
        sp = self.plan.for_tokens(tokens)
        return bool(agree_max([stores_nothing(sp.plan)], None, self.device)[0])

    def __call__(self, trainer, original, experience, kl_ctl, step, loss_batch_info=None):
        captured = {}

        def keep(mod, args, out):  # Actor.forward returns (action log-probs, output) with return_output
            captured.update(logp=out[0], output=out[1]) if isinstance(out, tuple) else captured.update(logp=out)

        hook = trainer.actor.register_forward_hook(keep)
        strategy = trainer.strategy
        real_backward = strategy.backward
        state = {}

        def backward(loss, model, optimizer, **kwargs):
            rec = state.get("rec")
            if rec is not None and rec.step is not None and "logp" in captured:
                actions = self._choose(rec, captured, loss, experience)
                if self.zero3 and isinstance(actions, dict):  # an R replay gathers weights: one action per unit
                    actions = agree_actions(actions)
                rec.step.set_actions(actions)
            return real_backward(loss, model, optimizer, **kwargs)

        def optimizer_step(*args, **kwargs):  # outside the microbatch's peak: B bounds the microbatch
            rec = state.get("rec")
            if rec is not None:
                rec.end_here()
            return real_step(*args, **kwargs)

        real_step = strategy.optimizer_step
        try:
            with shadowed(strategy, backward=backward, optimizer_step=optimizer_step):
                resident = resident_now(self.device, trainer.actor.model) if self.plan.scope == "device" else 0
                tokens = experience.sequences.numel()
                with run_microbatch(
                    self.plan, self.engine, self.device, tokens, resident, all_r=self._all_r_somewhere(tokens)
                ) as rec:
                    state["rec"] = rec
                    result = original(experience, kl_ctl, step, loss_batch_info)
        finally:
            hook.remove()
        counts = rec.counts
        self.last = {
            "peak_bytes": rec.scope_peak,
            "peak_over_budget": rec.scope_peak / self.plan.budget,
            "actions": rec.actions,
        }
        report(self.plan, self.coordinator, self.rank, step, step, rec)
        if isinstance(result, dict) and isinstance(result.get("metrics"), dict):
            result["metrics"]["hilore_peak_over_budget"] = self.last["peak_over_budget"]
            result["weights"]["hilore_peak_over_budget"] = None
            for a, n in counts.items():
                result["metrics"][f"hilore_fraction_{a}"] = n / max(1, len(rec.actions))
                result["weights"][f"hilore_fraction_{a}"] = None
        pad, kept_anywhere = self.skip.step_flags(step) if self.skip is not None else (False, True)
        if pad and kept_anywhere and isinstance(result, dict):
            # a pad trains nothing: ppo_train's token- and sample-weighted metrics then cover the trained
            # responses (where no rank kept anything they are the pads', or ppo_train would divide by 0)
            result["num_action_tokens"] = result["num_samples"] = 0.0
        return result
