"""``python -m benchmarks.fidelity``: does HiLoRe change what GRPO training learns?

Paired training runs of the job (``train_grpo``) on a real model, one per (arm, seed), with
identical seeds, data order and sampling: gc (the reference), hilore (its plans use L) and a
positive control (L on nearly every unit with a coarse codec), which shows the study can see a
degradation at all. Then held-out evaluation of every final policy, the KL of each to gc's,
and a report of the paired differences with their intervals and the study's power
(``runs.py``: the runs and their resumption; ``evaluate.py``: held-out accuracy and KL;
``stats.py``: intervals and power; ``report.py``: statistics, plot, table; ``cli.py``: the
command, ``--pilot`` included).
"""
