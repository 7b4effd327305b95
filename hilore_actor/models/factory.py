"""Decoder models without downloads: tiny configs built in code, or a local path.

Tests and benchmarks need Qwen2 (GQA), Llama (GQA) and Phi3 (MHA, fused qkv / gate_up) shapes
at sizes a 2-core CPU trains in seconds; users point ``load_model`` at a real checkpoint
directory, a ``config.json`` (random weights of that shape) or a GGUF file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

ARCHS = ("qwen2", "llama", "phi3")


@dataclass
class LoraSpec:
    """peft LoRA settings. ``targets="all-linear"`` adapts every linear layer but the LM head
    (``all_linear_targets``: peft's rule less the layers peft cannot wrap)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: Union[str, Sequence[str]] = "all-linear"


def tiny_config(
    arch: str = "qwen2",
    *,
    hidden_size: int = 64,
    intermediate_size: Optional[int] = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: Optional[int] = None,
    vocab_size: int = 256,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    **overrides,
):
    """An HF config of the given family. GQA (2 KV heads) for qwen2/llama, MHA for phi3."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS} or pass a config.json path")
    if num_kv_heads is None:
        num_kv_heads = num_heads if arch == "phi3" else max(1, num_heads // 2)
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config}[arch]
    kwargs = dict(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "phi3":
        kwargs["original_max_position_embeddings"] = max_position_embeddings
    kwargs.update(overrides)
    return cls(**kwargs)


def build_model(
    config,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    seed: Optional[int] = 0,
    lora: Optional[LoraSpec] = None,
):
    """A randomly initialised causal LM from an HF config (or an arch name for ``tiny_config``)."""
    import transformers

    if isinstance(config, str):
        config = tiny_config(config)
    attn_implementation = supported_attention(config, attn_implementation)
    config._attn_implementation = attn_implementation
    if seed is not None:
        torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return apply_lora(model, lora) if lora is not None else model


def supported_attention(config, requested: str) -> str:
    """``requested``, or ``eager`` with a one-line note when the architecture has no SDPA path
    (transformers refuses SDPA for some, e.g. gpt-oss, whose attention sinks need the eager
    kernel). Under eager attention the softmax probabilities are saved, and L keeps them exact
    with the rest of the attention core (``recovery.rules.KEEP_EXACT``)."""
    import transformers

    if requested != "sdpa":
        return requested
    cls = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
    if cls is None or getattr(cls, "_supports_sdpa", True):
        return requested
    print(
        f"[hilore] {cls.__name__} has no SDPA attention in transformers {transformers.__version__}; using eager",
        file=sys.stderr,
    )
    return "eager"


def load_model(
    path: Union[str, Path],
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    lora: Optional[LoraSpec] = None,
    seed: Optional[int] = 0,
):
    """Load a causal LM from a local path, never from a hub.

    - a directory with ``config.json`` and weights: ``from_pretrained`` (offline);
    - a directory with only ``config.json``, or a ``config.json`` file: random weights;
    - a ``.gguf`` file: dequantised by transformers' GGUF reader.
    """
    import transformers

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist (models are loaded from local paths only)")
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, local_files_only=True)
    if p.is_dir() and (p / "config.json").is_file() and attn_implementation == "sdpa":
        try:
            cfg = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
            kw["attn_implementation"] = supported_attention(cfg, attn_implementation)
        except (ValueError, KeyError, OSError):
            pass  # its own loader below says what is wrong with the directory
    if p.is_file() and p.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, **kw)
    elif p.is_file() or not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        cfg_file = p if p.is_file() else p / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{str(p)!r} has no config.json; expected an HF model directory, a config.json or a .gguf file"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file}: not valid JSON ({e})") from None
        if "model_type" not in raw:
            raise ValueError(f"{cfg_file}: no 'model_type' field; is this an HF causal-LM config?")
        config = transformers.AutoConfig.for_model(**raw)
        return build_model(config, dtype=dtype, attn_implementation=attn_implementation, seed=seed, lora=lora)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(p), **kw)
    return apply_lora(model, lora) if lora is not None else model


def apply_lora(model, lora: LoraSpec):
    """Wrap ``model`` in a peft LoRA model; only the adapters train."""
    import peft

    targets = (
        all_linear_targets(model)
        if lora.targets == "all-linear"
        else (lora.targets if isinstance(lora.targets, str) else list(lora.targets))
    )
    cfg = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, task_type="CAUSAL_LM"
    )
    return peft.get_peft_model(model, cfg)


# peft's _check_lora_target_modules_mamba refuses LoRA on these modules of these model types,
# although its own "all-linear" selects them (peft/tuners/tuners_utils.py).
_MAMBA_TYPES, _MAMBA_REFUSED = {"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}, {"out_proj", "conv1d"}


def all_linear_targets(model) -> list:
    """The full names of the layers peft's ``"all-linear"`` would adapt (every ``nn.Linear`` and
    GPT-2 ``Conv1D`` but the output head), less two kinds peft wraps but cannot run: a Linear
    subclass whose own ``forward`` returns no tensor (an MoE router returning ``(scores,
    logits)``: peft's wrapper calls the base layer and adds a tensor to the tuple) and the
    modules peft refuses on Mamba models. A subclass that returns a tensor (Falcon's
    ``FalconLinear``) is adapted, as peft does. Same modules as peft's on every other model."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    mamba = getattr(model.config, "model_type", None) in _MAMBA_TYPES
    plain = (torch.nn.Linear.forward, Conv1D.forward)
    out = [
        name
        for name, m in model.named_modules()
        if m is not head
        and (type(m).forward in plain or (isinstance(m, torch.nn.Linear) and _returns_tensor(m)))
        and not (mamba and name.rsplit(".", 1)[-1] in _MAMBA_REFUSED)
    ]
    if not out:
        raise ValueError(f"{type(model).__name__} has no linear layer for LoRA to adapt (lora targets: all-linear)")
    return out


def _returns_tensor(m: torch.nn.Linear) -> bool:
    """Whether a Linear subclass with its own forward returns a tensor, asked of one zero row
    (no gradient): a router's tuple, or a weight that cannot run here, says no."""
    try:
        with torch.no_grad():
            return isinstance(m(m.weight.new_zeros(1, m.in_features)), torch.Tensor)
    except Exception:  # noqa: BLE001 - whatever stops the call, peft's wrapper could not run it either
        return False


def init_lora_b(model, std: float, seed: int) -> None:
    """LoRA B away from zero, N(0, std) seeded, as after some training: with peft's B = 0 every
    ``lora_A`` gradient is zero, so an error measured there would only see ``lora_B``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
