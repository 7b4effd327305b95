"""Resolve a ``--pretrain`` spec to a model and its tokenizer, from local files only.

- ``smollm2``: the bundled SmolLM2-135M-Instruct (converted once to a cached HF folder);
- ``tiny:<qwen2|llama|phi3>``: a tiny random model with SmolLM2's tokenizer (tests, ``--preset tiny``);
- a path: an HF model directory, a ``config.json`` (random weights) or a ``.gguf`` file.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Tuple

import torch

from .factory import ARCHS, LoraSpec, apply_lora, build_model, load_model, tiny_config


def check_model_spec(spec: str) -> None:
    """Fail early, with a message a user can act on, for a spec that cannot load."""
    if spec == "smollm2" or spec.startswith("tiny:"):
        if spec.startswith("tiny:") and spec[5:] not in ARCHS:
            raise ValueError(f"--pretrain {spec}: unknown tiny architecture; choose tiny:{' | tiny:'.join(ARCHS)}")
        return
    p = Path(spec).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"--pretrain {spec}: no such file or directory (models load from local paths only; "
            f"'smollm2' and 'tiny:qwen2' are built in)"
        )
    if p.is_dir() and not (p / "config.json").is_file() and not any(p.glob("*.gguf")):
        raise FileNotFoundError(
            f"--pretrain {spec}: the directory has no config.json, so it is not an HF model directory"
        )


def load_tokenizer(spec: str):
    import transformers

    if spec == "smollm2" or spec.startswith("tiny:"):
        from .smollm2 import convert_smollm2

        path = convert_smollm2()
    else:
        p = Path(spec).expanduser()
        path = p.parent if p.is_file() else p
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"--pretrain {spec}: no tokenizer found in {path} ({e})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(
    spec: str, *, dtype: torch.dtype = torch.float32, lora: Optional[LoraSpec] = None, seed: int = 0
) -> Tuple[object, object]:
    """(model, tokenizer) for ``spec``; random parts (tiny models, LoRA A) are seeded, so every
    worker that loads the same spec with the same seed holds the same weights."""
    check_model_spec(spec)
    tok = load_tokenizer(spec)
    torch.manual_seed(seed)
    if spec.startswith("tiny:"):
        model = build_model(policy_config(spec, tok), dtype=dtype, seed=seed)
    elif spec == "smollm2":
        from .smollm2 import convert_smollm2

        model = load_model(convert_smollm2(), dtype=dtype, seed=seed)
    else:
        model = load_model(spec, dtype=dtype, seed=seed)
    if lora is not None:
        torch.manual_seed(seed)
        model = apply_lora(model, lora)
    return model, tok


def policy_config(spec: str, tok):
    """The HF config of ``spec`` (read from its files; a tiny model's built), or None for a
    ``.gguf`` file, whose config transformers reads only with its weights."""
    import json

    import transformers

    if spec.startswith("tiny:"):
        return tiny_config(
            spec[5:],
            hidden_size=64,
            num_layers=4,
            num_heads=4,
            vocab_size=len(tok),
            tie_word_embeddings=True,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )
    if spec == "smollm2":
        from .smollm2 import convert_smollm2

        return transformers.AutoConfig.from_pretrained(str(convert_smollm2()), local_files_only=True)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return None
    cfg_file = p if p.is_file() else p / "config.json"
    return transformers.AutoConfig.for_model(**json.loads(cfg_file.read_text()))


def meta_policy(spec: str, tok, *, dtype: torch.dtype = torch.float32, lora: Optional[LoraSpec] = None):
    """``load_policy``'s model on the meta device (shapes and dtypes, no memory, no weights read),
    or None where its config cannot be read without the weights: what the resident bytes are
    computed from before any worker starts."""
    config = policy_config(spec, tok)
    if config is None:
        return None
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft's call of a renamed transformers method
        model = build_model(config, dtype=dtype, seed=None)
        return apply_lora(model, lora) if lora is not None else model
