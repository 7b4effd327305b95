#!/usr/bin/env bash
# An OpenRLHF 0.11.2 GRPO recipe (Qwen2.5-3B-Instruct, group_norm, 8 samples per prompt, LoRA
# rank 16, sample packing, vLLM) in OpenRLHF's own style. The only change from running
# `python3 -m openrlhf.cli.train_ppo_ray` is the module and the flag `--actor_backend hilore`
# (the --hilore.* flags are optional). Needs GPUs: OpenRLHF's trainer is CUDA-only.
#
#   MODEL=/path/to/Qwen2.5-3B-Instruct DATA=/path/to/math.jsonl bash examples/openrlhf_grpo_hilore.sh
#
# DATA: JSONL with "prompt" and "answer"; the reward is examples/openrlhf_math_reward.py.
set -x
MODEL=${MODEL:?set MODEL to a local Qwen2.5-3B-Instruct directory}
DATA=${DATA:?set DATA to a local JSONL file with prompt/answer fields}
cd "$(dirname "$0")/.."

ray job submit --address="${RAY_ADDRESS:-http://127.0.0.1:8265}" \
   --runtime-env-json='{"working_dir": "."}' \
   -- python3 -m hilore_actor.openrlhf.train_ppo_ray \
   --ref.num_nodes 1 \
   --ref.num_gpus_per_node 4 \
   --actor.num_nodes 1 \
   --actor.num_gpus_per_node 4 \
   --vllm.num_engines 2 \
   --vllm.tensor_parallel_size 1 \
   --vllm.gpu_memory_utilization 0.5 \
   --train.colocate_all \
   --actor.model_name_or_path "$MODEL" \
   --reward.remote_url examples/openrlhf_math_reward.py \
   --ckpt.output_dir runs/openrlhf-qwen2.5-3b-grpo-hilore \
   --train.micro_batch_size 4 \
   --train.batch_size 128 \
   --rollout.micro_batch_size 16 \
   --rollout.batch_size 128 \
   --rollout.n_samples_per_prompt 8 \
   --algo.advantage.estimator group_norm \
   --train.max_epochs 1 \
   --data.max_len 2560 \
   --rollout.max_new_tokens 2048 \
   --ds.zero_stage 2 \
   --ds.param_dtype bf16 \
   --actor.adam.lr 1e-5 \
   --algo.kl.use_loss \
   --algo.kl.estimator k3 \
   --algo.kl.init_coef 0.001 \
   --data.prompt_dataset "$DATA" \
   --data.input_key prompt \
   --data.label_key answer \
   --data.apply_chat_template \
   --ds.packing_samples \
   --ds.lora.rank 16 \
   --ds.lora.alpha 32 \
   --ds.lora.target_modules all-linear \
   --actor_backend hilore \
   --hilore.budget 1.10 \
   --hilore.calibration_batches 16
# OpenRLHF's own run would add --actor.gradient_checkpointing_enable; with --actor_backend
# hilore that flag is accepted and replaced by HiLoRe's per-unit recompute.
