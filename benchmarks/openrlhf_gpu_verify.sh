#!/usr/bin/env bash
# One GPU, under 10 minutes: OpenRLHF's real training_step on SmolLM2-135M (+ LoRA 16), 2 GRPO
# steps of 8 x 2048-token sequences, with OpenRLHF's gradient checkpointing and with HiLoRe
# (H/R) at 1.10 x the gc peak: losses, peaks and update times in one table. Results go to
# ${1:-benchmarks/results}/openrlhf-gpu-verify.txt. Not yet run by this project (no GPU lent).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/openrlhf-gpu-verify.txt"
python -m hilore_actor.openrlhf.verify --pretrain "${MODEL:-smollm2}" --steps 2 2>&1 | tee -a "$OUT/openrlhf-gpu-verify.txt"
