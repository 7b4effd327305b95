"""A CPU memory meter that keeps no event log: live tensor storages, counted as they appear
and as they die.

Why a second CPU meter: the profiler meter (``memory.py``) keeps one event per allocation
and per op until the region ends, and turns them into Python objects to sum them. A model
whose CPU path is a Python loop of small ops (Mamba's reference selective scan, RWKV's
recurrence) makes millions of them: 22.5 GB resident after 8 minutes on a tiny Mamba, and
the process was killed. This meter holds one record per *live* storage and two counters.

How it counts (a ``TorchDispatchMode``):

- after every op, each output tensor's storage that is neither already counted nor one of the
  op's inputs' storages (a view, an in-place result) is new: its bytes join ``live``, and a
  ``weakref.finalize`` on the storage takes them out when the storage is freed. torch
  preserves a storage's Python object while C++ still holds the storage (autograd's saved
  tensors, a view's base), so the finalizer runs when the bytes are really released;
- ``peak`` is the running maximum of ``live``: bytes allocated inside the region and still
  live, the same quantity as the profiler meter's.

Edge cases, named:

- Buffers an op allocates and frees inside its own kernel (logsumexp's, a sort's temporary)
  and the 0-d tensors C++ makes of Python scalars are not tensors the dispatcher returns, so
  they are not counted: this meter's peak can be lower than the profiler's by an op's
  internal workspace (on a tiny llama's forward and backward, 16 bytes of 1.5 MB:
  ``tests/runtime/test_memory.py``). The benchmark records
  which meter measured (``cpu_meter`` in its JSON); compare peaks from one meter only.
- Ops run by autograd in backward pass through the dispatcher on the calling thread (CPU
  graphs), so gradients and the engine's buffers count; saved-tensor hooks' packed copies
  count too.
- ``torch.tensor(data)`` allocates before the dispatcher sees it; its ``lift_fresh`` counts
  it.
- Storages freed after the region ends are ignored (the finalizers are disarmed at exit).
"""

from __future__ import annotations

import weakref
from typing import Dict, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


_LIFT = (torch.ops.aten.lift_fresh.default,)


class StorageMeter(TorchDispatchMode):
    """``with StorageMeter() as m: ...``; then ``m.peak``, ``m.live`` (net) and, for each
    ``mark(name)``, ``m.since[name]`` / ``m.before[name]`` (as ``MemoryReport``'s fields)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.since: Dict[str, int] = {}
        self.before: Dict[str, int] = {}
        self._held: Dict[int, Tuple[int, weakref.finalize]] = {}  # storage id -> (bytes, finalizer)
        self._open = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type in ("cpu", "meta")]
        if fresh:
            # ``torch.tensor(data)`` allocates before dispatch and hands the new tensor to
            # lift_fresh, whose output is its input: count that one as new
            lifted = func in _LIFT
            inputs = (
                set()
                if lifted
                else {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            )
            for t in fresh:
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage: torch.UntypedStorage, inputs: set) -> None:
        key = storage._cdata
        nbytes = storage.nbytes()
        if key in self._held or key in inputs or nbytes == 0:
            return
        fin = weakref.finalize(storage, self._free, key)
        fin.atexit = False
        self._held[key] = (nbytes, fin)
        self.live += nbytes
        if self.live > self.peak:
            self.peak = self.live
        for name, v in self.since.items():
            if self.live > v:
                self.since[name] = self.live

    def _free(self, key: int) -> None:
        if self._open:
            nbytes, _ = self._held.pop(key, (0, None))
            self.live -= nbytes

    def mark(self, name: str) -> None:
        self.since[name] = self.live
        self.before[name] = self.peak

    def __exit__(self, *exc):
        self._open = False
        for _, fin in self._held.values():
            fin.detach()
        self._held = {}
        return super().__exit__(*exc)
