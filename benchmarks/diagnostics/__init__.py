"""``python -m benchmarks.diagnostics``: GRPO coefficient structure and risk-predictor quality
(``cli.py``: the command; ``analysis.py``: the statistics it reports)."""
