"""GRPO training on Ray with a HiLoRe learner: the package's main job.

    python -m hilore_actor.train_grpo --preset cpu-demo
    ray job submit -- python -m hilore_actor.train_grpo --preset tiny

One controller (this process) drives, per step:

    prompts -> rollout workers (vLLM or HF generate) -> verifier rewards -> group advantages
      (+ replayed rollouts, ``--replay.*``) -> packed rows -> reference worker (KL log-probs)
      -> learner ranks (old log-probs, then HiLoRe updates under DeepSpeed; peaks to the
      budget coordinator) -> weights to rollout workers -> metrics, checkpoint

The pieces live in ``hilore_actor/train/`` (config, job, learner, workers, placement, faults,
checkpoint, metrics, evaluation), ``hilore_actor/learner/`` (plan, step, coordinator) and
``hilore_actor/rollout/replay.py``; this file is the recipe. Flags: ``--help``.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from functools import partial
from typing import Dict, List

import torch

from hilore_actor.data.reward_function import RewardError
from hilore_actor.train.config import (
    ignored_notes,
    parse_config,
    plan_tokens,
    skips_zero_advantage,
    uses_reference,
    world_size,
)
from hilore_actor.train.errors import ConfigError, JobError
from hilore_actor.train.faults import SkipCounter, StopRequest, TooManySkipped
from hilore_actor.train.job import Job
from hilore_actor.train.metrics import learner_means, rollout_metrics
from hilore_actor.train.skip import skip_rows, zero_advantage_shares


def checkpoint_root(cfg) -> str:
    """``--ckpt.path`` or ``<save_path>/checkpoints``, absolute: every rank, on every node,
    reads and writes the same folder (``train/placement.py`` checks that it can)."""
    return os.path.abspath(cfg.ckpt.path or os.path.join(cfg.save_path, "checkpoints"))


def load_prompts(cfg, dataset=None, keys=None):
    """The task (``dataset``, default ``--data.prompt_dataset``; its prompt and answer fields
    ``keys``, default ``--data.input_key``/``--data.label_key``) with its reward: the task's
    verifier, ``--reward.path``'s function or ``--reward.remote_url``'s server. Checked before any
    worker starts: a malformed dataset or reward function fails here."""
    from hilore_actor.data import DatasetError, load_task

    options = json.loads(cfg.data.task_options) if cfg.data.task_options else None
    prompt_key, answer_key = keys or (cfg.data.input_key, cfg.data.label_key)
    task = load_task(
        dataset or cfg.data.prompt_dataset,
        size=cfg.data.max_samples,
        seed=cfg.train.seed,
        options=options,
        instruction=cfg.data.instruction,
        prompt_key=prompt_key,
        answer_key=answer_key,
    )
    chat = next((e for e in task.examples if isinstance(e.prompt, list)), None)
    if chat is not None and not cfg.data.apply_chat_template:
        raise DatasetError(
            f"{chat.metadata['source']}: the prompt is a list of chat messages, which needs "
            "--data.apply_chat_template (drop '--data.apply_chat_template false')"
        )
    if cfg.reward.path:
        from hilore_actor.data.reward_function import load_reward_function

        task.scorer = load_reward_function(cfg.reward.path, cfg.reward.name)
    elif cfg.reward.remote_url:
        from hilore_actor.data.reward_function import RemoteReward

        task.scorer = RemoteReward(cfg.reward.remote_url.split(","))
    return task


def step_prompts(task, cfg, step: int):
    """The step's prompts: a fixed shuffle per epoch, so a resumed run draws the same ones."""
    n, bs = len(task.examples), cfg.rollout.batch_size
    orders: Dict[int, List[int]] = {}  # epoch -> its shuffle, made once
    out = []
    for k in range(step * bs, (step + 1) * bs):
        epoch, i = divmod(k, n)
        if epoch not in orders:
            orders[epoch] = torch.randperm(
                n, generator=torch.Generator().manual_seed(cfg.train.seed * 7919 + epoch)
            ).tolist()
        out.append(task.examples[orders[epoch][i]])
    return out


def shard_rows(seqs, cfg) -> List[List[Dict]]:
    """Sequences -> per rank, the packed rows of every update of the step, in update order;
    each row names its sequences (``seq_index``, indices into ``seqs``) and its ``update``."""
    from hilore_actor.rollout.packing import pack_row

    world, tb, micro = world_size(cfg), cfg.train.batch_size, cfg.train.micro_batch_size
    per_rank = tb // world
    ranks: List[List[Dict]] = [[] for _ in range(world)]
    for u in range(len(seqs) // tb):
        for r in range(world):
            first = u * tb + r * per_rank
            for i in range(first, first + per_rank, micro):
                ranks[r].append(dict(pack_row(seqs[i : i + micro]), seq_index=list(range(i, i + micro)), update=u))
    return ranks


def run(cfg) -> int:
    from tqdm import tqdm

    from hilore_actor.learner.coordinator import call
    from hilore_actor.models.source import check_model_spec, load_tokenizer
    from hilore_actor.train.checkpoint import CheckpointDir
    from hilore_actor.train import run_dir
    from hilore_actor.train.evaluation import due, evaluate, load_eval_task
    from hilore_actor.train.metrics import MetricsLog, pick_samples, step_actions, summary, wandb_options

    check_model_spec(cfg.actor.model_name_or_path)
    task = load_prompts(cfg)
    eval_task = load_eval_task(cfg, load_prompts)  # --eval.dataset, read and checked as the task is
    tok = load_tokenizer(cfg.actor.model_name_or_path)
    if any(isinstance(e.prompt, list) for e in task.examples) and not getattr(tok, "chat_template", None):
        raise JobError(
            f"{cfg.data.prompt_dataset} holds chat messages and the tokenizer of "
            f"{cfg.actor.model_name_or_path} has no chat template to render them"
        )
    from hilore_actor.rollout.hf_generate import apply_chat

    longest = max(len(apply_chat(tok, e.prompt, cfg.data.apply_chat_template)) for e in task.examples)
    if longest > cfg.data.prompt_max_len:
        raise JobError(
            f"a prompt of {cfg.data.prompt_dataset} has {longest} tokens, more than --data.prompt_max_len "
            f"{cfg.data.prompt_max_len}; raise it or shorten the prompts"
        )
    cfg.hilore.plan_tokens = plan_tokens(cfg, longest)  # the largest microbatch these prompts can make
    probe_reward(task, cfg, tok)
    check_budget_floor(cfg, tok)
    run_dir.resolve(cfg)  # the last of the checks before Ray: it creates the run's folder
    ckpts = CheckpointDir(checkpoint_root(cfg))
    start, resume_dir, replan, resumed = 0, None, [], {}
    if cfg.ckpt.load_enable:
        last, skipped = ckpts.resumable()
        if last is None:
            raise JobError(
                f"--resume: no complete checkpoint under {ckpts.root}"
                + (f" ({len(skipped)} damaged: see above)" if skipped else "")
            )
        resumed = CheckpointDir.meta(last)
        start, resume_dir = resumed["step"], str(last)
        print(f"[train] resuming from {last} (after step {start})", flush=True)
        from hilore_actor.train.config import flatten_ns
        from hilore_actor.train.resume import check

        replan = check(last, flatten_ns(cfg))  # before Ray: refused flags end here, re-planned ones are said
    if start >= cfg.max_steps:
        print(f"[train] nothing to do: the checkpoint is at step {start} and --max_steps is {cfg.max_steps}")
        return 0

    import ray

    local_ray = False
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=cfg.log_workers)  # inside `ray job submit`, or an explicit cluster
        else:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=cfg.log_workers)
            local_ray = True
    t0 = time.perf_counter()
    how = (
        "restores its budget and plan from the checkpoint"
        if resume_dir and not replan
        else f"measures gc and plans its units on a {cfg.hilore.plan_tokens}-token microbatch first "
        f"(minutes for a real model on CPU: each rank's phase below; --log_workers shows the planner's lines)"
    )
    workers = max(cfg.vllm.num_engines, cfg.rollout.num_workers)
    ref = "a reference worker"
    if not uses_reference(cfg):
        why = "--algo.kl.init_coef is 0" if cfg.algo.kl.use_loss else "--algo.kl.use_loss is off"
        ref = f"no reference worker ({why}: the loss reads no reference log-probs, and no kl metric is logged)"
    print(
        f"[train] starting {world_size(cfg)} learner rank(s), {workers} rollout worker(s) and {ref}; "
        f"each learner {how}",
        flush=True,
    )
    job = Job(cfg, resume_dir, str(ckpts.root), local_ray)
    print(f"[train] Ray actors: {', '.join(job.actor_names())}", flush=True)
    try:
        if resume_dir:
            job.get([l.load.remote(resume_dir) for l in job.learners])
        info = job.infos[0]
        peaks = [(i["plan_peak_over_budget"], i["plan_peak_phase"]) for i in job.infos]
        measured = [p for p in peaks if p[0] is not None]  # None: a migrated plan whose planning was not measured
        plan_peak, peak_phase = max(measured, key=lambda x: x[0]) if measured else (None, None)
        print(  # the B in force
            f"[train] {world_size(cfg)} learner rank(s), backend {cfg.actor.backend}, budget B = "
            f"{info['budget_bytes'] / 2**20:.0f} MiB ({info['budget_spec']}, {info['budget_scope']} scope; "
            f"gc's in-microbatch peak {info['gc_peak_bytes'] / 2**20:.0f} MiB, resident "
            f"{info['resident_bytes'] / 2**20:.0f} MiB, on a {info['plan_tokens']}-token microbatch); "
            f"plan {info.get('plan', '-')}; planning peaked at {'-' if plan_peak is None else f'{plan_peak:.3f}'} B"
            f"{f' ({peak_phase})' if peak_phase else ''}; ready in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        if info.get("gc_peak_over_budget", 0) > 1:
            print(
                f"[train] B is {1 / info['gc_peak_over_budget']:.2f} x gc's peak: a run gradient checkpointing "
                "cannot make within B (planning's gc reference pass measured it above B)",
                flush=True,
            )
        if info.get("plan_why"):
            print(f"[train] rank 0's plan: {info['plan_why']}", flush=True)
        log = MetricsLog(
            cfg.save_path,
            cfg.logger.tensorboard_dir,
            resume_step=start if resume_dir else None,
            wandb=wandb_options(cfg),
        )
        bar = tqdm(
            range(start, cfg.max_steps),
            desc="grpo",
            unit="step",
            initial=start,
            total=cfg.max_steps,
            file=sys.stdout,
            dynamic_ncols=True,
        )
        job.sync_weights()
        stop = StopRequest().__enter__()
        skips = SkipCounter(cfg.train.max_skipped_updates, resumed.get("skipped_in_a_row", 0))
        restarts_before = call(job.coordinator.restart_count)
        buffer = replay_buffer(cfg, resume_dir)
        for step in bar:
            rewards, out, per_update, rollout_s, ref_s, replayed, skip = train_step(
                job, task, cfg, step, stop, buffer, tok
            )
            m = step_metrics(rewards, out, per_update, rollout_s, ref_s, call(job.coordinator.step_record, step))
            if ref_s is None:  # no reference worker: no KL to it, nothing timed
                del m["kl"], m["ref_seconds"]
            m.update(skip)
            m["sync_bytes"] = job.sync_bytes  # bytes each rollout worker got per update (vLLM LoRA: the adapter)
            if buffer is not None:
                from hilore_actor.rollout.replay import stats

                m.update(stats(replayed, buffer, step))
            m["plan_peak_over_budget"], m["budget_scope"] = plan_peak, info["budget_scope"]
            m["coordinator_restarts"] = call(job.coordinator.restart_count)
            _say_recoveries(m, step + 1, restarts_before)
            restarts_before = m["coordinator_restarts"]
            m["learner_nodes"] = {str(i["rank"]): i.get("node_id") for i in job.infos}
            if cfg.compare_skip:  # per repeat, the slowest rank: the update waits for it
                per_rank = job.get([l.compare_skip.remote(cfg.compare_skip) for l in job.learners])
                m["compare_skip_times"] = times = {
                    k: [max(t) for t in zip(*(r[k] for r in per_rank))] for k in per_rank[0]
                }
                m["compare_skip_speedup"] = statistics.median(a / b for a, b in zip(times["all"], times["skip"]))
            if cfg.compare_gc:
                cmp = job.get([l.compare.remote() for l in job.learners])
                for key in cmp[0]:
                    m[key] = max(c[key] for c in cmp)
                m["compare_speedup_vs_gc"] = m["compare_gc_seconds"] / m[f"compare_{cfg.actor.backend}_seconds"]
            samples = pick_samples(
                step_prompts(task, cfg, step),
                out["texts"],
                rewards.tolist(),
                cfg.rollout.n_samples_per_prompt,
                cfg.logger.samples_per_step,
            )
            if eval_task is not None and due(cfg, step + 1):
                evals, eval_samples = evaluate(job, eval_task, cfg, step, partial(score, eval_task, G=1, tok=tok))
                m.update(evals)
                samples += eval_samples
            log.log(step + 1, m, samples, step_actions(per_update, job.infos[0].get("units", [])))
            for upd in per_update:
                skips.update(any(r["skipped"] for r in upd), step + 1)
            if job.calibration_pending:  # the first step ran H/R; from the next one on, the wanted mode
                job.calibrate()
            bar.set_postfix_str(summary(m))
            tqdm.write(f"[step {step + 1}] {summary(m)}", file=sys.stdout)
            if (
                (cfg.ckpt.save_steps > 0 and (step + 1) % cfg.ckpt.save_steps == 0)
                or step + 1 == cfg.max_steps
                or stop.requested
            ):
                saved = save_checkpoint(job, ckpts, step + 1, m, cfg.ckpt.max_num, buffer, skips.in_a_row)
            if stop.requested and step + 1 < cfg.max_steps:
                break
        stop.__exit__()
        bar.close()
        log.close()
        if stop.requested and step + 1 < cfg.max_steps:
            print(
                f"[train] stopped after step {step + 1} of {cfg.max_steps} ({signal.Signals(stop.signal).name}); "
                f"checkpoint {saved}; rerun the same command with --resume to continue",
                flush=True,
            )
            return 0
        path = job.get([l.save_hf.remote(os.path.join(cfg.save_path, "final")) for l in job.learners])[0]
        print(
            f"[train] done: {cfg.max_steps} steps; metrics {log.path}; weights {path}; checkpoints {ckpts.root}",
            flush=True,
        )
        print_report(log.path, cfg)
        write_run_report(cfg.save_path)
        return 0
    finally:
        job.close()


def probe_reward(task, cfg, tok, n: int = 2) -> None:
    """Call a user's reward (``--reward.path``, ``--reward.remote_url``) once before Ray starts,
    on the first ``n`` prompts with their reference answers as responses, as the run will call
    it: a wrong return type or length, or a server that does not answer, fails in seconds."""
    from hilore_actor.rollout.hf_generate import apply_chat

    if not (cfg.reward.path or cfg.reward.remote_url):
        return
    examples = task.examples[:n]
    seqs = []
    for e in examples:
        prompt = apply_chat(tok, e.prompt, cfg.data.apply_chat_template)
        seqs.append((list(prompt) + tok.encode(e.answer, add_special_tokens=False), len(prompt), None))
    try:
        score(task, {"texts": [e.answer for e in examples], "seqs": seqs}, examples, G=1, tok=tok)
    except RewardError as e:
        raise JobError(
            f"{e}; found before any worker started, by scoring the answers of {len(examples)} prompts"
        ) from None


def check_budget_floor(cfg, tok) -> None:
    """A ``--hilore.budget`` size (device scope) below the bytes a rank holds between microbatches,
    read from the model's config on the meta device (``scope.resident_floor``), is refused here:
    no plan could meet it, and finding that out would take Ray, the weights and a gc pass."""
    from hilore_actor.allocation.budget import parse_budget
    from hilore_actor.learner.scope import resident_floor
    from hilore_actor.models.source import meta_policy
    from hilore_actor.train.config import lora_spec, param_dtype

    spec = str(cfg.hilore.budget).strip().lower()
    if spec == "auto" or cfg.hilore.budget_scope != "device":
        return
    kind, budget = parse_budget(spec)
    if kind != "bytes":
        return
    dtype = param_dtype(cfg)
    model = meta_policy(cfg.actor.model_name_or_path, tok, dtype=dtype, lora=lora_spec(cfg))
    if model is None:
        return
    floor = resident_floor(
        model, world=world_size(cfg), zero_stage=cfg.ds.zero_stage, mixed_precision=dtype != torch.float32
    )
    if budget < floor:
        raise JobError(
            f"--hilore.budget {cfg.hilore.budget}: below the {floor / 2**20:.1f} MiB a rank holds between "
            f"microbatches (weights, gradients and AdamW state of {cfg.actor.model_name_or_path} under ZeRO-"
            f"{cfg.ds.zero_stage} on {world_size(cfg)} rank(s), before any activation); give a larger size, a "
            "ratio of gc's peak (1.10) or auto"
        )


def score(task, out, examples, G: int, tok=None) -> List[float]:
    """The rollouts' rewards; a batched reward function also gets the rendered prompts and the
    queries (prompt + response), decoded as OpenRLHF passes them."""
    exs = [examples[i // G] for i in range(len(out["texts"]))]
    prompts = queries = None
    if tok is not None and getattr(task.scorer, "needs_text", False):
        prompts = [tok.decode(ids[:p], skip_special_tokens=False) for ids, p, _ in out["seqs"]]
        queries = [tok.decode(ids, skip_special_tokens=False) for ids, _, _ in out["seqs"]]
    return task.score_all(out["texts"], exs, prompts, queries)


def train_step(job, task, cfg, step: int, stop, buffer=None, tok=None):
    """One GRPO step: rollouts -> rewards -> group advantages (+ replayed rollouts) -> packed
    rows per rank -> reference log-probs -> the learners' updates (weights to the rollout
    workers after each). Returns (rewards, rollouts, per update every rank's metrics,
    rollout s, reference s (None without a reference worker), the replayed rollouts)."""
    from hilore_actor.grpo import group_advantages

    G = cfg.rollout.n_samples_per_prompt
    examples = step_prompts(task, cfg, step)
    t = time.perf_counter()
    out = job.generate([e.prompt for e in examples], step)
    stop.inject(step)
    rollout_s = time.perf_counter() - t
    rewards = torch.tensor(score(task, out, examples, G, tok), dtype=torch.float32)
    adv = group_advantages(rewards, G, cfg.algo.advantage.estimator)
    seqs = [(s, p, float(a)) for (s, p, _), a in zip(out["seqs"], adv)]
    replayed = draw_replay(buffer, cfg, step)
    seqs += [(it.ids, it.prompt_len, it.advantage, it.old_log_probs, it.ref_log_probs) for it in replayed]
    ranks = shard_rows(seqs, cfg)  # fresh rollouts first: every fresh rollout is in the step's batch
    pads, unskipped, skipping = 0, [None] * len(ranks), skips_zero_advantage(cfg)
    if skipping:  # responses with advantage 0 add nothing to the gradient: not run
        if cfg.compare_skip:
            unskipped = ranks
        ranks, pads = skip_rows(ranks, seqs)
    all_rows = [r for rows in ranks for r in rows]
    ref_s = None  # no reference worker: the learners take their old log-probs in its place (never read)
    if job.ref is not None:
        t = time.perf_counter()
        for r, ref in zip(all_rows, job.get(job.ref.log_probs.remote(all_rows))):
            given = "given_mask" in r
            r["ref_log_probs"] = torch.where(r["given_mask"], r["given_ref_log_probs"], ref) if given else ref
        ref_s = time.perf_counter() - t
    olds = job.get([l.set_batch.remote(step, rows, more) for l, rows, more in zip(job.learners, ranks, unskipped)])
    if buffer is not None:
        store_fresh(buffer, seqs[: len(out["seqs"])], ranks, olds, step)
    per_update = []
    for u in range(len(seqs) // cfg.train.batch_size):
        side = (
            job.get([l.gradient_error.remote(u) for l in job.learners])
            if cfg.measure_grad_error
            else [{}] * len(job.learners)
        )
        per_update.append(
            [
                dict(r, **(e or {}))
                for r, e in zip(job.progress.get([l.update.remote(step, u) for l in job.learners], "update"), side)
            ]
        )
        job.sync_weights()
    fresh = seqs[: len(out["seqs"])]  # the step's own responses (a replayed one never has advantage 0)
    skip = dict(zero_advantage_shares(fresh), zero_adv_skip=int(skipping), pad_microbatches=pads)
    return rewards, out, per_update, rollout_s, ref_s, replayed, skip


def replay_buffer(cfg, resume_dir):
    """``--replay.enable``'s buffer, restored from the checkpoint on ``--resume``; else None."""
    if not cfg.replay.enable:
        return None
    from hilore_actor.rollout.replay import ReplayBuffer

    r = cfg.replay
    buffer = ReplayBuffer(r.capacity, r.max_age, r.priority, r.alpha, seed=cfg.train.seed)
    saved = os.path.join(resume_dir, "replay.pt") if resume_dir else None
    if saved and os.path.isfile(saved):
        buffer.load_state_dict(torch.load(saved, weights_only=False))
        print(f"[train] replay buffer restored: {len(buffer)} rollouts", flush=True)
    elif saved:
        print(
            "[train] the checkpoint holds no replay buffer (saved without --replay.enable): it starts empty", flush=True
        )
    return buffer


def draw_replay(buffer, cfg, step: int):
    """The step's replayed rollouts: old ones evicted, then ``--replay.ratio`` x the fresh
    ones, as many whole updates of them as the buffer holds (``config.replay_sequences``)."""
    if buffer is None:
        return []
    from hilore_actor.train.config import replay_sequences

    buffer.evict(step)
    tb = cfg.train.batch_size
    if 0 < len(buffer) < tb:  # replayed rollouts come in whole updates
        print(
            f"[train] step {step + 1}: the replay buffer holds {len(buffer)} rollouts, fewer than one update "
            f"(--train.batch_size {tb}): nothing replayed",
            flush=True,
        )
    return buffer.sample(min(replay_sequences(cfg), len(buffer)) // tb * tb, step)


def store_fresh(buffer, fresh, ranks, olds, step: int) -> None:
    """The step's fresh rollouts into the buffer, each with its old log-probs (the learners'
    ``set_batch``) and reference log-probs, cut out of the packed rows (without a reference
    worker, the old ones: the loss has no KL term that would read them)."""
    from hilore_actor.rollout.replay import ReplayItem, split_row

    items = {}
    for rows, row_olds in zip(ranks, olds):
        for r, old in zip(rows, row_olds):
            if r.get("replayed") or r.get("pad"):  # rows are all fresh or all replayed: fresh ones fill updates first
                continue
            lengths = [len(fresh[i][0]) for i in r["seq_index"]]
            refs = split_row(r.get("ref_log_probs", old), lengths)
            for i, o, ref in zip(r["seq_index"], split_row(old, lengths), refs):
                ids, p, a = fresh[i]
                items[i] = ReplayItem(ids, p, a, step, o, ref)
    buffer.add([items[i] for i in sorted(items)])


def save_checkpoint(job, ckpts, step: int, m: Dict, keep: int, buffer=None, skipped_in_a_row: int = 0):
    """Every rank's state, the coordinator's, the replay buffer, then the atomic commit
    (``train/checkpoint.py``); the driver's own state across steps (``skipped_in_a_row``: updates
    skipped for a non-finite gradient in a row) goes into ``meta.json``."""
    from hilore_actor.learner.coordinator import STATE_FILE, call
    from hilore_actor.train.checkpoint import versioned

    stage = ckpts.staging(step)
    job.get([l.save.remote(str(stage)) for l in job.learners])
    (stage / STATE_FILE).write_text(json.dumps(versioned(call(job.coordinator.state))))
    if buffer is not None:
        torch.save(buffer.state_dict(), stage / "replay.pt")
    from hilore_actor.train.resume import saved_config

    # the flags, so that --resume can refuse or re-plan what differs before Ray starts (train/resume.py)
    meta = {"metrics": m, "config": saved_config(job.cfg), "skipped_in_a_row": skipped_in_a_row}
    return ckpts.commit(stage, step, meta, keep=keep)


def _say_recoveries(m: Dict, step: int, restarts_before: int) -> None:
    """What the learner side recovered from in this step, on the driver's stdout."""
    if m["coordinator_restarts"] > restarts_before:
        print(
            f"[train] step {step}: the budget coordinator died and was restarted by Ray; it reloaded the state "
            f"saved with the last checkpoint",
            flush=True,
        )
    if m["oom_reruns"]:
        ranks = sorted(r for r, rec in m["coordinator"].items() if rec.get("out_of_memory"))
        print(
            f"[train] step {step}: {m['oom_reruns']} microbatch(es) ran out of memory (rank {', '.join(ranks)}) and "
            "were rerun all-R; those plans now store less",
            flush=True,
        )


def step_metrics(rewards, out, per_update, rollout_s, ref_s, record) -> Dict:
    last = per_update[-1]
    update_s = sum(max(r["update_seconds"] for r in upd) for upd in per_update)
    tokens = sum(r["tokens"] for upd in per_update for r in upd)

    def mean(key):  # over the ranks that trained a row (with the skip, a rank may run only pads)
        values = [r[key] for r in last if r.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    return {
        "reward_mean": float(rewards.mean()),
        "accuracy": float((rewards == 1).float().mean()),
        "response_length": statistics.fmean(s[2] for s in out["seqs"]),
        **rollout_metrics(rewards.tolist(), [s[2] for s in out["seqs"]]),
        **learner_means(last, ("entropy",)),
        "loss": mean("loss"),
        "policy_loss": mean("policy_loss"),
        "kl": mean("kl_mean"),
        "clip_fraction": mean("clip_fraction"),
        "grad_norm": last[0]["grad_norm"],
        "lr": last[0]["lr"],
        "skipped_updates": sum(any(r.get("skipped") for r in upd) for upd in per_update),
        "oom_reruns": sum(r.get("oom_reruns", 0) for upd in per_update for r in upd),
        "update_seconds": update_s,
        "rollout_seconds": rollout_s,
        "ref_seconds": ref_s,
        "tokens_per_second": tokens / max(update_s, 1e-9),
        "peak_over_budget": {
            str(r["rank"]): max(u[i]["peak_over_budget"] for u in per_update) for i, r in enumerate(last)
        },
        "peak_over_budget_max": max(r["peak_over_budget"] for u in per_update for r in u),
        **{f"fraction_{a}": mean(f"fraction_{a}") for a in "HLPR"},
        "coordinator": record,
        **_gradient_error(per_update),
        **_by_kind(per_update),
    }


def _by_kind(per_update) -> Dict:
    """The H/L/P/R split and clip fraction of microbatches with replayed rollouts and of those
    with fresh ones only, weighted by rows over ranks and updates."""
    out = {}
    for kind in ("fresh", "replay"):
        rs = [r for upd in per_update for r in upd if r.get(f"{kind}_rows")]
        n = sum(r[f"{kind}_rows"] for r in rs)
        if not n:
            continue
        for key in [f"{kind}_fraction_{a}" for a in "HLPR"] + [f"{kind}_clip_fraction"]:
            if all(key in r for r in rs):
                out[key] = sum(r[key] * r[f"{kind}_rows"] for r in rs) / n
        out[f"{kind}_microbatches"] = n
    return out


def _gradient_error(per_update) -> Dict:
    """``--measure_grad_error``'s side pass over the step's updates and ranks (empty without it)."""
    errs = [r["grad_rel_error"] for upd in per_update for r in upd if "grad_rel_error" in r]
    if not errs:
        return {}
    return {
        "grad_rel_error": statistics.fmean(errs),
        "grad_rel_error_max": max(errs),
        "grad_cosine_min": min(r["grad_cosine"] for upd in per_update for r in upd if "grad_cosine" in r),
    }


def print_report(path, cfg) -> None:
    """The reward curve and, with --compare_gc, the update time against gc, from metrics.jsonl."""
    rows = [json.loads(ln) for ln in open(path) if ln.strip()]
    print(
        "\nstep  reward  accuracy  resp.len  loss        entropy  update s  peak/B  A=0"
        + ("  gc s    " + cfg.actor.backend + " s  speed" if cfg.compare_gc else "")
    )
    for r in rows:
        line = (
            f"{r['step']:>4}  {r['reward_mean']:.3f}   {r['accuracy']:.3f}     {r['response_length']:>6.1f}  "
            f"{_num(r['loss'], '+10.3e')}  {_num(r.get('entropy'), '7.3f')}  {r['update_seconds']:>7.2f}  "
            f"{r['peak_over_budget_max']:.3f}  {_zero_adv(r)}"
        )
        if "compare_speedup_vs_gc" in r:
            ours = r[f"compare_{cfg.actor.backend}_seconds"]
            line += f"  {r['compare_gc_seconds']:>6.2f}  {ours:>8.2f}  x{r['compare_speedup_vs_gc']:.3f}"
        print(line)
    if rows and "compare_speedup_vs_gc" in rows[0]:
        gc = sum(r["compare_gc_seconds"] for r in rows)
        ours = sum(r[f"compare_{cfg.actor.backend}_seconds"] for r in rows)
        print(
            f"update time on the same microbatches, all steps: gc {gc:.1f}s, {cfg.actor.backend} {ours:.1f}s "
            f"(x{gc / ours:.3f})"
        )
    for r in (r for r in rows if "eval_accuracy" in r):
        print(
            f"held-out after step {r['step']}: accuracy {r['eval_accuracy']:.3f}, reward {r['eval_reward_mean']:.3f} "
            f"({r['eval_prompts']} prompts, greedy)"
        )


def write_run_report(folder) -> None:
    """The run's page (``python -m hilore_actor.report``), its path the run's last line. The run
    has finished by now: a report that cannot be written is said in one line, the run still succeeds."""
    from hilore_actor.report.page import write

    try:
        print(f"[train] report: {write(folder)}", flush=True)
    except Exception as e:  # noqa: BLE001  the weights and metrics are written: nothing to undo
        print(f"[train] the report was not written ({type(e).__name__}: {e}); python -m hilore_actor.report {folder}")


def _zero_adv(r: Dict) -> str:
    """The step's share of responses with advantage 0, and whether the learners skipped them."""
    share = r.get("zero_adv_share")
    return "  -" if share is None else f"{share:>4.0%}" + (" skipped" if r.get("zero_adv_skip") else "")


def _num(v, fmt: str) -> str:
    """A report cell: the number, or '-' right-aligned where the row has none (or a step that
    trained nothing has NaN)."""
    if v is not None and v == v:
        return format(v, fmt)
    return "-".rjust(int(fmt.split(".")[0].lstrip("+")))


def main(argv=None) -> int:
    try:
        cfg = parse_config(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in ignored_notes(cfg):
        print(note, flush=True)
    ray_before = _ray_running()
    try:
        return _run(cfg)
    finally:
        if not ray_before and _ray_running():  # the Ray this run started or joined, whatever the outcome:
            sys.modules["ray"].shutdown()  # left to the interpreter's exit, its workers outlived us, busy
        from hilore_actor.train.run_dir import release_all

        release_all()  # the run folder, for the next run (``train/run_dir.py``)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _run(cfg) -> int:
    """``run`` with each failure said in one line, and its exit status."""
    try:
        return run(cfg)
    except (JobError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:  # the user's reward function raised during the run
        print(f"error: {e}; full trace: {_trace_file(cfg, e)}; {_last_checkpoint(cfg)}", file=sys.stderr)
        return 1
    except TooManySkipped as e:
        from hilore_actor.train.checkpoint import CheckpointDir

        last = CheckpointDir(checkpoint_root(cfg)).latest()
        print(f"error: {e}; the last checkpoint is {last}" if last else f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # Ray wraps worker failures
        return _worker_failure(e, cfg)


USER_ERRORS = ("BudgetError", "DatasetError", "ConfigError", "ValueError", "FileNotFoundError")


def _worker_failure(e: Exception, cfg) -> int:
    """A worker's exception (raised in a task, or in an actor's ``__init__``) or a dead worker:
    one message that says what failed and where the last checkpoint is; exit 2 for bad input
    a worker detected (e.g. a budget below the minimum), 1 otherwise."""
    import re

    import ray.exceptions as rex

    if not isinstance(e, (rex.RayTaskError, rex.RayActorError)):
        raise e
    where = f"{_last_checkpoint(cfg)}; full trace: {_trace_file(cfg, e)}"
    found = re.findall(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$", str(e), flags=re.M)
    if found and (isinstance(e, rex.RayTaskError) or getattr(e, "actor_init_failed", False)):
        name, msg = found[-1]
        print(f"error: {name}: {msg} ({where})", file=sys.stderr)
        return 2 if name in USER_ERRORS else 1
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"error: a Ray worker died during training ({type(e).__name__}: {first}); {where}", file=sys.stderr)
    return 1


def _last_checkpoint(cfg) -> str:
    from hilore_actor.train.checkpoint import CheckpointDir

    last = CheckpointDir(checkpoint_root(cfg)).latest()
    return (
        f"the last checkpoint is {last}; rerun with --resume to continue from it"
        if last
        else "no checkpoint was written yet"
    )


def _trace_file(cfg, e: BaseException) -> str:
    """The exception's whole trace (a worker's remote one included) in ``<save_path>/error.log``,
    so the terminal shows one line."""
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(e))  # a RayTaskError's message holds the remote trace
    for folder in (cfg.save_path, tempfile.gettempdir()):
        try:
            path = os.path.join(folder, "error.log")
            with open(path, "a") as f:
                f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{text}")
            return path
        except OSError:
            continue
    return "(not written)"


if __name__ == "__main__":
    raise SystemExit(main())
