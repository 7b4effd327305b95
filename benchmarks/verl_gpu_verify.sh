#!/usr/bin/env bash
# HiLoRe's verl engine against verl's own checkpointed path on one GPU (hilore_actor/verl/verify.py):
# gradients (hilore-hr within max(1e-3, 4 x gc's noise floor), hilore within that + 0.015), peaks
# within B, times. Writes benchmarks/results/verl-gpu-verify.json; exit status 1 on a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m hilore_actor.verl.verify --out benchmarks/results/verl-gpu-verify.json "$@"
