"""Runtime services: the memory meter; DeepSpeed process-group start-up (`distributed.py`, imported where used)."""

from .memory import MemoryMeter, MemoryReport, measure_peak

__all__ = ["MemoryMeter", "MemoryReport", "measure_peak"]
