"""A run folder written by the job's own writers (``MetricsLog``, ``step_actions``, a checkpoint's
``meta.json`` with the flags) from made-up steps, in seconds and without Ray: what the report and
the step pictures are tested on beside the tiny job's real run."""

import json
import random

UNITS = [f"model.layers.{i}.{block}" for i in range(4) for block in ("self_attn", "mlp")]
RANKS, MICROBATCHES = 2, 3


def actions_of(seed: int, steps: int):
    """``[step][rank][microbatch]``: each unit's action, one letter per unit; rank 1's last
    microbatch of step 2 is a pad row of the zero-advantage skip."""
    rng = random.Random(seed)
    return [
        [
            [("".join(rng.choice("HPLR") for _ in UNITS), step == 1 and r == 1 and k == MICROBATCHES - 1)
             for k in range(MICROBATCHES)]
            for r in range(RANKS)
        ]
        for step in range(steps)
    ]  # fmt: skip


def step_row(step: int, rng: random.Random) -> dict:
    """A step's metrics as ``train_grpo.step_metrics`` writes the keys the report reads."""
    reward = rng.uniform(0.2, 0.8)
    peaks = {str(r): rng.uniform(0.6, 1.02) for r in range(RANKS)}
    return {
        "reward_mean": reward,
        "reward_min": 0.0,
        "reward_max": 1.0,
        "accuracy": reward / 2,
        "loss": 0.01,
        "update_seconds": rng.uniform(1.0, 2.0),
        "compare_gc_seconds": 2.0,
        "compare_hilore_seconds": 1.6,
        "compare_speedup_vs_gc": 1.25,
        "peak_over_budget": peaks,
        "peak_over_budget_max": max(peaks.values()),
        "budget_scope": "device",
        "coordinator": {
            str(r): {"budget_bytes": 64 * 2**20, "peaks_over_budget": [0.5, 0.6, 0.7]} for r in range(RANKS)
        },
        "fraction_H": 0.4,
        "fraction_P": 0.1,
        "fraction_L": 0.2,
        "fraction_R": 0.3,
        "zero_adv_share": 0.25,
        "zero_adv_token_share": 0.2,
        "zero_adv_skip": 1,
        "eval_accuracy": reward,
        "eval_reward_mean": reward,
    }


def write_run(path, seed: int, steps: int = 3, wandb=None):
    """``steps`` steps into ``path`` through ``MetricsLog`` (TensorBoard under ``path``; W&B with
    ``wandb``, ``metrics.wandb_options``'s dict); returns ``actions_of``'s actions."""
    from hilore_actor.train.config import parse_config
    from hilore_actor.train.metrics import MetricsLog, step_actions
    from hilore_actor.train.resume import saved_config

    rng = random.Random(seed)
    acts = actions_of(seed, steps)
    log = MetricsLog(path, wandb=wandb)
    for s in range(steps):
        per_update = [
            [
                {
                    "rank": r,
                    "microbatches": [
                        {"update": 0, "microbatch": k, "actions": a, "skipped": pad, "replayed": False, "tokens": 90,
                         "peak_bytes": 2**26, "peak_over_budget": rng.uniform(0.5, 1.03)}
                        for k, (a, pad) in enumerate(acts[s][r])
                    ],
                }
                for r in range(RANKS)
            ]
        ]  # fmt: skip
        log.log(s + 1, step_row(s + 1, rng), (), step_actions(per_update, UNITS))
    log.close()
    cfg = parse_config(["--preset", "tiny", "--save_path", str(path)])
    ck = path / "checkpoints"
    (ck / f"step_{steps}").mkdir(parents=True)
    (ck / f"step_{steps}" / "meta.json").write_text(json.dumps({"step": steps, "config": saved_config(cfg)}))
    (ck / "latest").write_text(f"step_{steps}")
    return acts
