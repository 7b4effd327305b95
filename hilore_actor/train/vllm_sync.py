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
attributes do not clash with the worker's.

Under LoRA the engine gets the adapter instead (``AdapterSync``): vLLM serves LoRA itself
(``enable_lora``), so the base weights it loaded at start stay, and each update is written as
a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, in
``/dev/shm``) and loaded with ``llm.llm_engine.add_lora(LoRARequest(name, id, path))`` under a
new id; the rollouts name that request. vLLM 0.29's ``LoRARequest`` takes a path only (no
tensors: ``lora_path`` is asserted non-empty, ``WorkerLoRAManager._load_adapter`` reads the
folder), and the path is the public way in; loading tensors would mean replacing that private
method as verl does. docs/training-job.md has the walk through vLLM's source.
Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
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


def payload_bytes(weights: Dict[str, torch.Tensor]) -> int:
    """The bytes of ``weights``' values (what a sync moves; names and headers aside)."""
    return sum(t.numel() * t.element_size() for t in weights.values())


def sync_weights(llm, weights: Dict[str, torch.Tensor], max_bytes: Optional[int] = None) -> int:
    """Load ``weights`` (HF names) into ``llm``'s model through ``WeightSyncExtension``, one
    ``collective_rpc`` per chunk of at most ``max_bytes`` (default ``CHUNK_BYTES``); returns
    the bytes sent (a tied head is not)."""
    sent = without_tied_head(weights, tied_embeddings(llm))
    for group in chunks(sent, max_bytes or CHUNK_BYTES):
        llm.collective_rpc(RPC_METHOD, args=(group,))
    return payload_bytes(sent)


# ---- LoRA: the adapter, not the merged model ---------------------------------------------------

# vLLM 0.29's ``max_lora_rank`` choices (``vllm.config.lora.MaxLoRARanks``, a Literal): the engine
# reads the actual ones from vLLM (``lora_ranks``), this is the fallback
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
SHM = "/dev/shm"
# PEFT settings vLLM 0.29 cannot serve, each with the value that it can (``PEFTHelper`` refuses
# DoRA, modules_to_save and a bias; it reads neither per-module ranks nor alphas, and its name
# parser refuses lora_B biases, trainable token rows and the MoE-parameter form)
UNSERVABLE = {
    "use_dora": False,
    "modules_to_save": None,
    "bias": "none",
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "trainable_token_indices": None,
    "target_parameters": None,
    "layer_replication": None,
}


def lora_ranks() -> tuple:
    """vLLM's ``max_lora_rank`` choices, read from vLLM when it is importable."""
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        return tuple(sorted(typing.get_args(MaxLoRARanks))) or LORA_RANKS
    except Exception:  # noqa: BLE001 - no vLLM, or another layout: 0.29's list
        return LORA_RANKS


def max_lora_rank(rank: int, allowed: Sequence[int] = LORA_RANKS) -> Optional[int]:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (None: none does)."""
    return next((r for r in sorted(allowed) if r >= rank), None)


def engine_lora_args(rank: int, allowed: Sequence[int] = LORA_RANKS) -> Dict:
    """``vllm.LLM`` arguments for one adapter of ``rank`` at a time: one GPU slot (every request
    of a step names the current adapter) and one CPU slot (a new id evicts the last one)."""
    top = max_lora_rank(rank, allowed)
    if top is None:
        raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {max(allowed)}")
    return dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=top)


def adapter_config(peft_model, adapter: str = "default") -> Dict:
    """The active adapter's PEFT config as ``save_pretrained`` writes it (JSON types: a set of
    target modules becomes a sorted list)."""
    cfg = peft_model.peft_config[adapter].to_dict()
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def check_servable(config: Dict) -> None:
    """A PEFT config vLLM would refuse or misread is an error naming the settings."""
    bad = [f"{k}={config[k]!r}" for k, ok in UNSERVABLE.items() if config.get(k, ok) not in (ok, None, [], {})]
    if bad:
        raise ValueError(f"vLLM cannot serve this LoRA adapter ({', '.join(bad)})")


def cast_floats(weights: Dict[str, torch.Tensor], dtype: Optional[str]) -> Dict[str, torch.Tensor]:
    """Floating tensors in ``dtype`` (the engine's: vLLM casts an adapter to its ``lora_dtype``,
    the model's by default, on load, so sending them so is exact and, from float32, half the bytes)."""
    if dtype is None:
        return weights
    dt = getattr(torch, dtype)
    return {k: v.to(dt) if v.is_floating_point() else v for k, v in weights.items()}


def write_adapter(path: str, weights: Dict[str, torch.Tensor], config: Dict) -> None:
    """A PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in weights.items()}, os.path.join(path, ADAPTER_WEIGHTS))
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: alive
        return True
    return True


def adapter_root(base: Optional[str] = None) -> str:
    """This process's folder for adapters: under ``/dev/shm`` (memory; every process of the
    node sees it, the engine's workers included), else the temporary directory. Folders a dead
    process of this host left (a worker Ray killed) are removed first."""
    if base is None:
        base = SHM if os.path.isdir(SHM) and os.access(SHM, os.W_OK) else tempfile.gettempdir()
    prefix = f"hilore-lora-{socket.gethostname()}-"
    for name in os.listdir(base):
        pid = name[len(prefix) :].split("-", 1)[0]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=base)


class AdapterSync:
    """The engine's current adapter. ``load`` writes an update as a PEFT folder, loads it under
    the next id (``llm.llm_engine.add_lora``: vLLM reads the folder into its CPU cache, and the
    new id evicts the last adapter, ``max_cpu_loras=1``), then removes the last folder; the
    current one stays until the next update, in case vLLM reads it again. ``request`` is what
    ``generate`` names (None before the first update: the base model)."""

    def __init__(self, request_cls, root: Optional[str] = None):
        self.request_cls, self._root = request_cls, root
        self.id, self.request, self.path = 0, None, None

    @property
    def root(self) -> str:
        if self._root is None:
            self._root = adapter_root()
        os.makedirs(self._root, exist_ok=True)
        return self._root

    def load(self, llm, weights: Dict[str, torch.Tensor], config: Dict) -> int:
        """Returns the bytes of the adapter's tensors."""
        if not weights:
            raise ValueError("no adapter tensors to send")
        check_servable(config)
        lora_id = self.id + 1
        name = f"hilore-{lora_id}"
        need = payload_bytes(weights) + 2**20  # the tensors, safetensors' header, the config
        if shutil.disk_usage(self.root).free < need and os.path.dirname(self.root) != tempfile.gettempdir():
            print(
                f"[vllm] {os.path.dirname(self.root)} has less than the adapter's {need / 2**20:.0f} MiB free "
                f"(a container's default /dev/shm is 64 MiB): adapters go to {tempfile.gettempdir()}",
                flush=True,
            )
            self._root = adapter_root(tempfile.gettempdir())
        path = os.path.join(self.root, name)
        write_adapter(path, weights, config)
        request = self.request_cls(lora_name=name, lora_int_id=lora_id, lora_path=path)
        try:
            added = llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if not added:
            shutil.rmtree(path, ignore_errors=True)
            raise RuntimeError(f"vLLM did not add adapter {name} (id {lora_id})")
        old, self.id, self.request, self.path = self.path, lora_id, request, path
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return payload_bytes(weights)


class WeightSyncExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``model_runner`` and ``device`` are its)."""

    def hilore_update_weights(self, entries: list) -> int:
        """Load one chunk (``encode``'s entries) into the model; returns the tensors loaded
        (an int: a plain msgpack reply)."""
        device = getattr(self, "device", None) or "cpu"
        weights = [(name, t.to(device)) for name, t in map(decode, entries)]
        self.model_runner.model.load_weights(weights=weights)
        return len(weights)
