"""One-off measurements: ``python -m benchmarks.probes.NAME``. Each docstring says whether a test
runs it (maintained) or it is frozen evidence for a named section of the docs."""
