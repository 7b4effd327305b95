"""verl's own GRPO recipes through HiLoRe's launcher (``hilore_actor/verl/main_ppo.py``), and
what verl's fused head (``use_fused_kernels=True``) does to HiLoRe's planning and plan.

The override lists are copied from volcengine/verl's examples at commit b178a3cd5 (29 Jan 2026,
version file 0.8.0.dev: the newest snapshot at hand; no 0.9.x tag was in it), the shell's
quoting resolved as the shell passes it and its variables as the script sets them. Each gets
``+actor_rollout_ref.actor.hilore.enable=true``, goes through ``launch_args`` and the composed
config through verl's own ``validate_config`` (vllm's LoRA-rank helper stubbed as in
``tests/verl/test_verl_launcher.py``). No engine runs for the recipes.
"""

import pytest
import torch

pytest.importorskip("verl")
pytest.importorskip("hydra")

ENABLE = "+actor_rollout_ref.actor.hilore.enable=true"

# examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh: LoRA 64 on Qwen2.5-3B, remove-padding, vLLM
LORA_3B = [
    "algorithm.adv_estimator=grpo",
    "trainer.val_before_train=False",
    "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.train_batch_size=16",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.shuffle=False",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct",
    "actor_rollout_ref.model.lora_rank=64",
    "actor_rollout_ref.model.lora_alpha=32",
    "actor_rollout_ref.actor.optim.lr=3e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.load_format=safetensors",
    "actor_rollout_ref.rollout.layered_summon=True",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2.5_3b_grpo_lora",
    "trainer.n_gpus_per_node=2",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]

# examples/grpo_trainer/run_seed_oss_36b.sh: fused kernels, dynamic batch sizes, FSDP2, parameter
# offload (the recipe gives param_offload twice)
SEED_OSS_36B = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.train_batch_size=64",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=ByteDance-Seed/Seed-OSS-36B-Base",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.rollout.free_cache_engine=True",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "actor_rollout_ref.ref.strategy=fsdp2",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console"]',
    "trainer.project_name=verl_grpo_seed_oss_36b",
    "trainer.experiment_name=seed_oss_36b",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]

# examples/grpo_trainer/run_qwen2-7b_seq_balance.sh (rollout_name=sglang, rollout_mode=async,
# return_raw_chat=True, as the script sets them): dynamic batch sizes. No GRPO recipe of that
# snapshot sets Ulysses beside dynamic batch sizes, so SP2 goes after it, as the script's "$@" would.
SEQ_BALANCE_7B = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.return_raw_chat=True",
    "data.train_batch_size=1024",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24000",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.mode=async",
    "actor_rollout_ref.rollout.multi_turn.format=hermes",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm_kl1e-3",
    "trainer.val_before_train=False",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
SP2 = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]

# examples/tuning/7b/qwen2-7b_grpo_2_h800_fsdp_vllm.sh (model_path and the data lists as the
# script sets them): parameter and optimizer offload; "$@" = FSDP2 makes it the FSDP2-with-offload
# case. (The tuning LoRA recipes give only verl's deprecated global micro-batch sizes, which verl
# 0.9.1's engine worker no longer converts: it asserts ppo_micro_batch_size_per_gpu.)
OFFLOAD_7B = [
    "algorithm.adv_estimator=grpo",
    "data.train_files=['$HOME/data/rlhf/gsm8k/train.parquet']",
    "data.val_files=['$HOME/data/rlhf/math/test.parquet']",
    "data.train_batch_size=1024",
    "data.max_prompt_length=1024",
    "data.max_response_length=1024",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=2",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
FSDP2 = ["actor_rollout_ref.actor.strategy=fsdp2"]

# (name, overrides, what the composed config must still say, the job facts the workers get)
ACCEPTED = [
    (
        "lora-3b",
        LORA_3B,
        {"model.lora_rank": 64, "actor.fsdp_config.param_offload": False},
        {"fsdp": "fsdp2", "plan_tokens": 40 * 1536, "group_size": 5},
    ),
    (
        "dynamic-bsz-ulysses-7b",
        SEQ_BALANCE_7B + SP2,
        {"actor.use_dynamic_bsz": True, "actor.ulysses_sequence_parallel_size": 2},
        {"fsdp": "fsdp2", "plan_tokens": 24000, "seqs_per_microbatch": 24000 // 1536, "group_size": 5},
    ),
    (
        "fsdp2-offload-7b",
        OFFLOAD_7B + FSDP2,
        {"actor.fsdp_config.param_offload": True, "actor.fsdp_config.optimizer_offload": True},
        {"fsdp": "fsdp2", "plan_tokens": 16 * 2048, "group_size": 5},
    ),
    (
        "seed-oss-36b-fused-kernels",
        SEED_OSS_36B,
        {"actor.use_dynamic_bsz": True, "actor.fsdp_config.param_offload": True, "model.use_fused_kernels": True},
        {"fsdp": "fsdp2", "group_size": 2},
    ),
]


@pytest.fixture
def vllm_lora_helper(monkeypatch):
    """verl's LoRA-with-vLLM check asks vllm for its largest LoRA rank; vllm has no CPU build."""
    import sys
    import types

    fake = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    fake.get_vllm_max_lora_rank = lambda rank: rank
    monkeypatch.setitem(sys.modules, "verl.workers.rollout.vllm_rollout.utils", fake)


@pytest.mark.parametrize("name,recipe,kept,job", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_verls_recipes_pass_the_launcher_and_verls_validation(monkeypatch, vllm_lora_helper, name, recipe, kept, job):
    """A recipe with HiLoRe on composes to a config verl validates, with the hilore backend,
    the recipe's own options as it gave them and the job facts read from them; off, the
    launcher hands the recipe to verl untouched."""
    from omegaconf import OmegaConf
    from verl.utils.config import validate_config

    from hilore_actor.verl.main_ppo import compose, launch_args
    from hilore_actor.verl.settings import CONFIG_ENV, from_env

    overrides, env = launch_args(recipe + [ENABLE])
    cfg = compose(overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert cfg.actor_rollout_ref.actor.strategy == "hilore"
    for key, value in kept.items():
        assert OmegaConf.select(cfg.actor_rollout_ref, key) == value, key
    monkeypatch.setenv(CONFIG_ENV, env[CONFIG_ENV])
    facts = from_env()[1]
    assert {k: facts[k] for k in job} == job
    assert launch_args(recipe) == (recipe, {})


# examples/sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh (OFFLOAD=False,
# TRAIN_BATCH_SIZE=512, MICRO_BATCH_SIZE=8 as the script sets them): activation offload and
# gradient checkpointing on, SGLang multi-turn, its own --config-path/--config-name (MULTITURN_YAML,
# the example's YAML, its search path the installed verl's config). Its interaction_config_path
# override is left out: verl 0.9.1's rollout config has no such key (verl's main_ppo refuses it too).
MULTITURN_05B = [
    "--config-name=gsm8k_multiturn_grpo_w_interaction",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=512",
    "data.max_prompt_length=1024",
    "data.max_response_length=3072",
    "data.filter_overlong_prompts=True",
    "data.truncation=error",
    "data.return_raw_chat=True",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.model.enable_activation_offload=True",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=512",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=sglang",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.fsdp_config.param_offload=False",
    "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0",
    'trainer.logger=["console","wandb"]',
    "trainer.project_name=gsm8k_async_rl",
    "trainer.experiment_name=qwen2.5-0.5b_function_rm-gsm8k-sgl-multi-w-interaction-n8",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=1",
    "trainer.save_freq=-1",
    "trainer.test_freq=20",
    "data.train_files=$HOME/data/gsm8k_verl_sgl_multi_turn_w_interaction/train.parquet",
    "data.val_files=$HOME/data/gsm8k_verl_sgl_multi_turn_w_interaction/test.parquet",
    "trainer.total_epochs=15",
]
MULTITURN_YAML = """hydra:
  searchpath:
    - file://{verl_config}

defaults:
  - ppo_trainer
  - _self_

data:
  max_prompt_length: 1024
  max_response_length: 1024
  train_batch_size: 256
  return_raw_chat: True

actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: sglang
    multi_turn:
      enable: True
      max_user_turns: 5
"""
OFFLOAD_KEY = "actor_rollout_ref.model.enable_activation_offload"
GC_KEY = "actor_rollout_ref.model.enable_gradient_checkpointing"


@pytest.mark.parametrize(
    "name",
    [
        "sglang-multiturn-0.5b",
        "lora-3b+activation-offload",
        "fsdp2-offload-7b+activation-offload",
        "lora-3b-gc-off+activation-offload",
    ],
)
def test_activation_offload_and_gradient_checkpointing_are_turned_off_with_one_line_each(
    capsys, tmp_path, vllm_lora_helper, name
):
    """verl's activation offload and HF gradient checkpointing (``main_ppo.REPLACED``) are
    HiLoRe's plan's job: a recipe that turns them on passes the launcher and verl's
    ``validate_config`` with HiLoRe on, both set to false once each, and the launcher says so in
    one line per option; a recipe that turns gradient checkpointing off gets no line for it."""
    from omegaconf import OmegaConf
    from verl.utils.config import validate_config

    from hilore_actor.verl.main_ppo import compose, launch_args, verl_config_dir

    on = f"{OFFLOAD_KEY}=True"
    recipe = {
        "lora-3b+activation-offload": LORA_3B + [on],
        "fsdp2-offload-7b+activation-offload": OFFLOAD_7B + FSDP2 + [on],
        "lora-3b-gc-off+activation-offload": LORA_3B + [f"{GC_KEY}=False", on],
    }.get(name)
    if recipe is None:
        yaml = MULTITURN_YAML.format(verl_config=verl_config_dir())
        (tmp_path / "gsm8k_multiturn_grpo_w_interaction.yaml").write_text(yaml)
        recipe = [f"--config-path={tmp_path}"] + MULTITURN_05B
    gc_on = "gc-off" not in name
    overrides, env = launch_args(recipe + [ENABLE])
    lines = capsys.readouterr().out.splitlines()
    key = lambda a: a.lstrip("+").partition("=")[0]  # noqa: E731
    theirs = [] if gc_on else [a for a in recipe if key(a) == GC_KEY]  # checkpointing off: the recipe's, as given
    want = theirs + [f"{OFFLOAD_KEY}=false"] + ([f"{GC_KEY}=false"] if gc_on else [])
    assert [a for a in overrides if key(a) in (OFFLOAD_KEY, GC_KEY)] == want
    assert lines == [
        f"[hilore] {OFFLOAD_KEY}=true is turned off: HiLoRe's plan decides per unit what is kept, "
        "compressed or recomputed"
    ] + ([f"[hilore] {GC_KEY}=true is turned off: HiLoRe's plan recomputes per unit instead"] if gc_on else [])
    cfg = compose(overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    assert cfg.actor_rollout_ref.actor.strategy == "hilore" and env
    assert OmegaConf.select(cfg, OFFLOAD_KEY) is False and OmegaConf.select(cfg, GC_KEY) is False
    if name.startswith("sglang"):
        assert cfg.actor_rollout_ref.rollout.multi_turn.enable and cfg.actor_rollout_ref.rollout.name == "sglang"
    capsys.readouterr()
    assert launch_args(recipe) == (recipe, {}) and not capsys.readouterr().out  # HiLoRe off: verl's own savers stay


def _fused_model(monkeypatch, seed):
    """A tiny Llama whose class forward is verl's fused head (``patch_forward_with_backends``,
    torch backend, as ``_build_module`` applies it), restored after the test."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    from hilore_actor.models import LoraSpec, build_model, init_lora_b, tiny_config

    model = build_model(
        tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=128),
        lora=LoraSpec(rank=4, alpha=8, dropout=0.0),
        seed=seed,
    ).train()
    init_lora_b(model, 0.02, seed)  # lora_A's gradients nonzero
    base = type(model.get_base_model())
    monkeypatch.setattr(base, "forward", base.forward)  # verl patches the class; undone at teardown
    return model, lambda: patch_forward_with_backends(
        model.get_base_model(), use_fused_kernels=True, fused_kernels_backend="torch"
    )


def _fused_loss(model, ids, pos, seed=0):
    """conftest's GRPO loss on the fused head's log-probs (element t: log p(token t+1))."""
    from hilore_actor.grpo import policy_loss

    gen = torch.Generator().manual_seed(seed)
    logp = model(input_ids=ids, position_ids=pos, use_cache=False, return_dict=True).log_probs[:, :-1]
    old, ref = (logp.detach() + 0.1 * torch.randn(logp.shape, generator=gen) for _ in range(2))
    mask = (torch.rand(logp.shape, generator=gen) > 0.2).float()
    loss, _ = policy_loss(logp, old, torch.randn(logp.shape, generator=gen), mask, ref, kl_coef=0.01)
    return loss, logp


def test_under_verls_fused_head_planning_runs_and_the_plan_and_omega_apply(monkeypatch):
    """verl's fused head (``use_fused_kernels=True``) returns log-probs and no logits: HiLoRe's
    planning passes read them (``models.logprobs.output_log_probs``) and equal the full-logits
    head's; the units are the same (the shrunken copy is traced through the patched class);
    gradients under H/R plans are bitwise plain autograd's on the same head, and omega is the
    autograd of the loss w.r.t. those log-probs."""
    import warnings

    from conftest import grads, packed_microbatch
    from hilore_actor.grpo.microbatch import microbatch_loss
    from hilore_actor.models.logprobs import sequence_log_probs, token_log_probs
    from hilore_actor.recovery import RecoveryEngine, structure
    from hilore_actor.workloads import replayed_microbatches

    seed = torch.seed() % 2**31
    print("seed", seed)
    monkeypatch.setattr(structure, "_CACHE", {})
    model, fuse = _fused_model(monkeypatch, seed)
    ids, pos = packed_microbatch(96, 128, n_seqs=3, seed=seed)
    mb = replayed_microbatches(model, 1, 64, group_size=2, mean_len=16, seed=seed)[0]
    with torch.no_grad():
        full = token_log_probs(model(input_ids=ids, position_ids=pos, use_cache=False).logits[:, :-1], ids[:, 1:])
        full_loss = microbatch_loss(model, mb).loss
    units = RecoveryEngine(model).unit_names
    fuse()
    with torch.no_grad():
        assert torch.allclose(sequence_log_probs(model, ids, pos), full, atol=1e-5)
        assert torch.allclose(microbatch_loss(model, mb).loss, full_loss, atol=1e-5)
        assert replayed_microbatches(model, 1, 64, group_size=2)  # the synthetic old log-probs
        assert torch.allclose(_fused_loss(model, ids, pos)[1], full, atol=1e-5)
    monkeypatch.setattr(structure, "_CACHE", {})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = RecoveryEngine(model)
    assert not [w for w in seen if "could not trace" in str(w.message)]  # traced, not the name table's
    assert engine.unit_names == units
    model.zero_grad(set_to_none=True)
    loss, logp = _fused_loss(model, ids, pos)
    omega = torch.autograd.grad(loss, logp, retain_graph=True)[0]
    loss.backward()
    ref = grads(model)
    gen = torch.Generator().manual_seed(seed)
    mixed = {n: "HR"[int(b)] for n, b in zip(units, torch.randint(0, 2, (len(units),), generator=gen))}
    for plan in ("all-r", mixed):
        model.zero_grad(set_to_none=True)
        with engine.step(plan):
            loss, logp = _fused_loss(model, ids, pos)
            assert torch.equal(torch.autograd.grad(loss, logp, retain_graph=True)[0], omega)
            loss.backward()
        g = grads(model)
        assert all(torch.equal(g[n], ref[n]) for n in ref), plan
    engine.detach()
