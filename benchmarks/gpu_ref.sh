#!/usr/bin/env bash
# gpu-ref on one GPU: gc, no-gc and hilore at B = 1.10 x gc (Qwen2.5-3B shape, bf16, 4 x 4096
# tokens per update). Sized to finish in under 10 minutes on an H100/H200-class GPU.
# Usage: bash benchmarks/gpu_ref.sh [OUTDIR]   (default benchmarks/results; on the device tool, $OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-${OUT:-benchmarks/results}}
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench --workload gpu-ref --device cuda \
  --methods gc,no-gc,hilore --budgets 1.10 --repeats 5 --updates 1 \
  --calib 2 --calib-tokens 1024 --no-loo \
  --json "$OUTDIR/gpu-ref.json" --plot "$OUTDIR/gpu-ref.png" --markdown "$OUTDIR/gpu-ref.md" \
  2>&1 | tee "$OUTDIR/gpu-ref.log"
