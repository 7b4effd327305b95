"""Weight sync into a vLLM engine without vLLM's insecure (pickle) serialisation.

``LLM.apply_model(lambda ...)`` ships a function to the engine core: vLLM V1 serialises
engine-core calls with msgpack (``vllm/v1/serial_utils.py``, ``MsgpackEncoder.enc_hook``),
which refuses a function unless ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, and even then puts
the pickled closure (every merged weight) into one msgpack Ext, whose size field stops at
4 GiB (a 3B model's bf16 weights are 6 GB). Instead:

- ``WeightSyncExtension`` is a vLLM worker extension (``vllm.LLM(worker_extension_cls=EXTENSION)``):
  vLLM mixes it into its GPU worker class, so ``llm.collective_rpc(RPC_METHOD, args=...)``
  calls its method by name on every worker (each tensor-parallel rank loads its own shard
  through the model's ``load_weights``);
- the weights go in chunks of at most ``CHUNK_BYTES`` (a tensor larger than that alone),
  each tensor as ``[name, dtype, shape, bytes]``: plain msgpack types. A tensor in an untyped
  utility argument is encoded by vLLM but not decoded back into a tensor (the engine core
  decodes utility calls with an untyped decoder), so raw bytes are what arrives intact;
- a tied ``lm_head.weight`` is not sent: vLLM's loaders skip ``lm_head.`` when
  ``tie_word_embeddings`` (the head is the embedding), so it would cross the wire for nothing.

The method is not called ``update_weights``: newer vLLM workers have a native
``update_weights`` (its weight-transfer engines), and vLLM asserts that an extension's
attributes do not clash with the worker's. Nothing here imports vLLM.
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterator, List, Optional, Sequence

import torch

EXTENSION = f"{__name__}.WeightSyncExtension"
RPC_METHOD = "hilore_update_weights"
CHUNK_BYTES = 256 * 2**20
MSGPACK_BIN_MAX = 2**32 - 1  # one msgpack bin (bytes) object holds less than 4 GiB
HEAD, EMBED_SUFFIX = "lm_head.weight", "embed_tokens.weight"


def without_tied_head(weights: Dict[str, torch.Tensor], tied: bool) -> Dict[str, torch.Tensor]:
    """``weights`` less ``lm_head.weight`` when the model ties it to the embedding. The
    learner's export copies each tensor, so a tied head arrives as an equal copy rather
    than the same storage; either proves the tie. A tied config whose head differs from the
    embedding is an error (vLLM would silently keep the embedding as the head)."""
    if not tied or HEAD not in weights:
        return weights
    embed = next((v for k, v in weights.items() if k.endswith(EMBED_SUFFIX)), None)
    head = weights[HEAD]
    same = embed is not None and (
        head.data_ptr() == embed.data_ptr() or (head.shape == embed.shape and torch.equal(head, embed))
    )
    if not same:
        raise ValueError(
            "tie_word_embeddings is set but lm_head.weight differs from the embedding; "
            "vLLM would load the embedding as the head"
        )
    return {k: v for k, v in weights.items() if k != HEAD}


def encode(name: str, t: torch.Tensor) -> list:
    """``[name, dtype, shape, bytes]`` of one tensor (CPU bytes, row-major)."""
    t = t.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return [name, str(t.dtype).removeprefix("torch."), list(t.shape), data]


def decode(entry: Sequence) -> tuple:
    """``(name, tensor)`` back from ``encode``'s form (the tensor on the CPU)."""
    name, dtype_name, shape, data = entry
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name}: {dtype_name!r} is not a torch dtype")
    if not len(data):
        return name, torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():  # msgpack hands read-only bytes; the tensor is copied onward
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return name, flat.view(dtype).reshape(tuple(shape))


def chunks(weights: Dict[str, torch.Tensor], max_bytes: int = CHUNK_BYTES) -> Iterator[List[list]]:
    """Encoded tensors in groups of at most ``max_bytes`` (a larger tensor alone), in order."""
    group: List[list] = []
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if n > MSGPACK_BIN_MAX:
            raise ValueError(f"{name}: {n / 2**30:.1f} GiB does not fit one msgpack message (< 4 GiB)")
        if group and size + n > max_bytes:
            yield group
            group, size = [], 0
        group.append(encode(name, t))
        size += n
    if group:
        yield group


def tied_embeddings(llm) -> bool:
    """The engine's ``tie_word_embeddings`` (vLLM V1: ``llm.llm_engine.model_config.hf_config``)."""
    cfg = getattr(getattr(getattr(llm, "llm_engine", None), "model_config", None), "hf_config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


def sync_weights(llm, weights: Dict[str, torch.Tensor], max_bytes: Optional[int] = None) -> int:
    """Load ``weights`` (HF names) into ``llm``'s model through ``WeightSyncExtension``, one
    ``collective_rpc`` per chunk of at most ``max_bytes`` (default ``CHUNK_BYTES``); returns
    the number of calls."""
    calls = 0
    for group in chunks(without_tied_head(weights, tied_embeddings(llm)), max_bytes or CHUNK_BYTES):
        llm.collective_rpc(RPC_METHOD, args=(group,))
        calls += 1
    return calls


class WeightSyncExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``model_runner`` and ``device`` are its)."""

    def hilore_update_weights(self, entries: list) -> int:
        """Load one chunk (``encode``'s entries) into the model; returns the tensors loaded
        (an int: a plain msgpack reply)."""
        device = getattr(self, "device", None) or "cpu"
        weights = [(name, t.to(device)) for name, t in map(decode, entries)]
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)
