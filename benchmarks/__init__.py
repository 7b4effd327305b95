"""The benchmark lab, run from a checkout (not installed with ``hilore_actor``).

``bench``: the speed benchmark, the codec benchmark, the results-page generator
(``python -m benchmarks.bench``, ``python -m benchmarks.bench.report``); ``fidelity``: the paired
training study (``python -m benchmarks.fidelity``); ``diagnostics``: GRPO coefficient structure
and risk-predictor quality (``python -m benchmarks.diagnostics``); ``real_batches``: learner
microbatches from real rollouts, shared by the benchmark and the diagnostics; ``probes``: one-off
measurements behind ``docs/compile.md`` and ``docs/benchmark.md``. How they measure:
``docs/benchmark.md``.
"""
