"""verl 0.9.1's real FSDP engine on this CPU: a CPU platform, tiny models and GRPO batches.

verl has no CPU platform (its device helpers ask CUDA), and its own CPU tests stub the
engine; here only the platform is supplied, through verl's own plugin point
(``verl.plugin.platform.set_platform``), so ``FSDPEngine`` builds, wraps (FSDP2 or FSDP1 over
gloo, one rank) and trains exactly as it does on a GPU, minus the device.
"""
import contextlib

import torch

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def cpu_platform():
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, i): pass
        def synchronize(self, i=None): pass
        def manual_seed(self, s): torch.manual_seed(s)
        def manual_seed_all(self, s): torch.manual_seed(s)
        def set_allocator_settings(self, s): pass
        def empty_cache(self): pass
        def get_device_capability(self, i=0): return (None, None)
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    return PlatformCPU()


def save_tiny_model(path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return str(path)


def build_engine(cls, path: str, seed: int, *, gc: bool, remove_padding: bool = True, fsdp: str = "fsdp2",
                 micro_batch: int = 2):
    """verl's engine ``cls`` on the saved model, LoRA r4 with B set away from zero (seeded)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    mc = HFModelConfig(path=path, load_tokenizer=False, override_config={"attn_implementation": "sdpa"},
                       lora_rank=4, lora_alpha=8, enable_gradient_checkpointing=gc, use_remove_padding=remove_padding)
    ec = FSDPEngineConfig(strategy=fsdp, model_dtype="fp32", mixed_precision=fp32, use_torch_compile=False,
                          micro_batch_size_per_gpu=micro_batch, seed=seed)
    if cls.__name__ != "FSDPEngineWithLMHead":
        object.__setattr__(ec, "strategy", "hilore")  # as verl's actor config sets the registry key
    torch.manual_seed(seed)  # LoRA A's init
    engine = cls(mc, ec, FSDPOptimizerConfig(lr=1e-3), CheckpointConfig())
    engine.initialize()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if "lora_B" in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.copy_(0.05 * torch.randn(local.shape, generator=gen))
    return engine


def grpo_batch(seed: int, *, remove_padding: bool = True, B: int = 4, P: int = 8, R: int = 24, entropy: bool = False,
               full: bool = False):
    """A left/right-padded GRPO batch as verl's trainer hands it to the actor, made no-padding
    by verl's own ``left_right_2_no_padding``, with the non-tensor keys the worker adds;
    ``full``: every prompt P and every response R tokens (2 x (P + R) per micro-batch)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    plen = torch.full((B,), P) if full else torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.full((B,), R) if full else torch.randint(2, R + 1, (B,), generator=g)
    ids = torch.randint(1, TINY["vocab_size"], (B, P + R), generator=g)
    am = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        am[i, P - plen[i]:P] = 1
        am[i, P:P + rlen[i]] = 1
    td = TensorDict({"input_ids": ids, "attention_mask": am, "position_ids": (am.cumsum(-1) - 1).clamp(min=0),
                     "response_mask": am[:, P:].clone(), "prompts": ids[:, :P], "responses": ids[:, P:],
                     "old_log_probs": -3 * torch.rand(B, R, generator=g), "ref_log_prob": -3 * torch.rand(B, R, generator=g),
                     "advantages": torch.randn(B, R, generator=g)}, batch_size=B)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, temperature=1.0, use_remove_padding=remove_padding, use_dynamic_bsz=False,
                         micro_batch_size_per_gpu=2, global_batch_size=B, calculate_entropy=entropy,
                         use_fused_kernels=False, max_token_len_per_gpu=4096)
    return td


def ppo_loss_fn(**actor):
    from functools import partial

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=4, rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                          use_dynamic_bsz=False, **actor)
    return partial(ppo_loss, config=cfg)


def batch_gradient(engine, td, loss_fn) -> torch.Tensor:
    """One ``forward_backward_batch``; the trainable parameters' gradient (read inside train
    mode: leaving it zeroes the gradients)."""
    engine.optimizer_zero_grad()
    with engine.train_mode():
        engine.forward_backward_batch(td, loss_fn)
        return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().clone()
                          for p in engine.module.parameters() if p.requires_grad and p.grad is not None])
