"""``python -m hilore_actor.openrlhf.train_ppo_ray <OpenRLHF 0.11.2 flags> --actor_backend hilore``.

The runtime plugin: OpenRLHF's own CLI, unchanged, with HiLoRe's policy actor.

1. Our flags come out of argv: ``--actor_backend {deepspeed,hilore}`` (also
   ``--actor.backend``) and every ``--hilore.*`` (``--help`` gives their meaning and
   defaults). Everything else goes to OpenRLHF.
2. OpenRLHF's argparse block lives under ``if __name__ == "__main__"`` in
   ``openrlhf/cli/train_ppo_ray.py``. We run that block's own code (parsed from the module's
   source) with the module's globals, so its parser, defaults and validation run as they are;
   only the final ``train(args)`` call reaches our ``train``, which checks for CUDA, swaps in
   ``HiLoRePolicyModelActor``, passes the HiLoRe settings to the workers (Ray runtime env)
   and calls OpenRLHF's ``train``.

Also usable as ``ray job submit -- python -m hilore_actor.openrlhf.train_ppo_ray ...``.
Without OpenRLHF, or without a GPU, it stops with a message, not a traceback. ``--help`` lists
OpenRLHF's flags and ours on any machine, vllm or not (``print_help``).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
from typing import Callable, Dict, List, Optional, Tuple

BACKENDS = ("deepspeed", "hilore")
OPENRLHF_VERSION = "0.11.2"


class PluginError(RuntimeError):
    """A failure the user can act on; printed as one message, exit code 2."""


def split_flags(argv: List[str]) -> Tuple[str, Dict[str, str], List[str]]:
    """``(backend, {hilore key: value}, OpenRLHF's argv)``; ``--flag=value`` and ``--flag value``."""
    backend, hilore, rest = "deepspeed", {}, []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if name in ("--actor_backend", "--actor.backend") or name.startswith("--hilore."):
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise PluginError(f"{name} needs a value")
                value, i = argv[i + 1], i + 1
            if name.startswith("--hilore."):
                hilore[name[len("--hilore.") :]] = value
            elif value not in BACKENDS:
                raise PluginError(f"{name} {value!r}: choose one of {', '.join(BACKENDS)}")
            else:
                backend = value
        else:
            rest.append(arg)
        i += 1
    return backend, hilore, rest


def hilore_config(raw: Dict[str, str]) -> Dict:
    """Typed, validated ``--hilore.*`` values (the learner room's flag table and checks)."""
    from ..learner.settings import parse_hilore

    try:
        return parse_hilore(raw)
    except ValueError as e:
        raise PluginError(str(e)) from None


def import_cli():
    """OpenRLHF's CLI module, or a message saying what is missing."""
    if importlib.util.find_spec("openrlhf") is None:
        raise PluginError(
            f"OpenRLHF is not installed: pip install 'hilore-actor[openrlhf]' (openrlhf=={OPENRLHF_VERSION})"
        )
    from importlib.metadata import version

    if version("openrlhf") != OPENRLHF_VERSION:
        print(
            f"[hilore] warning: built against OpenRLHF {OPENRLHF_VERSION}, found {version('openrlhf')}", file=sys.stderr
        )
    try:
        import openrlhf.cli.train_ppo_ray as cli
    except ImportError as e:
        raise PluginError(
            f"OpenRLHF's Ray trainer could not be imported ({e}). It imports vllm and flash-attn at module "
            f"level, which install only on a CUDA machine: pip install 'hilore-actor[gpu,openrlhf]' there"
        ) from None
    return cli


def main_block(path: str) -> ast.Module:
    """The body of ``if __name__ == "__main__":`` in a module's source."""
    tree = ast.parse(open(path).read(), filename=path)
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return ast.Module(body=node.body, type_ignores=[])
    raise PluginError(f'{path}: no `if __name__ == "__main__"` block (not OpenRLHF {OPENRLHF_VERSION}\'s CLI?)')


def run_cli_main(module, argv: List[str], train: Callable, path: Optional[str] = None):
    """Run ``module``'s ``__main__`` block on ``argv`` with ``train`` in place of the module's.
    OpenRLHF validates with ``assert``: a failed one becomes a ``PluginError``."""
    path = path or module.__file__
    code = compile(main_block(path), path, "exec")
    namespace = dict(vars(module), __name__="__main__", train=train)
    saved = sys.argv
    sys.argv = [path] + list(argv)
    try:
        exec(code, namespace)
    except AssertionError as e:
        raise PluginError(f"OpenRLHF rejected the flags: {e}") from None
    finally:
        sys.argv = saved


PROG = "python -m hilore_actor.openrlhf.train_ppo_ray"
HELP_TITLE = "HiLoRe (taken out of the command line before OpenRLHF parses it)"


def add_our_flags(parser) -> None:
    """``--actor_backend`` and the ``--hilore.*`` flags (the learner room's table, with their
    defaults) as one group of ``parser``, for ``--help``; ``split_flags`` parses them."""
    from ..learner.settings import add_flags

    group = parser.add_argument_group(HELP_TITLE)
    group.add_argument(
        "--actor_backend",
        "--actor.backend",
        choices=BACKENDS,
        default="deepspeed",
        help="the policy actor: OpenRLHF's own (deepspeed, the default) or HiLoRe's (hilore)",
    )
    add_flags(group)


def help_parser_class():
    """``argparse.ArgumentParser`` that adds our group as it parses, named as this module."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("prog", PROG)
            super().__init__(*args, **kwargs)

        def parse_known_args(self, args=None, namespace=None):
            if not any(g.title == HELP_TITLE for g in self._action_groups):
                add_our_flags(self)
            return super().parse_known_args(args, namespace)

    return Parser


def print_help() -> int:
    """OpenRLHF's own help with ours as one more group. Its parser is built by running its CLI's
    ``__main__`` block from the source, the module not imported (it imports vllm, which installs
    only on a CUDA machine), so ``--help`` works on any machine. Without OpenRLHF, or if the block
    needs more than argparse, only our group, with one line saying where OpenRLHF's help is."""
    import argparse
    import datetime
    import types

    note = None
    try:
        spec = importlib.util.find_spec("openrlhf")
        if spec is None:
            raise PluginError(
                f"OpenRLHF is not installed (pip install 'hilore-actor[openrlhf]', "
                f"openrlhf=={OPENRLHF_VERSION}): its own flags are not listed"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], "cli", "train_ppo_ray.py")
        shim = types.ModuleType("argparse")
        shim.__dict__.update(vars(argparse), ArgumentParser=help_parser_class())
        namespace = {
            "__name__": "__main__",
            "__file__": path,
            "argparse": shim,
            "os": os,
            "datetime": datetime.datetime,
        }  # the module's imports the block uses
        saved, sys.argv = sys.argv, [path, "--help"]
        try:
            exec(compile(main_block(path), path, "exec"), namespace)
        finally:
            sys.argv = saved
    except SystemExit as e:  # argparse's --help
        return int(e.code or 0)
    except PluginError as e:
        note = str(e)
    except Exception as e:  # a block that needs the module's other imports
        note = (
            f"OpenRLHF's own flags are not listed ({type(e).__name__}: {e}): its help needs its GPU install "
            f"(python -m openrlhf.cli.train_ppo_ray --help there)"
        )
    parser = help_parser_class()(description="OpenRLHF's train_ppo_ray with HiLoRe's policy actor.")
    add_our_flags(parser)
    parser.print_help()
    print(f"\nnote: {note}")
    return 0


def unsupported(args, settings: Optional[Dict] = None) -> List[str]:
    """OpenRLHF settings the drop-in cannot run yet, each with the reason."""
    ds = getattr(args, "ds", None)
    out = []
    if (settings or {}).get("compile") and getattr(ds, "zero_stage", None) == 3:
        out.append(
            "--hilore.compile with --ds.zero_stage 3: ZeRO-3 gathers each submodule's weights in hooks that "
            "torch.compile would trace into the compiled units (use ZeRO-2 or leave --hilore.compile off)"
        )
    if (getattr(ds, "ring_attn_size", 1) or 1) > 1:
        out.append(
            "--ds.ring_attn_size > 1: ring attention puts collectives inside the recovery units, and ranks "
            "recomputing different units would deadlock"
        )
    if (getattr(ds, "tensor_parallel_size", 1) or 1) > 1:
        out.append(
            "--ds.tensor_parallel_size > 1: DeepSpeed AutoTP puts collectives inside the recovery units, and "
            "ranks recomputing different units would deadlock"
        )
    return out


def use_hilore(args, settings: Optional[Dict] = None):
    """Called with OpenRLHF's parsed args (also by the patched ``train_ppo_ray.py``): refuse the
    settings the drop-in cannot run (also ``--hilore.skip_zero_advantage on`` where skipping would
    change the update, ``skip.py``), start Ray with the HiLoRe settings in the workers'
    environment, check that the cluster has GPUs (OpenRLHF's actors run on GPU workers; the
    driver itself may be a CPU-only head node), return the actor class that replaces
    ``PolicyModelActor``."""
    if settings is None:  # the patch puts --hilore.* (raw strings, learner.settings.add_flags) into OpenRLHF's parser
        hilore = getattr(args, "hilore", None)
        settings = hilore_config({k: v for k, v in vars(hilore).items() if v is not None} if hilore is not None else {})
    bad = unsupported(args, settings)
    if bad:
        raise PluginError("--actor_backend hilore cannot run with " + "; ".join(bad))
    from .skip import resolve

    try:  # `on` where skipping would change the update; the workers resolve it again from the recipe
        resolve((settings or {}).get("skip_zero_advantage") or "auto", args)
    except ValueError as e:
        raise PluginError(str(e)) from None
    import ray

    from .policy_actor import CONFIG_ENV, HiLoRePolicyModelActor

    os.environ[CONFIG_ENV] = json.dumps(settings)
    started = not ray.is_initialized()
    if started:  # OpenRLHF's own init, plus our settings for every worker
        env = {
            "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
            "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
            CONFIG_ENV: os.environ[CONFIG_ENV],
        }
        ray.init(runtime_env={"env_vars": env})
    if not ray.cluster_resources().get("GPU", 0):
        if started:
            ray.shutdown()
        raise PluginError(
            "OpenRLHF's Ray trainer needs CUDA GPUs in the Ray cluster (its actors run on GPU workers) and "
            "this cluster has none; on a CPU machine use `python -m hilore_actor.train_grpo`, which runs the "
            "same HiLoRe learner"
        )
    return HiLoRePolicyModelActor


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        return print_help()
    try:
        backend, raw, rest = split_flags(argv)
        settings = hilore_config(raw) if backend == "hilore" else None
        if raw and backend != "hilore":
            raise PluginError("--hilore.* flags need --actor_backend hilore")
        cli = import_cli()

        def train(args):
            if backend == "hilore":
                cli.PolicyModelActor = use_hilore(args, settings)  # train() reads the module global
            return cli.train(args)

        run_cli_main(cli, rest, train)
        return 0
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
