#!/usr/bin/env bash
# GRPO on CPU with the bundled SmolLM2-135M-Instruct: the cpu-demo preset spelled out as flags
# (the same flags as an OpenRLHF recipe where the concept exists there), HiLoRe as the backend.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
exec "$PY" -m hilore_actor.train_grpo \
  --pretrain smollm2 \
  --data.prompt_dataset rg:basic_arithmetic \
  --data.task_options '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}' \
  --data.instruction " Answer with the number only." \
  --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 --rollout.max_new_tokens 32 \
  --train.batch_size 16 --train.micro_batch_size 8 \
  --algo.advantage.estimator group_norm --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001 \
  --actor.eps_clip 0.2 --actor.adam.lr 2e-4 \
  --ds.zero_stage 2 --ds.lora.rank 16 --ds.lora.alpha 32 \
  --actor_backend hilore --hilore.budget 1.10 --hilore.mode hilore-hr \
  --max_steps 5 --compare_gc --save_path runs/cpu-example "$@"
