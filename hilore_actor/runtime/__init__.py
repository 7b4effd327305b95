"""Runtime services: the memory meter (later: distributed helpers, Ray and DeepSpeed glue)."""
from .memory import MemoryMeter, MemoryReport, measure_peak

__all__ = ["MemoryMeter", "MemoryReport", "measure_peak"]
