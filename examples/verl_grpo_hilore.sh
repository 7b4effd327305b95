#!/usr/bin/env bash
# A verl 0.9.1 GRPO recipe (Qwen2.5-3B-Instruct, LoRA rank 16, 8 samples per prompt, vLLM
# rollouts, remove-padding) with HiLoRe as the actor. The only change from running
# `python3 -m verl.trainer.main_ppo` is the module and `+actor_rollout_ref.actor.hilore.enable=true`
# (the other hilore overrides are optional). GPUS=8 by default (one FSDP rank per GPU; rank 0
# plans, the others replay its planning passes). Needs GPUs, verl's vllm and flash-attn.
#
#   MODEL=/path/to/Qwen2.5-3B-Instruct TRAIN=/path/to/gsm8k/train.parquet TEST=/path/to/gsm8k/test.parquet \
#     bash examples/verl_grpo_hilore.sh
#
# TRAIN/TEST: verl's parquet format (verl's examples/data_preprocess/gsm8k.py writes it).
set -x
MODEL=${MODEL:?set MODEL to a local Qwen2.5-3B-Instruct directory}
TRAIN=${TRAIN:?set TRAIN to a verl-format parquet file}
TEST=${TEST:-$TRAIN}
GPUS=${GPUS:-8}
cd "$(dirname "$0")/.."

python3 -m hilore_actor.verl.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN" \
    data.val_files="$TEST" \
    data.train_batch_size=64 \
    data.max_prompt_length=512 \
    data.max_response_length=1024 \
    data.filter_overlong_prompts=True \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.lora_rank=16 \
    actor_rollout_ref.model.lora_alpha=32 \
    actor_rollout_ref.model.target_modules=all-linear \
    actor_rollout_ref.actor.optim.lr=3e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.5 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    trainer.n_gpus_per_node="$GPUS" \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    trainer.logger='["console"]' \
    trainer.project_name=hilore_verl \
    trainer.experiment_name=qwen2.5-3b-grpo-lora-hilore \
    +actor_rollout_ref.actor.hilore.enable=true \
    +actor_rollout_ref.actor.hilore.budget=1.10 \
    +actor_rollout_ref.actor.hilore.calibration_batches=16
# verl's own run would keep actor_rollout_ref.model.enable_gradient_checkpointing=True (its
# default); under HiLoRe the training engine leaves it off and recomputes per unit instead.
