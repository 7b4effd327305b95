"""verl 0.9.1's real FSDP engine on this CPU: a CPU platform and a tiny model (the engines,
batches and gradients come from ``hilore_actor.verl.verify``, which the GPU check runs too).

verl has no CPU platform (its device helpers ask CUDA), and its own CPU tests stub the
engine; here only the platform is supplied, through verl's own plugin point
(``verl.plugin.platform.set_platform``), so ``FSDPEngine`` builds, wraps (FSDP2 or FSDP1 over
gloo, one rank) and trains exactly as it does on a GPU, minus the device.
"""

import contextlib

import torch

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
# HiLoRe's settings and job facts for the tiny model's engines (one planning pass each, no leave-one-out)
SETTINGS = {"budget": "1.2", "loo": False, "profile_repeats": 1, "calibration_batches": 2}
JOB = {"plan_tokens": 64, "group_size": 4, "fsdp": "fsdp2"}


def cpu_platform():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, i):
            pass

        def synchronize(self, i=None):
            pass

        def manual_seed(self, s):
            torch.manual_seed(s)

        def manual_seed_all(self, s):
            torch.manual_seed(s)

        def set_allocator_settings(self, s):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, i=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    return PlatformCPU()


def start_rank(rank: int, world: int, port: int) -> None:
    """One gloo rank of a two-rank script: a hang dumps its stacks and exits after
    ``HILORE_TEST_HANG_S`` (a collective the other rank skipped), the CPU platform, the process
    group, and HiLoRe's engine registered for the CPU."""
    import faulthandler
    import os

    import torch.distributed as dist
    from verl.plugin.platform import platform_manager

    from hilore_actor.verl.fsdp_engine import register_for

    faulthandler.dump_traceback_later(float(os.environ.get("HILORE_TEST_HANG_S", "240")) + 5 * rank, exit=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    platform_manager.set_platform(cpu_platform())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    register_for(("cpu",))


def save_tiny_model(path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return str(path)


def save_tiny_chat_model(path, seed: int = 0) -> str:
    """A model folder verl's trainer can open as a recipe's ``actor_rollout_ref.model.path``: the
    tiny Llama with the bundled SmolLM2 tokenizer and its chat template (verl's dataset applies it
    to the prompts), the vocabulary the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hilore_actor.models.source import load_tokenizer

    tok = load_tokenizer("smollm2")
    tok.save_pretrained(path)
    ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"], **ids)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def two_ranks(cases, tmp_path, seed: int, timeout: int, hang_s: int) -> dict:
    """Run ``tests/helpers/verl_ranks.py`` (two gloo ranks of verl's engine) on a tiny model saved
    under ``tmp_path``: each case's results on the two ranks. ``hang_s``: the ranks dump their
    stacks and exit after that many seconds (a collective one rank skipped)."""
    from gloo_ranks import run_ranks

    model = save_tiny_model(tmp_path / "tiny", seed)
    out = tmp_path / "ranks.json"
    env = {"HILORE_TEST_HANG_S": str(hang_s)}
    ranks = run_ranks("verl_ranks.py", model, seed, out, *cases, out=out, timeout=timeout, env=env)
    return {case: [r[case] for r in ranks] for case in cases}
