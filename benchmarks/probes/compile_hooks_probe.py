"""Probe: do the recovery engine's mechanisms (H keep, L int8 in the pack hook, R recompute from
the unpack hook, P selective caching) work on units compiled with torch.compile (regional
compilation: one ``torch.compile`` per attention or MLP unit)? Findings: ``docs/compile.md``.

Frozen evidence, not maintained against the engine: its output is what ``docs/compile.md``
quotes (the opening paragraph's "Evidence" and the section "Probe output (excerpts)"), for
torch 2.13.0. ``MiniEngine`` below is a miniature copy of the engine's mechanism as it was when
the probe ran, kept so that sections 1-4 (torch's behaviour: layouts, no_grad replays, dynamic
shapes, SAC, GraphModule hooks) can be re-run on another torch; it is not the engine and is
not kept in step with it. The engine on compiled units is tested by ``tests/recovery/test_compiled.py``
(H, R and P bitwise, L close, no recompiles), which is what keeps that claim true.

A 2-layer, hidden-64 pre-norm decoder (SDPA attention, SiLU-gated MLP; 32 tokens) on CPU, each
unit compiled by inductor through a backend that counts graphs. A miniature of the engine
(``MiniEngine``: module hooks on the compiled wrappers say which unit runs; one pair of
``saved_tensors_hooks`` per step) runs H, L and R and compares gradients with eager autograd.
Then: torch's non-reentrant checkpoint over a compiled unit, a replay under no_grad, dynamic
token counts (``mark_dynamic``), ``activation_memory_budget``, SAC over a compiled unit, and
GraphModule hooks that AOTAutograd inlines into the graphs; last, the project's own
``RecoveryEngine`` on a tiny Llama whose unit modules' ``forward`` is compiled. About a minute on
2 CPU cores (a warm inductor cache: 20 s); prints one line per finding.

    python -m benchmarks.probes.compile_hooks_probe
"""

from functools import partial

import torch
import torch._dynamo
import torch._functorch.config as fconf
import torch._inductor.config as iconf
import torch.nn.functional as F
from torch import nn
from torch._inductor.compile_fx import compile_fx
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

torch.set_num_threads(1)
iconf.compile_threads = 1  # no compile worker pool: the machine is shared
D, HEADS, FF, T, LAYERS = 64, 4, 128, 32, 2
GRAPHS = []


def backend(gm, example_inputs):
    """inductor, counting the dynamo graphs it is given (a recompile adds one)."""
    GRAPHS.append(gm)
    return compile_fx(gm, example_inputs)


class Attn(nn.Module):  # one unit: norm + attention
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.o = nn.RMSNorm(D), nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))


class Mlp(nn.Module):  # one unit: norm + gated MLP
    def __init__(self):
        super().__init__()
        self.norm, self.gu, self.down = nn.RMSNorm(D), nn.Linear(D, 2 * FF, bias=False), nn.Linear(FF, D, bias=False)

    def forward(self, x):
        g, u = self.gu(self.norm(x)).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


def make_units():
    torch.manual_seed(0)
    return [(f"{i}.{k}", m) for i in range(LAYERS) for k, m in (("attn", Attn()), ("mlp", Mlp()))]


def run(units, x):
    """Forward through residual adds; loss; gradients of the input and every weight."""
    for _, m in units:
        m.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    h = x
    for _, m in units:
        h = h + m(h)
    h.pow(2).mean().backward()
    return [x.grad] + [p.grad for _, m in units for p in m.parameters()]


def max_rel(a, b):
    return max(float((x - y).norm() / (y.norm() + 1e-12)) for x, y in zip(a, b))


def int8(t):  # L: per-row absmax int8, and the tensor's layout
    s = t.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (t / s).round().to(torch.int8), s, t.dtype, t.size(), t.stride()


def dequant(p, strided):
    """L's decode; ``strided``: into the saved tensor's own strides (inductor's backward asserts
    them), else contiguous, as an eager codec may return it."""
    q, s, dt, size, stride = p
    out = (q.float() * s).to(dt)
    return torch.empty_strided(size, stride, dtype=dt).copy_(out) if strided else out


class MiniEngine:
    """The engine's mechanism in miniature. Every non-parameter tensor a unit saves becomes a
    handle (unit, index); H keeps it, L keeps int8, R keeps nothing and the unpack hook re-runs
    the unit's (compiled) module on its recorded input under a capture hook."""

    def __init__(self, units, actions, strided=True, dynamic=False):
        self.actions, self.current, self.replaying, self.strided, self.dynamic = actions, None, False, strided, dynamic
        self.params = {p.untyped_storage().data_ptr() for _, m in units for p in m.parameters()}
        self.store, self.n, self.kinds, self.inputs, self.debug, self.recomputed = {}, {}, {}, {}, {}, {}
        self.unpacks = self.replays = 0
        self.equal = True
        for name, m in units:
            m.register_forward_pre_hook(partial(self.pre, name))
            m.register_forward_hook(lambda *_: setattr(self, "current", None) if not self.replaying else None)

    def pre(self, name, mod, args):
        if self.replaying:
            return
        self.current, self.n[name], self.kinds[name] = name, 0, []
        if self.dynamic:
            torch._dynamo.mark_dynamic(args[0], 1)  # the token dimension (the replay's detached copy is not marked)
        self.inputs[name] = (mod, args, torch.get_rng_state())

    def pack(self, t):
        if self.current is None or t.untyped_storage().data_ptr() in self.params:
            return t  # parameters pass through, as in saved.is_param
        u, i = self.current, self.n[self.current]
        self.n[u] += 1
        x = self.inputs[u][1][0]
        self.kinds[u].append(
            ("input" if t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else "interm")
            + f"{list(t.shape)}"
        )
        a = self.actions[u]
        self.store[(u, i)] = t if a == "H" else int8(t) if a == "L" else None
        if a == "R":
            self.debug[(u, i)] = t.detach().clone()  # to check the replay bitwise
        return (u, i)

    def unpack(self, h):
        if isinstance(h, torch.Tensor):
            return h
        self.unpacks += 1
        u = h[0]
        a = self.actions[u]
        if a == "H":
            return self.store.pop(h)
        if a == "L":
            return dequant(self.store.pop(h), self.strided)
        if h not in self.recomputed:
            self.replay(u)
        return self.recomputed.pop(h)

    def replay(self, u):
        mod, args, rng = self.inputs[u]
        got = []

        def capture(t):
            if t.untyped_storage().data_ptr() not in self.params:
                got.append(t)

        self.replaying = True
        self.replays += 1
        try:
            with torch.random.fork_rng(devices=[]), torch.enable_grad(), saved_tensors_hooks(capture, lambda x: x):
                torch.set_rng_state(rng)
                mod(*[a.detach().requires_grad_(a.requires_grad) for a in args])
        finally:
            self.replaying = False
        if len(got) != self.n[u]:
            raise RuntimeError(f"{u}: replay saved {len(got)} tensors, forward saved {self.n[u]}")
        for i, t in enumerate(got):
            self.equal &= torch.equal(t, self.debug.pop((u, i)))
            self.recomputed[(u, i)] = t

    def step(self):
        return saved_tensors_hooks(self.pack, self.unpack)


def mm_policy(ctx, func, *args, **kwargs):
    """P's policy in miniature: keep matmul outputs, recompute the rest."""
    keep = func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class Ckpt(nn.Module):
    """torch's non-reentrant checkpoint (optionally selective) of a module."""

    def __init__(self, m, context_fn=None):
        super().__init__()
        self.m, self.kw = m, {} if context_fn is None else {"context_fn": context_fn}

    def forward(self, h):
        return checkpoint(self.m, h, use_reentrant=False, **self.kw)


def fresh(units=None):
    """A clean dynamo cache (compiled graphs key on neither configs nor module copies)."""
    torch._dynamo.reset()
    GRAPHS.clear()
    return [(n, torch.compile(m, backend=backend)) for n, m in (units or make_units())]


def main():
    torch.manual_seed(1)
    x = torch.randn(1, T, D)
    ref = run(make_units(), x)

    print("== 1. saved_tensors_hooks around compiled units; H, L, R from the hooks")
    comp = fresh()
    grads = {}
    for a in ("H", "L", "R"):
        eng = MiniEngine(comp, {n: a for n, _ in comp})
        with eng.step():
            grads[a] = run(comp, x)  # H's step also compiles: no pack call while tracing
        print(
            f"[{a}] handles per unit {eng.n}; unpacks {eng.unpacks}; replays {eng.replays}; graphs {len(GRAPHS)}; "
            f"grad max rel err vs eager {max_rel(grads[a], ref):.2e}"
            + (
                f"; replayed tensors bitwise equal to forward's: {eng.equal}; grads bitwise equal to H's: "
                f"{all(torch.equal(p, q) for p, q in zip(grads['R'], grads['H']))}"
                if a == "R"
                else ""
            )
        )
        if a == "H":
            print(f"[H] unit 0.attn saves {eng.kinds['0.attn']}")
            print(f"[H] unit 0.mlp saves {eng.kinds['0.mlp']}")
    try:
        eng = MiniEngine(comp, {n: "L" for n, _ in comp}, strided=False)
        with eng.step():
            run(comp, x)
        print("[L, contiguous decode] ran")
    except AssertionError as e:
        print(f"[L, contiguous decode] the compiled backward refuses it: {str(e).splitlines()[0]}")
    eng = MiniEngine(comp, {"0.attn": "R", "0.mlp": "L", "1.attn": "H", "1.mlp": "R"})
    with eng.step():
        got = run(comp, x)
    print(f"[R,L,H,R] grad max rel err vs eager {max_rel(got, ref):.2e}; graphs {len(GRAPHS)}")

    print("== 2. what sets the number of tensors a compiled unit saves")
    got = run([(n, Ckpt(m)) for n, m in comp], x)
    print(f"[checkpoint(compiled unit)] grad max rel err vs eager {max_rel(got, ref):.2e}; graphs {len(GRAPHS)}")
    n = []
    with torch.no_grad(), saved_tensors_hooks(lambda t: n.append(1) or t, lambda t: t):
        comp[1][1](x)
    print(f"[mlp unit under no_grad, as a replay without enable_grad] graphs {len(GRAPHS)}; pack calls {len(n)}")
    plain = make_units()  # hooks on the modules that torch.compile wrapped: a replay calls them eagerly
    wrapped = [(n, torch.compile(m, backend=backend)) for n, m in plain]
    try:
        with MiniEngine(plain, {n: "R" for n, _ in plain}).step():
            run(wrapped, x)
        print("[hooks on the module inside torch.compile(module), all R] ran")
    except RuntimeError as e:
        print(f"[hooks on the module inside torch.compile(module), all R] {e}")
    dyn = fresh()
    counts = {}
    for t in (32, 48, 80):
        eng = MiniEngine(dyn, {n: "R" for n, _ in dyn}, dynamic=True)
        with eng.step():
            got = run(dyn, torch.randn(1, t, D))
        counts[t] = dict(eng.n)
    print(
        f"[mark_dynamic, T = 32, 48, 80, all R] graphs {len(GRAPHS)}; handles {counts[80]}; "
        f"equal for every T: {counts[32] == counts[48] == counts[80]}"
    )
    for budget in (1.0, 0.0):
        with fconf.patch(activation_memory_budget=budget):
            units = fresh(make_units()[:2])
            eng = MiniEngine(units, {n: "H" for n, _ in units})
            with eng.step():
                run(units, x)
        print(f"[activation_memory_budget={budget}] layer 0 handles {eng.n}")

    print("== 3. P: selective checkpointing and compiled units")
    ref_mlp = run(make_units()[1:2], x)
    for wrap in (False, True):
        seen = []

        def policy(ctx, func, *a, seen=seen, **k):
            if not ctx.is_recompute:
                seen.append(str(func).split("(")[0])
            return mm_policy(ctx, func, *a, **k)

        with iconf.patch(wrap_inductor_compiled_regions=wrap):
            mlp = fresh(make_units()[1:2])
            mlp[0][1](x)  # compile outside any mode
            got = run([("m", Ckpt(mlp[0][1], partial(create_selective_checkpoint_contexts, policy)))], x)
        print(
            f"[SAC mode around a compiled mlp, wrap_inductor_compiled_regions={wrap}] ops the policy saw "
            f"{sorted(set(seen))}; grad max rel err {max_rel(got, ref_mlp):.2e}"
        )
    inside = fresh([("m", Ckpt(make_units()[1][1], partial(create_selective_checkpoint_contexts, mm_policy)))])
    eng = MiniEngine(inside, {"m": "H"})
    with eng.step():
        got = run(inside, x)
    print(
        f"[SAC inside the compiled mlp] handles {eng.n} {eng.kinds['m']}; grad max rel err {max_rel(got, ref_mlp):.2e}"
    )

    print("== 4. GraphModule hooks, inlined into the compiled graphs")
    from torch.fx.experimental.proxy_tensor import make_fx

    def q(t):
        s = t.abs().amax().clamp_min(1e-12) / 127
        return (t / s).round().to(torch.int8), s

    def dq(p):
        return p[0].to(torch.float32) * p[1]

    ex = torch.randn(4, 4)
    pack_gm, unpack_gm = make_fx(q)(ex), make_fx(dq)(q(ex))
    units = fresh()
    with saved_tensors_hooks(pack_gm, unpack_gm):
        got = run(units, x)
    inlined = hasattr(GRAPHS[0], "saved_tensors_hooks_pack_0")
    py = []
    with saved_tensors_hooks(lambda t: py.append(1) or t, lambda t: t):
        run(units, x)
    print(
        f"[GraphModule pair, filtering {fconf.saved_tensors_hooks_filtering_mode!r}] pack installed as a subgraph: "
        f"{inlined}; grad max rel err vs eager {max_rel(got, ref):.2e}; then a Python pair: {len(py)} pack calls "
        f"(parameters included); graphs {len(GRAPHS)}"
    )

    print("== 5. the project's RecoveryEngine, tiny Llama, each unit module's forward compiled")
    real_engine()


def real_engine():
    import transformers

    from hilore_actor.models.factory import tiny_config
    from hilore_actor.recovery import RecoveryEngine

    torch._dynamo.reset()
    GRAPHS.clear()
    torch.manual_seed(0)
    cfg = tiny_config("llama", hidden_size=D, num_layers=LAYERS)
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(3, 256, (1, T))

    def grads(eng=None, plan=None):
        model.zero_grad(set_to_none=True)
        with eng.step(plan) if eng else torch.enable_grad() as st:
            loss = model(ids, use_cache=False).logits.pow(2).mean()
            info = ""
            if eng:
                st.set_actions(plan)
                b = st.bytes_by_unit(shared=False)
                info = "layer 0 saved " + ", ".join(
                    f"{u.split('.')[-1]} {st.saved_counts()[u]} ({', '.join(f'{k} {v}' for k, v in b[u].items() if v)})"
                    for u in eng.unit_names[:2]
                )
            loss.backward()
        return [p.grad.clone() for p in model.parameters()], info

    ref, _ = grads()
    eng = RecoveryEngine(model)
    all_p = {u: "P" for u in eng.unit_names}
    for plan in ("all-h", "all-l", all_p):
        _, info = grads(eng, plan)
        print(f"[eager {plan if isinstance(plan, str) else 'all-P'}] {info}")
    for layer in model.model.layers:  # module hooks stay eager; children are traced into the graphs
        for m in (layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp):
            m.forward = torch.compile(m.forward, backend=backend)
    out = {}
    for plan in ("all-h", "all-r", "all-l", all_p):
        name = plan if isinstance(plan, str) else "all-P"
        out[name], info = grads(eng, plan)
        print(
            f"[compiled {name}] graphs {len(GRAPHS)}; grad max rel err vs eager {max_rel(out[name], ref):.2e}; {info}"
        )
    same = {k: all(torch.equal(p, q) for p, q in zip(out[k], out["all-h"])) for k in ("all-r", "all-P")}
    print(f"[compiled] grads bitwise equal to all-h's: {same}")


if __name__ == "__main__":
    main()
