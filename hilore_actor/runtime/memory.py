"""Peak device memory of a region, measured at the allocator level.

Budgets in this package are a few percent wide, so the meter must count what the allocator
hands out, not process RSS and not a model of it:

- CUDA: the caching allocator's own counters (``torch.cuda.reset_peak_memory_stats`` then
  ``max_memory_allocated``).
- CPU: the profiler's ``[memory]`` events, which carry the signed byte count of every tensor
  allocation and free in time order; the running sum's maximum is the peak. Only frees of
  addresses allocated inside the region count (see ``cpu_peak_from_events``), so the CPU
  figure is the peak of bytes allocated *inside* the region and still live.

Both report ``peak_bytes``: the peak of live bytes above what was live when the region began.
The profiler slows CPU code down, so measure peaks and times in separate passes. On CPU, end
a meter outside every ``torch.profiler.record_function`` scope that began after it: a scope
that began under the profiler and ends after it stopped writes into the freed profiler (heap
corruption, seen as later segfaults; verl opens one per micro-batch: ``verl/engine.py``).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, TypeVar, Union

import torch

T = TypeVar("T")
MARK_PREFIX = "hilore.mark."


@dataclass
class MemoryReport:
    device: str
    peak_bytes: int  # max live bytes above the region's start
    net_bytes: int  # live bytes at the end minus at the start (allocated in the region)
    peak_since: Dict[str, int] = field(default_factory=dict)  # mark -> max live bytes after it (above the start)
    peak_before: Dict[str, int] = field(default_factory=dict)  # mark -> max live bytes before it (above the start)

    def __str__(self) -> str:
        return f"peak {self.peak_bytes / 2**20:.2f} MiB above start on {self.device} (net {self.net_bytes / 2**20:+.2f} MiB)"


class MemoryMeter:
    """Context manager: ``with MemoryMeter(device) as m: ...``; then ``m.report``."""

    def __init__(self, device: Union[str, torch.device, None] = None):
        device = torch.device(device) if device is not None else torch.device("cpu")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter supports cpu and cuda devices, got {device}")
        self.device = device
        self.report: Optional[MemoryReport] = None
        self._prof = None
        self._cuda_peaks: Dict[str, int] = {}
        self._cuda_overall = 0  # CUDA: the peak before the last mark reset the counter
        self._cuda_before: Dict[str, int] = {}

    def __enter__(self) -> "MemoryMeter":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            if torch.autograd.profiler._is_profiler_enabled:
                raise RuntimeError("MemoryMeter on CPU uses the torch profiler, and another profiler is already running")
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Start a sub-window: the report's ``peak_since[name]`` is the peak after this point
        and ``peak_before[name]`` the peak up to it (both above the region's start), e.g. the
        backward after a downgrade, or a step without its optimizer step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_overall = max(self._cuda_overall, torch.cuda.max_memory_allocated(self.device))
            self._cuda_before[name] = self._cuda_overall - self._start
            for k in self._cuda_peaks:
                self._cuda_peaks[k] = max(self._cuda_peaks[k], torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_peaks[name] = torch.cuda.memory_allocated(self.device)
        else:
            with torch.profiler.record_function(MARK_PREFIX + name):
                pass

    def __exit__(self, *exc) -> None:
        since: Dict[str, int] = {}
        before: Dict[str, int] = dict(self._cuda_before)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now_peak = torch.cuda.max_memory_allocated(self.device)
            peak = max(self._cuda_overall, now_peak) - self._start
            since = {k: max(v, now_peak) - self._start for k, v in self._cuda_peaks.items()}
            net = torch.cuda.memory_allocated(self.device) - self._start
        else:
            self._prof.__exit__(*exc)
            peak, net, since, before = cpu_peak_from_events(self._prof)
            self._prof = None
            # The profiler object sits in a reference cycle, so its event data (every op and
            # allocation of the region) outlives it until Python's cyclic collector happens to
            # run; tensors allocated meanwhile land between those blocks, and glibc's heap grew
            # by ~6 GB per HiLoRe preparation, 24 GB over a benchmark (cpu-ref-a piece 5, killed
            # for memory). Collect now: on CPU the meter serves measurement (the profiler already
            # slows the region far more than one collection; a CPU training job pays both).
            gc.collect()
        self.report = MemoryReport(str(self.device), int(max(peak, 0)), int(net), {k: int(v) for k, v in since.items()},
                                   {k: int(max(v, 0)) for k, v in before.items()})

    @property
    def peak_bytes(self) -> int:
        if self.report is None:
            raise RuntimeError("the meter has not finished measuring yet")
        return self.report.peak_bytes


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
            marks.append((e.start_time_ns, e.name[len(MARK_PREFIX):]))
    return sorted(allocs, key=lambda a: a[0]), sorted(marks)


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

