#!/usr/bin/env bash
# One GPU, under 10 minutes: OpenRLHF's real PolicyModelActor (gc) and HiLoRe's drop-in (hilore-hr,
# hilore at 1.10) on SmolLM2-135M + LoRA 16, flash-attn with packing, DeepspeedStrategy on one
# rank: one training_step's gradient against gc's, then two timed updates; exits 1 on a gradient
# mismatch or a peak over B. Results: ${1:-benchmarks/results}/openrlhf-gpu-verify.{txt,json}.
# Not yet run by this project (no GPU lent).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/openrlhf-gpu-verify.txt"
python -m hilore_actor.openrlhf.verify --pretrain "${MODEL:-smollm2}" --steps 2 --out "$OUT/openrlhf-gpu-verify.json" \
  2>&1 | tee -a "$OUT/openrlhf-gpu-verify.txt"
