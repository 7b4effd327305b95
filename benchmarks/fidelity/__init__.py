"""``python -m benchmarks.fidelity``: does HiLoRe change what GRPO training learns?

Paired training runs of the job (``train_grpo``) on a real model, one per (method, seed), with
identical seeds, data order and sampling, then held-out evaluation of every final policy and
a report of the paired differences (``runs.py``: the runs and their resumption; ``evaluate.py``:
held-out accuracy and the KL between paired policies; ``report.py``: statistics, plot, table).
"""
