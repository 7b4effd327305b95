"""Ulysses degree 2 on two gloo ranks: verl's engine and HiLoRe's, with verl's all-to-all attention.

The case ``ulysses`` of ``verl_ranks.py`` (two processes, one rank each, verl 0.9.1's real FSDP2
engine on the CPU platform of ``verl_cpu.py``) with ``ulysses_sequence_parallel_size=2``: one SP
group of two ranks (dp 1), so both ranks get the same batch, as verl's dispatch by DP rank gives
them; a rank left in a collective the other skipped hangs both; ``tests/verl/test_verl_ulysses.py``
asserts on what the ranks saw. It runs last: its stand-ins and meter stay for the rest of the process.

What runs is verl's own Ulysses code: its input padding and slicing
(``ulysses_pad_and_slice_inputs``), its patched attention (``_ulysses_flash_attention_forward``:
``gather_seq_scatter_heads`` on q, k, v, an all-gather of the position ids, then
``gather_heads_scatter_seq`` on the output, each an autograd all-to-all over gloo) and its output
gather (``gather_outputs_and_unpad``). Only two things stand in, both for flash-attn, which has
no CPU build: the attention implementation name ``ATTN`` is transformers' own
``flash_attention_forward`` registered under a new name (``flash_attention_2`` would make
transformers look for the flash-attn package), and the varlen kernel that verl's wrapper calls
between its all-to-alls is ``cpu_varlen`` (causal SDPA within each packed sequence).

Per rank: verl's engine with its gradient checkpointing under Ulysses 2, the same without SP (a
check of the stand-in and of verl's all-to-alls), then HiLoRe's engine in modes hilore-hr and
hilore; one ``forward_backward_batch`` each (two micro-batches); the whole LoRA gradient, the
plan, the actions taken on each micro-batch and the all-to-alls run; then the zero-advantage skip
against the same engine without it.

The ranks measure peaks with the storage meter (``runtime/storage_meter.py``), not the profiler
one: the profiler records the allocator events of the thread that runs the region, and gloo's
worker threads drop the last reference to some of FSDP2's collective buffers at moments that
depend on timing, so that meter measured one and the same pass anywhere in 811-870 KB (20
repeats), a spread as large as the room B = 1.2 x gc leaves a plan; a fit measured high then
planned to store nothing. The storage meter counts a storage's release on any thread: the same
bytes on every repeat after the first.
"""

import contextlib
import os

import torch

import verl_cpu

ATTN = "hilore_cpu_varlen"
SP = 2
ALL_TO_ALL = [0]  # verl's all-to-alls run on this rank (forward, backward, recompute)


def cpu_varlen(q, k, v, attention_mask, query_length, *args, position_ids=None, softmax_scale=None, **kwargs):
    """flash-attn's varlen forward on the CPU: causal attention within each packed sequence (a
    sequence starts where the position ids do not continue), GQA by SDPA. [b, s, h, d] in/out."""
    pos = position_ids.reshape(-1)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[1:] = pos[1:] != pos[:-1] + 1
    seq = start.cumsum(0)
    i = torch.arange(pos.numel(), device=pos.device)
    mask = (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def use_stand_ins() -> None:
    """The attention name, the kernel verl's Ulysses wrapper calls, and a count of verl's all-to-alls."""
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.ulysses as ulysses
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward

    AttentionInterface.register(ATTN, flash_attention_forward)
    monkey_patch._flash_attention_forward = cpu_varlen
    all_to_all = ulysses.all_to_all_tensor

    def counted(*args, **kwargs):
        ALL_TO_ALL[0] += 1
        return all_to_all(*args, **kwargs)

    ulysses.all_to_all_tensor = counted  # SeqAllToAll looks it up at call time


@contextlib.contextmanager
def ulysses(size: int):
    """``verify.build_engine``'s engine config with ``ulysses_sequence_parallel_size=size``."""
    import verl.workers.config as config

    original = config.FSDPEngineConfig
    config.FSDPEngineConfig = lambda **kw: original(**kw, ulysses_sequence_parallel_size=size)
    try:
        yield
    finally:
        config.FSDPEngineConfig = original


def per_microbatch(mb) -> tuple:
    """The actions each micro-batch took, appended as it closes, and whether it ran HiLoRe's
    step (a micro-batch whose sized plan stores nothing runs plain layer checkpointing: no
    online choice, no gather, nothing to disagree on)."""
    seen, stepped, close = [], [], mb.close

    def closing():
        was_open = mb._open is not None
        if was_open:
            stepped.append(mb._open[1].step is not None)
        close()
        if was_open:
            seen.append(dict(mb.last["actions"]))

    mb.close = closing
    return seen, stepped


def gathers(mb) -> list:
    """How many units' token norms each online choice gathered over the group."""
    seen, whole = [], mb._whole_norms

    def counted(norms):
        seen.append(len(norms))
        return whole(norms)

    mb._whole_norms = counted
    return seen


def overrule(mb, rank: int) -> None:
    """The ranks' own choices differ on every micro-batch that runs a step: rank 0 recomputes
    every attention unit (its all-to-alls run again in backward), rank 1 stores every one; both
    keep their plan's MLP actions. The group must take rank 0's. The peaks the first batch
    observed are forgotten, so the first micro-batch runs the planning-size plan again (sized by
    them, a plan may store nothing and skip the step)."""
    from hilore_actor.recovery.labels import action_for_plan

    def own(step, out, sp=None):
        sp = sp or mb.plan.sp
        attention = "R" if rank == 0 else "H"
        return {n: attention if n.endswith("self_attn") else action_for_plan(q) for n, q in sp.plan.items()}

    mb.plan.actions = own
    mb.plan.info.pop("peak_ratios", None)
    mb.plan._sized.clear()


def hilore_record(engine, g, ref, a2a, actions) -> dict:
    mb = engine.hilore
    return {
        "equal": bool(torch.equal(g, ref)),
        "rel": float((g - ref).norm() / ref.norm()),
        "plan": dict(mb.plan.sp.plan),
        "budget": mb.plan.budget,
        "tokens": mb.plan.sp.costs.tokens,
        "actions": list(actions),
        "all_to_all": a2a,
        "disagreements": mb.disagreements,
        "class": type(mb).__name__,
        "peaks": list(mb.batch_peaks),
    }


def skip_against_off(on, off, gradient, td) -> dict:
    """The zero-advantage skip (``on``: the setting's default, auto) under Ulysses: both ranks of
    the SP group leave out the same two responses of four; the gradient of ``off`` on the same
    batch, and each engine's micro-batch count."""
    batch = td.clone()
    batch["advantages"][[0, 2]] = 0.0
    g_on, _ = gradient(on, batch)
    g_off, _ = gradient(off, batch)
    return {
        "rel": float((g_on - g_off).norm() / g_off.norm()),
        "microbatches": [len(on.hilore.batch_peaks), len(off.hilore.batch_peaks)],
        "share": on.hilore.skip["zero_adv_share"],
    }


def run_kinds(path: str, seed: int, td, loss_fn, rank: int) -> dict:
    from hilore_actor.verl import verify
    from hilore_actor.verl.settings import CONFIG_ENV

    def build(kind, sp, skip="auto"):
        try:
            with ulysses(sp):
                settings = {**verl_cpu.SETTINGS, "skip_zero_advantage": skip}
                return verify.build_engine(kind, path, seed, attn=ATTN, settings=settings, job=verl_cpu.JOB)
        finally:
            os.environ.pop(CONFIG_ENV, None)

    def gradient(engine, batch=td):
        ALL_TO_ALL[0] = 0
        return verify.batch_gradient(engine, batch.clone(), loss_fn), ALL_TO_ALL[0]

    ref, ref_a2a = gradient(build("verl", SP))
    no_sp, _ = gradient(build("verl", 1))
    seen = {"verl": {"all_to_all": ref_a2a, "no_sp_rel": float((no_sp - ref).norm() / ref.norm())}}
    for kind in ("hilore-hr", "hilore"):
        engine = build(kind, SP)
        (actions, stepped), gathered = per_microbatch(engine.hilore), gathers(engine.hilore)
        g, a2a = gradient(engine)
        seen[kind] = dict(hilore_record(engine, g, ref, a2a, actions), gathers=list(gathered), stepped=list(stepped))
        if kind == "hilore-hr":
            overrule(engine.hilore, rank)
            del actions[:], stepped[:]
            engine.hilore.disagreements = 0
            g, a2a = gradient(engine)
            seen["overruled"] = dict(hilore_record(engine, g, ref, a2a, actions), stepped=list(stepped))
            seen["skip"] = skip_against_off(engine, build("hilore-hr", SP, skip="off"), gradient, td)
    local = torch.arange(3.0).reshape(1, 3) + 10 * rank
    seen["gathered"] = engine.hilore._whole_norms({"b": 2 * local, "a": local})["a"].tolist()
    return seen


def ulysses_runs(rank: int, path: str, seed: int) -> dict:
    import verl.workers.engine.fsdp.transformer_impl as impl

    impl.device_name = "cpu"  # read at import, before the CPU platform: only the Ulysses mesh uses it
    from hilore_actor.runtime import memory
    from hilore_actor.verl import verify

    use_stand_ins()
    memory.CPU_METER = "storage"  # the module docstring
    td = verify.grpo_batch(seed + 100, vocab=verl_cpu.TINY["vocab_size"])  # one DP rank: the same batch on both
    seen = run_kinds(path, seed, td, verify.ppo_loss_fn(), rank)
    seen["packed_tokens"] = int(td["input_ids"].values().numel())
    return seen
