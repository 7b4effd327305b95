#!/usr/bin/env bash
# The paper's setting on one node with 4 GPUs: Qwen2.5-3B-Instruct, rank-16 LoRA, GRPO
# (group_norm, 8 samples per prompt), 2K-token responses, B = 1.10 x the gc peak.
# Layout: 2 learner ranks (DeepSpeed ZeRO-2, NCCL), 1 vLLM engine, 1 reference worker.
# MODEL and DATA are local paths (no hub access): DATA is a JSONL file with prompt/answer fields
# (e.g. DeepMath-10K exported to JSONL). Not yet run on a GPU: see docs/testing.md.
set -euo pipefail
MODEL=${MODEL:?set MODEL=/path/to/Qwen2.5-3B-Instruct}
DATA=${DATA:?set DATA=/path/to/deepmath10k.jsonl}
exec python -m hilore_actor.train_grpo \
  --pretrain "$MODEL" \
  --data.prompt_dataset "$DATA" --data.input_key prompt --data.label_key answer --data.prompt_max_len 1024 \
  --data.instruction " Please reason step by step, and put your final answer within \\boxed{}." \
  --rollout.batch_size 32 --rollout.n_samples_per_prompt 8 --rollout.max_new_tokens 2048 \
  --rollout.temperature 1.0 \
  --vllm.num_engines 1 --vllm.gpu_memory_utilization 0.85 \
  --actor.num_nodes 1 --actor.num_gpus_per_node 2 --ref.num_gpus 1 \
  --train.batch_size 256 --train.micro_batch_size 4 \
  --algo.advantage.estimator group_norm --algo.kl.use_loss --algo.kl.estimator k3 --algo.kl.init_coef 0.001 \
  --actor.eps_clip 0.2 --actor.adam.lr 1e-5 --actor.lr_scheduler constant_with_warmup \
  --ds.zero_stage 2 --ds.param_dtype bf16 --ds.lora.rank 16 --ds.lora.alpha 32 \
  --actor_backend hilore --hilore.budget 1.10 --hilore.mode hilore --hilore.calibration_batches 16 \
  --hilore.calibration runs/qwen2.5-3b/calibration.json \
  --max_steps 100 --ckpt.save_steps 10 --save_path runs/qwen2.5-3b "$@"
