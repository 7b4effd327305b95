"""``python -m benchmarks.bench``: the memory-throughput-fidelity frontier, every method on
the same replayed GRPO microbatches, interleaved."""
