"""Peak device memory of a region, measured at the allocator level.

Budgets in this package are a few percent wide, so the meter must count what the allocator
hands out, not process RSS and not a model of it:

- CUDA: the caching allocator's own counters. Its peak counter is process-wide and only
  ``reset_peak_memory_stats`` restarts it, so a region's exact peak needs a restart; host
  frameworks read the same counter for their own metrics (verl's ``perf/max_memory_*`` after
  its update, DeepSpeed's ``see_memory_usage``). ``_PeakLedger`` keeps both right: before
  each restart it folds the counter's peaks into every open region and into a ledger that
  ``torch.cuda.memory_stats`` (hence ``max_memory_allocated``/``max_memory_reserved``) folds
  back in, so a host reads the peak since *its own* last reset as if the meter had never
  restarted the counter. A host's reset clears the ledger (the open regions keep theirs).
  The report carries the region's maximum reserved bytes too, and its trapped bytes: free
  space inside partly used segments (``inactive_split_bytes``), which the allocator cannot
  hand back to the device before an OOM, unlike whole cached segments (reserved bytes count
  both). B is compared to allocated + trapped bytes (``learner/microbatch_run.report``); trapped bytes
  are 0 on CPU and with expandable segments (torch leaves those out of the stat: their free
  pages can be unmapped). The allocator updates these counters on the host at each allocation
  and free, in program order (a free deferred by ``record_stream`` is settled at a later
  allocation, not by a sync), so the meter reads them without ``torch.cuda.synchronize``: it
  never stalls the host's run-ahead at a microbatch's start, mark or end.
- CPU: the profiler's ``[memory]`` events, which carry the signed byte count of every tensor
  allocation and free in time order; the running sum's maximum is the peak. Only frees of
  addresses allocated inside the region count (see ``cpu_peak_from_events``), so the CPU
  figure is the peak of bytes allocated *inside* the region and still live. The profiler
  keeps every event until the region ends; for models whose CPU path is a long Python loop
  of small ops, ``CPU_METER = "storage"`` counts live tensor storages instead and keeps no
  log (``storage_meter.py``, which names what it cannot see).

Both report ``peak_bytes``: the peak of live bytes above what was live when the region began.
The profiler slows CPU code down, so measure peaks and times in separate passes. On CPU, end
a meter outside every ``torch.profiler.record_function`` scope that began after it: a scope
that began under the profiler and ends after it stopped writes into the freed profiler (heap
corruption, seen as later segfaults; verl opens one per micro-batch: ``verl/fsdp_engine.py``).

``default_allocator_settings``: ``expandable_segments:True`` for processes that train, unless
the user chose allocator settings (fewer bytes reserved beyond those allocated). Not where
tensors go to another process by CUDA IPC (OpenRLHF's colocated weight sync): torch exports
expandable-segment memory through ``pidfd_getfd``, which containers and Yama refuse
(``openrlhf/policy_actor.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, TypeVar, Union

import torch

T = TypeVar("T")
MARK_PREFIX = "hilore.mark."
CPU_METERS = ("profiler", "storage")
CPU_METER = "profiler"  # what CPU meters use; the benchmark's --cpu-meter sets it


@dataclass
class MemoryReport:
    device: str
    peak_bytes: int  # max live bytes above the region's start
    net_bytes: int  # live bytes at the end minus at the start (allocated in the region)
    peak_since: Dict[str, int] = field(default_factory=dict)  # mark -> max live bytes after it (above the start)
    peak_before: Dict[str, int] = field(default_factory=dict)  # mark -> max live bytes before it (above the start)
    max_allocated_bytes: int = 0  # CUDA: the region's maximum allocated bytes, absolute (0 on CPU)
    max_reserved_bytes: int = 0  # CUDA: the region's maximum reserved bytes, absolute (cached segments included)
    trapped_bytes: int = 0  # CUDA: free bytes in partly used segments on top of the allocated peak, at most (0 on CPU)
    trapped_before: Dict[str, int] = field(default_factory=dict)  # mark -> trapped_bytes up to it

    def __str__(self) -> str:
        peak, net = self.peak_bytes / 2**20, self.net_bytes / 2**20
        return f"peak {peak:.2f} MiB above start on {self.device} (net {net:+.2f} MiB)"


class MemoryMeter:
    """Context manager: ``with MemoryMeter(device) as m: ...``; then ``m.report``. CUDA meters
    may nest (each region keeps its own peak)."""

    def __init__(self, device: Union[str, torch.device, None] = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter supports cpu and cuda devices, got {device}")
        self.device = device
        self.report: Optional[MemoryReport] = None
        self._prof = None
        self._storage = None  # CPU_METER "storage": the running StorageMeter
        self._window: Optional[_Window] = None  # CUDA: the region
        self._marks: Dict[str, _Window] = {}  # CUDA: mark -> the window after it
        self._before: Dict[str, int] = {}
        self._trapped_before: Dict[str, int] = {}

    def __enter__(self) -> "MemoryMeter":
        self._before, self._trapped_before = {}, {}
        if self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self._window = LEDGER.open(idx)
        elif CPU_METER == "storage":
            from .storage_meter import StorageMeter

            self._storage = StorageMeter().__enter__()
        else:
            if torch.autograd.profiler._is_profiler_enabled:
                raise RuntimeError(
                    "MemoryMeter on CPU uses the torch profiler, and another profiler is already running"
                )
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Start a sub-window: the report's ``peak_since[name]`` is the peak after this point
        and ``peak_before[name]`` the peak up to it (both above the region's start), e.g. the
        backward after a downgrade, or a step without its optimizer step."""
        if self.device.type == "cuda":
            w = self._window
            self._before[name] = w.peak() - w.start
            self._trapped_before[name] = w.trapped()
            self._marks[name] = LEDGER.open(w.idx)
        elif self._storage is not None:
            self._storage.mark(name)
        else:
            with torch.profiler.record_function(MARK_PREFIX + name):
                pass

    def __exit__(self, *exc) -> None:
        top = reserved = trapped = 0
        if self.device.type == "cuda":
            peak, net, since, before, top, reserved, trapped = self._cuda_exit()
        elif self._storage is not None:
            m, self._storage = self._storage, None
            m.__exit__(*exc)
            peak, net, since, before = m.peak, m.live, dict(m.since), dict(m.before)
        else:
            self._prof.__exit__(*exc)
            peak, net, since, before = cpu_peak_from_events(self._prof)
            _drop_events(self._prof)
            self._prof = None
        self.report = MemoryReport(
            str(self.device),
            int(max(peak, 0)),
            int(net),
            {k: int(v) for k, v in since.items()},
            {k: int(max(v, 0)) for k, v in before.items()},
            int(top),
            int(reserved),
            int(trapped),
            dict(self._trapped_before),
        )

    def _cuda_exit(self):
        """(peak, net, since, before, max allocated, max reserved, trapped) of the region; closes its windows."""
        w = self._window
        try:
            top, reserved = w.peak(), w.peak(RESERVED)
            since = {k: m.peak() - w.start for k, m in self._marks.items()}
            return top - w.start, LEDGER.current(w.idx) - w.start, since, dict(self._before), top, reserved, w.trapped()
        finally:
            for m in [w, *self._marks.values()]:
                LEDGER.close(m)
            self._window, self._marks = None, {}

    @property
    def peak_bytes(self) -> int:
        if self.report is None:
            raise RuntimeError("the meter has not finished measuring yet")
        return self.report.peak_bytes


# ---- CUDA: region peaks that leave the host's peak counters as the host sees them ----------
ALLOCATED, RESERVED = ("allocated_bytes", "all"), ("reserved_bytes", "all")
TRAPPED = ("inactive_split_bytes", "all")  # free blocks of split segments: not releasable (none in expandable ones)


def _peaks(stats: Dict) -> Dict[tuple, int]:
    """``{(stat, pool): peak}`` from torch's nested allocator stats (pool None for a stat
    without pools, e.g. ``oversize_allocations``)."""
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out.update({(k, pool): int(d["peak"]) for pool, d in v.items() if isinstance(d, dict) and "peak" in d})
            if "peak" in v and not isinstance(v["peak"], dict):
                out[(k, None)] = int(v["peak"])
    return out


def _with_peaks(stats: Dict, peaks: Dict[tuple, int]) -> Dict:
    """``stats`` with every peak raised to at least ``peaks``' (a copy)."""

    def up(k, pool, d):
        return dict(d, peak=max(d["peak"], peaks.get((k, pool), 0)))

    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            v = {pool: up(k, pool, d) if isinstance(d, dict) and "peak" in d else d for pool, d in v.items()}
            if "peak" in v and not isinstance(v["peak"], dict):
                v = up(k, None, v)
        out[k] = v
    return out


def _fold(into: Dict[tuple, int], peaks: Dict[tuple, int]) -> None:
    for k, v in peaks.items():
        if v > into.get(k, 0):
            into[k] = v


class _Window:
    """An open region on one device: its allocated bytes at the start and the peaks folded
    in at each restart of the counter since."""

    def __init__(self, idx: int, start: int):
        self.idx, self.start, self.peaks = idx, start, {}

    def peak(self, key: tuple = ALLOCATED) -> int:
        return max(self.peaks.get(key, 0), _peaks(LEDGER.raw_stats(self.idx)).get(key, 0))

    def trapped(self) -> int:
        """How far allocated + trapped bytes rose above the allocated peak, at most: the stats keep
        each counter's peak, not their sum's, so min(trapped peak, reserved peak - allocated peak)
        (reserved >= allocated + trapped at every moment)."""
        return max(0, min(self.peak(TRAPPED), self.peak(RESERVED) - self.peak()))


class _PeakLedger:
    """Wraps ``torch._C._cuda_memoryStats`` and ``_cuda_resetPeakMemoryStats`` (what every
    ``torch.cuda`` memory reader and ``reset_peak_memory_stats`` call) the first time a CUDA
    meter opens, so that the meter's restarts of the peak counter are invisible to the host."""

    def __init__(self):
        self.raw: Dict[str, Callable] = {}
        self.windows: Dict[int, List[_Window]] = {}
        self.erased: Dict[int, Dict[tuple, int]] = {}  # device -> peaks our restarts hid from the host
        self._wrappers = (self.host_stats, self.host_reset)  # bound once: installed iff these are torch's

    def install(self) -> None:
        C = torch._C
        if getattr(C, "_cuda_memoryStats", None) is self._wrappers[0]:
            return
        self.raw = {"stats": C._cuda_memoryStats, "reset": C._cuda_resetPeakMemoryStats}
        self.windows, self.erased = {}, {}
        C._cuda_memoryStats, C._cuda_resetPeakMemoryStats = self._wrappers

    def raw_stats(self, idx: int) -> Dict:
        return self.raw["stats"](idx)

    def current(self, idx: int) -> int:
        return int(self.raw_stats(idx)["allocated_bytes"]["all"]["current"])

    def _keep(self, idx: int) -> Dict[tuple, int]:
        """Fold the counter's peaks into every open window (before a restart); return them."""
        peaks = _peaks(self.raw_stats(idx))
        for w in self.windows.get(idx, []):
            _fold(w.peaks, peaks)
        return peaks

    def open(self, idx: int) -> _Window:
        """A new window on device ``idx``: the counter restarts, what it held is kept."""
        self.install()
        _fold(self.erased.setdefault(idx, {}), self._keep(idx))
        self.raw["reset"](idx)
        w = _Window(idx, self.current(idx))
        self.windows.setdefault(idx, []).append(w)
        return w

    def close(self, w: _Window) -> None:
        if w in self.windows.get(w.idx, []):
            self.windows[w.idx].remove(w)

    def host_stats(self, device=None):
        stats = self.raw["stats"](device)
        erased = self.erased.get(device)
        return _with_peaks(stats, erased) if erased and isinstance(stats, dict) else stats

    def host_reset(self, device=None):
        self._keep(device)  # open windows keep what they saw
        self.erased.pop(device, None)
        return self.raw["reset"](device)


LEDGER = _PeakLedger()

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_allocator_settings(environ=None) -> Optional[str]:
    """``expandable_segments:True`` unless the user set ``PYTORCH_CUDA_ALLOC_CONF`` (or torch's
    newer ``PYTORCH_ALLOC_CONF``); returns what it set, or None. Why: B bounds allocated
    bytes, while an OOM happens when reserved bytes reach the device; fixed-size cached
    segments leave free holes that a later, larger block cannot use, and expandable segments
    grow one mapping instead. Call it in a training process before CUDA starts (the variable
    is read when the allocator initialises); if CUDA already runs, torch's runtime setter
    applies it to segments made from then on. The variable also reaches child processes."""
    env = os.environ if environ is None else environ
    if any(k in env for k in ALLOC_CONF_VARS):
        return None
    env[ALLOC_CONF_VARS[0]] = DEFAULT_ALLOC_CONF
    if torch.cuda.is_initialized():
        torch._C._accelerator_setAllocatorSettings(DEFAULT_ALLOC_CONF)
    return DEFAULT_ALLOC_CONF


def expandable_segments_chosen(environ=None) -> bool:
    """Whether the user's allocator settings turn expandable segments on (either variable: the
    CUDA allocator and torch's generic config read them in opposite orders)."""
    env = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        for item in env.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                return True
    return False


def _cpu_events(prof) -> Tuple[list, list]:
    """(allocations ``(t, ptr, signed bytes)``, marks ``(t, name)``) from the profiler's event tree."""
    allocs, marks = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == torch._C._profiler._EventType.Allocation:
            f = e.extra_fields
            if f.device.type == "cpu":
                allocs.append((e.start_time_ns, f.ptr, f.alloc_size))
        elif e.name.startswith(MARK_PREFIX):
            marks.append((e.start_time_ns, e.name[len(MARK_PREFIX) :]))
    return sorted(allocs, key=lambda a: a[0]), sorted(marks)


def _drop_events(prof) -> None:
    """Free the region's event data (every op and allocation) now. ``torch.profiler.profile``
    sits in a reference cycle, so the data would outlive it until Python's cyclic collector
    runs; tensors allocated meanwhile land between those blocks, and glibc's heap grew by
    gigabytes over a planning pass. Dropping the one reference to the results frees them
    without a full ``gc.collect()``, which costs a quarter of a second per region in a process
    that has imported transformers and DeepSpeed."""
    inner = getattr(prof, "profiler", None)
    if inner is not None:
        inner.kineto_results = None


def cpu_peak_from_events(prof) -> Tuple[int, int, Dict[str, int], Dict[str, int]]:
    """(peak, net, peak after each mark, peak before each mark) of the bytes allocated in the
    region and still live.

    A free counts only if its address was allocated inside the region. torch's CPU allocator
    records block sizes while any profiler runs: a tensor allocated under an earlier meter (kept
    from the previous microbatch, say) is freed here with its size, and a block freed outside
    a profiler leaves a stale size that a later tensor at the same address inherits. Counting
    those frees lowered the running sum and hid real allocations after them."""
    allocs, marks = _cpu_events(prof)
    held: Dict[int, int] = {}
    live = peak = 0
    since: Dict[str, int] = {}
    before: Dict[str, int] = {}
    mi = 0
    for ts, ptr, nbytes in allocs:
        while mi < len(marks) and marks[mi][0] <= ts:
            since[marks[mi][1]] = live
            before[marks[mi][1]] = peak
            mi += 1
        if nbytes >= 0:
            held[ptr] = held.get(ptr, 0) + nbytes
            live += nbytes
        elif ptr in held:
            live -= held.pop(ptr)
        peak = max(peak, live)
        for k in since:
            since[k] = max(since[k], live)
    for _, name in marks[mi:]:
        since[name] = live
        before[name] = peak
    return peak, live, since, before


def measure_peak(fn: Callable[[], T], device: Union[str, torch.device, None] = None) -> Tuple[T, MemoryReport]:
    """Run ``fn()`` under a ``MemoryMeter``; return its result and the report."""
    with MemoryMeter(device) as meter:
        out = fn()
    return out, meter.report
