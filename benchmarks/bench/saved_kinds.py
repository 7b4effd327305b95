"""Which saved tensor is which, and what compressing one kind costs in gradient error.

A study tool for the codec benchmark: before the engine gets rules about
which saved tensors L must keep exact, measure, per *kind* of saved tensor, the gradient error
of compressing that kind alone in every layer, everything else exact.

How a saved tensor gets its kind. Autograd saves an op's inputs *before* the op runs and its
outputs after, so "the op that saves this" is not observable from a pack hook. What is: module
hooks tell which module runs, innermost first (a projection's ``Linear`` saves only its
input; LoRA's ``lora_A`` / ``lora_B`` their inputs), and a ``TorchFunctionMode`` brackets each
call of ``scaled_dot_product_attention``, whose arguments are the rotated queries, the keys
and the values; anything else saved inside that call is the attention core's own output
(4-dim) or its softmax statistics (the log-sum-exp, 3-dim). The kinds:

- ``query`` / ``key`` / ``value``: the attention core's inputs (queries and keys after the
  rotary embedding); ``softmax stats``: its log-sum-exp; ``attention core output``: its
  output (eager attention makes no such call: its tensors count as ``attention internal``);
- ``attention input`` (q/k/v projections' input), ``attention output`` (o_proj's input),
  ``mlp input`` (gate/up projections' input), ``activation`` (down_proj's input): what the
  projections save for their weight gradients;
- ``mask``: the attention mask, when it is a float tensor; ``lora``: LoRA's rank-r
  intermediates (what ``lora_B`` saves);
- ``norm``: what the RMSNorms save (their input is the residual stream, which the engine keeps
  exact anyway as a unit's checkpoint input); ``attention internal``: the rest of the attention
  module's own code (rotary); ``mlp internal``: the MLP's own code (SiLU, the gate x up
  product); ``other``: outside the decoder layers (the head).

The function mode costs Python time on every torch call: fine for a study, not for the
engine's hot path (the engine's rule, ``recovery/rules.py``, needs only module hooks).
"Compressing" here is ``decode(encode(x))`` at pack time, which gives backward the same
values L's decode would.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
from torch.overrides import TorchFunctionMode

from hilore_actor.recovery.rules import exact_reason
from hilore_actor.recovery import storage_key

PROJ_KINDS = {
    "q_proj": "attention input",
    "k_proj": "attention input",
    "v_proj": "attention input",
    "o_proj": "attention output",
    "gate_proj": "mlp input",
    "up_proj": "mlp input",
    "down_proj": "activation",
}
KINDS = (
    "query",
    "key",
    "value",
    "mask",
    "softmax stats",
    "attention core output",
    "attention input",
    "attention output",
    "mlp input",
    "activation",
    "lora",
    "norm",
    "attention internal",
    "mlp internal",
    "other",
)


class _Attention(TorchFunctionMode):
    """Brackets each ``scaled_dot_product_attention`` call: ``roles`` maps the storages of its
    query, key and value to their kinds while it runs (``None`` outside)."""

    def __init__(self):
        super().__init__()
        self.roles = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        named = list(args[:4]) + [kwargs[k] for k in ("query", "key", "value", "attn_mask")[len(args) :] if k in kwargs]
        self.roles = {}
        for kind, t in reversed(list(zip(("query", "key", "value", "mask"), named))):  # query wins on shared storage
            if isinstance(t, torch.Tensor):
                self.roles[storage_key(t)] = kind
        try:
            return func(*args, **kwargs)
        finally:
            self.roles = None


class SavedKinds:
    """``with SavedKinds(model, transform) as sk:`` forward + backward; ``transform(kind, t)``
    returns what autograd keeps for ``t`` (``t`` itself to keep it exact); ``sk.bytes`` counts
    the saved bytes of each kind (parameters excluded)."""

    def __init__(self, model: torch.nn.Module, transform: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None):
        self.model, self.transform = model, transform or (lambda kind, t: t)
        self.bytes: Dict[str, int] = {k: 0 for k in KINDS}
        self._module: list = []
        self._params = {storage_key(p) for p in model.parameters()}

    def kind(self, t: torch.Tensor) -> str:
        roles = self._attn.roles
        if roles is not None:  # inside the attention core
            return roles.get(storage_key(t)) or ("attention core output" if t.dim() == 4 else "softmax stats")
        parts = (self._module[-1] if self._module else "").split(".")
        if "lora_B" in parts:
            return "lora"
        # a projection's input is saved by its own Linear (full fine-tuning) or, with frozen
        # base weights, by LoRA's lora_A (peft: <proj>.base_layer, <proj>.lora_A.<adapter>)
        for tail in (("base_layer",), ("lora_A", parts[-1])):
            if len(parts) > len(tail) and tuple(parts[-len(tail) :]) == tail:
                return PROJ_KINDS.get(parts[-len(tail) - 1], "other")
        if parts[-1] in PROJ_KINDS:
            return PROJ_KINDS[parts[-1]]
        for part, kind in (
            ("norm", "norm"),
            ("layernorm", "norm"),
            ("self_attn", "attention internal"),
            ("mlp", "mlp internal"),
        ):
            if parts[-1].endswith(part):
                return kind
        return "other"

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or storage_key(t) in self._params or not t.is_floating_point():
            return t
        k = self.kind(t)
        self.bytes[k] += t.numel() * t.element_size()
        return self.transform(k, t)

    def __enter__(self) -> "SavedKinds":
        self._handles = []

        def push(name):
            def hook(_m, _a):
                self._module.append(name)

            return hook

        def pop(*_):
            self._module.pop()

        for name, m in self.model.named_modules():  # the innermost running module is the stack's top
            self._handles += [m.register_forward_pre_hook(push(name)), m.register_forward_hook(pop)]
        self._attn = _Attention()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)
        self._attn.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._attn.__exit__(*exc)
        for h in self._handles:
            h.remove()


def kind_grad_errors(model, loss_fn, mbs, codec, kinds=KINDS) -> Dict[str, float]:
    """kind -> relative error of the summed gradient over ``mbs`` when only that kind is
    compressed with ``codec`` in every layer (everything else exact), against all exact."""
    params = [p for p in model.parameters() if p.requires_grad]

    def grad(transform) -> torch.Tensor:
        for p in params:
            p.grad = None
        for mb in mbs:
            torch.manual_seed(0)
            with SavedKinds(model, transform):
                loss_fn(model, mb).loss.backward()
        return torch.cat([p.grad.detach().float().flatten() for p in params])

    def only(k):
        def transform(kind, t):
            if kind != k or exact_reason(t) is not None:
                return t
            p = codec.encode(t)
            return codec.decode(p) if p.finite() else t  # as the engine: unscalable tensors stay exact

        return transform

    ref = grad(None)
    return {k: float((grad(only(k)) - ref).norm() / ref.norm()) for k in kinds}
