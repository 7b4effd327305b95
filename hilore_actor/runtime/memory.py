"""Peak device memory of a region, measured at the allocator level.

Budgets in this package are a few percent wide, so the meter must count what the allocator
hands out, not process RSS and not a model of it:

- CUDA: the caching allocator's own counters (``torch.cuda.reset_peak_memory_stats`` then
  ``max_memory_allocated``).
- CPU: the profiler's ``[memory]`` events, which carry the signed byte count of every tensor
  allocation and free in time order; the running sum's maximum is the peak. Frees of tensors
  allocated before the region carry no size (torch warns once) and are ignored, so the CPU
  figure is the peak of bytes allocated *inside* the region and still live.

Both report ``peak_bytes``: the peak of live bytes above what was live when the region began.
The profiler slows CPU code down, so measure peaks and times in separate passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, TypeVar, Union

import torch

T = TypeVar("T")


@dataclass
class MemoryReport:
    device: str
    peak_bytes: int  # max live bytes above the region's start
    net_bytes: int  # live bytes at the end minus at the start (allocated in the region)

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

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - self._start
            net = torch.cuda.memory_allocated(self.device) - self._start
        else:
            self._prof.__exit__(*exc)
            peak, net = cpu_peak_from_events(self._prof)
            self._prof = None
        self.report = MemoryReport(str(self.device), int(max(peak, 0)), int(net))

    @property
    def peak_bytes(self) -> int:
        if self.report is None:
            raise RuntimeError("the meter has not finished measuring yet")
        return self.report.peak_bytes


def cpu_peak_from_events(prof) -> Tuple[int, int]:
    """(peak, net) of the running sum of CPU ``[memory]`` events of a finished profiler."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type().name == "CPU"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak, live


def measure_peak(fn: Callable[[], T], device: Union[str, torch.device, None] = None) -> Tuple[T, MemoryReport]:
    """Run ``fn()`` under a ``MemoryMeter``; return its result and the report."""
    with MemoryMeter(device) as meter:
        out = fn()
    return out, meter.report

