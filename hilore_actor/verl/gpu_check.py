"""The verl stage of ``benchmarks/gpu_check.sh``: a reduced ``verify.check`` on one GPU.

``verify.check`` (verl's FSDP engine with its gradient checkpointing twice, the second run
being the noise floor, then HiLoRe's engine in modes hilore-hr and hilore; gradients against
verl's, every micro-batch's peak within B, times) on a small random-weight Qwen2 model written
on the device, SDPA attention (no flash-attn needed), bf16 autocast over float32 master
weights, one batch of ``--seqs`` sequences of ``--tokens`` tokens in micro-batches of 2.
``python -m hilore_actor.verl.verify`` is the full check (SmolLM2, flash-attn, 8 x 2048).

Exit status: 0 passed, 1 a gradient or peak failure, 2 no CUDA device, 3 skipped: a module
verl's engine path imports is missing (named on one line, the ``skipped:`` line, and in the
result JSON). Until the check ends, the result JSON holds ``"partial": true`` and every line
the check has logged (each engine's gradient norm and peak), rewritten after each line, so a
stage cut short by its timeout keeps them.

Stand-ins (``--stand-ins``, each used only where needed, printed and written to the result):

- ``ray``: ``import verl`` imports it (``verl.protocol``), and verl's engine never calls it in
  one process; its wheel is large and binary. Where it is not installed, an import-only module
  takes its place: any of its names raises when used, so a call the engine path does make
  fails the stage instead of passing it; only ``ray.is_initialized()`` answers, False (no Ray
  cluster runs here, so HiLoRe's engine starts no budget coordinator).
- ``verl.utils.dataset``: the engine imports ``verl.utils.dataset.dataset_utils`` (an enum),
  and the package's ``__init__`` imports verl's dataset classes (``datasets``, ``pandas``,
  ``PIL``). Where one of those is not installed, the package is entered without running its
  ``__init__``; its modules import as they are.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
import types

STAND_INS = ("ray", "verl.utils.dataset")
DATASET_IMPORTS = ("datasets", "pandas", "PIL")  # what verl.utils.dataset's __init__ imports
ENGINE_IMPORTS = (
    "tensordict",
    "verl.trainer.config",
    "verl.workers.config",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.utils.losses",
    "verl.workers.utils.padding",
    "verl.utils.tensordict_utils",
)
SKIPPED = 3


class _Absent:
    """What every name of the ray stand-in is: making or calling one raises."""

    def __init__(self, *a, **k):
        raise RuntimeError(
            f"{type(self).__module__}.{type(self).__name__} was used, but its module is an "
            "import-only stand-in (hilore_actor.verl.gpu_check)"
        )


def ray_stand_in() -> types.ModuleType:
    """An import-only ``ray``: each attribute is a fresh class that raises when made or called;
    ``is_initialized()`` is False."""
    mod = types.ModuleType("ray", "import-only stand-in for ray (hilore_actor.verl.gpu_check)")
    mod.__spec__ = importlib.machinery.ModuleSpec("ray", None)

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (_Absent,), {"__module__": "ray"})

    mod.__getattr__ = __getattr__
    mod.is_initialized = lambda: False
    return mod


def dataset_package_without_init() -> types.ModuleType:
    """``verl.utils.dataset`` as a package whose ``__init__`` has not run (its submodules import
    from its real directory)."""
    spec = importlib.util.find_spec("verl.utils")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "dataset")
    mod = types.ModuleType(
        "verl.utils.dataset", "verl.utils.dataset without its __init__ (hilore_actor.verl.gpu_check)"
    )
    mod.__spec__ = importlib.machinery.ModuleSpec("verl.utils.dataset", None, is_package=True)
    mod.__spec__.submodule_search_locations = [path]
    mod.__path__ = [path]
    return mod


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def import_engine_path(allowed=STAND_INS):
    """Import what the check uses, with the ``allowed`` stand-ins where needed. Returns (stand-ins
    used, None) or (stand-ins used, the missing module and what needed it)."""
    used, mod = [], "transformers"
    try:
        importlib.import_module(mod)  # first: its optional-package checks see no stand-in
        if "ray" in allowed and "ray" not in sys.modules and not _installed("ray"):
            sys.modules["ray"] = ray_stand_in()
            used.append("ray")
        mod = "verl.utils"
        if "verl.utils.dataset" in allowed and _installed("verl") and not all(_installed(m) for m in DATASET_IMPORTS):
            importlib.import_module(mod)
            sys.modules["verl.utils.dataset"] = dataset_package_without_init()
            used.append("verl.utils.dataset")
        for mod in ENGINE_IMPORTS + ("hilore_actor.verl.fsdp_engine",):
            importlib.import_module(mod)
    except ModuleNotFoundError as e:
        return used, e.name if e.name == mod else f"{e.name} (imported by {mod}: {e})"
    return used, None


def write_model(path: str, seed: int, layers: int, hidden: int, vocab: int) -> str:
    """A random-weight Qwen2 causal LM with ``layers`` layers written as an HF directory."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    heads = max(hidden // 64, 1)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=(hidden * 11 // 4) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["Qwen2ForCausalLM"],
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def reduced_check(path: str, args, attn: str = "sdpa", mixed: bool = True, log=print):
    """``verify.check`` on the model at ``path`` (one batch of ``args.seqs`` x ``args.tokens``)."""
    from transformers import AutoConfig

    from . import verify

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompt = args.tokens // 8
    batch = verify.grpo_batch(
        args.seed, vocab=vocab, B=args.seqs, P=prompt, R=args.tokens - prompt, full=True, micro_batch=2
    )
    loss_fn = verify.ppo_loss_fn(batch_size=args.seqs, micro_batch=2)
    settings = {"budget": args.budget, "loo": False, "profile_repeats": 1, "calibration_batches": 2}
    job = {"plan_tokens": 2 * args.tokens, "seqs_per_microbatch": 2, "group_size": args.seqs, "fsdp": "fsdp2"}
    return verify.check(
        lambda kind: verify.build_engine(
            kind, path, args.seed, micro_batch=2, attn=attn, mixed=mixed, settings=settings, job=job
        ),
        batch,
        loss_fn,
        steps=args.steps,
        log=log,
    )


def _write(path: str, doc) -> None:
    """Through a temporary file: a kill while writing leaves the previous whole file."""
    tmp = os.path.join(os.path.dirname(path) or ".", f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hilore_actor.verl.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--workdir", default="/tmp/hilore-verl-gpu-check", help="where the random-weight model is written")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seqs", type=int, default=4, help="sequences per batch (micro-batches of 2)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (one eighth prompt)")
    p.add_argument("--budget", default="1.10")
    p.add_argument("--steps", type=int, default=1, help="timed batches per engine after the gradient check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stand-ins",
        default=",".join(STAND_INS),
        help=f"comma list, a subset of {','.join(STAND_INS)}, or '' for none: import-only modules where not installed",
    )
    p.add_argument("--parse-only", action="store_true", help="check the arguments, print them and exit 0")
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    allowed = tuple(s for s in args.stand_ins.split(",") if s)
    if set(allowed) - set(STAND_INS):
        p.error(f"--stand-ins: only {', '.join(STAND_INS)} may be stood in")
    if args.seqs < 2 or args.seqs % 2 or args.tokens < 16:
        p.error("--seqs must be even (micro-batches of 2) and --tokens at least 16")
    if args.parse_only:
        print("[verl-check] arguments ok:", json.dumps(vars(args)))
        return 0
    used, missing = import_engine_path(allowed)
    if used:
        print(f"[verl-check] stand-ins: {', '.join(used)}", flush=True)
    if missing:
        print(f"skipped: verl's engine path cannot be imported: missing module {missing}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"skipped": f"missing module {missing}", "stand_ins": used}, f, indent=1)
        return SKIPPED
    import torch

    from .verify import one_gpu_process_group

    if not one_gpu_process_group("hilore_actor.verl.gpu_check", "29512"):
        return 2
    lines = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)
        _write(args.out, {"partial": True, "stand_ins": used, "log": lines})

    log(f"[verl-check] writing a random Qwen2 ({args.layers} layers, hidden {args.hidden}) to {args.workdir}")
    path = write_model(os.path.join(args.workdir, "qwen2-random"), args.seed, args.layers, args.hidden, args.vocab)
    log("[verl-check] model written; building the engines")
    result = reduced_check(path, args, log=log)
    result.update(
        model=f"random Qwen2, {args.layers} layers, hidden {args.hidden}",
        attn="sdpa",
        seqs=args.seqs,
        tokens=args.tokens,
        budget=args.budget,
        stand_ins=used,
        torch=torch.__version__,
        device=torch.cuda.get_device_name(0),
        log=lines,
    )
    _write(args.out, result)
    print(
        json.dumps({k: result[k] for k in ("noise_floor", "relative_error", "peak_over_budget", "failures")}),
        flush=True,
    )
    torch.distributed.destroy_process_group()
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
