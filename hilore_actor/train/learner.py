"""One learner rank: a DeepSpeed ZeRO engine whose backward runs under HiLoRe (or gc / none).

Lifecycle (the driver calls these on every rank; ``ray.remote(Learner)`` makes the actor):

1. ``__init__``: join the process group (gloo on CPU, NCCL on CUDA), load the policy (+ LoRA).
   Before DeepSpeed wraps the model, plan on the bare model: synthetic GRPO microbatches of
   the largest shape the flags allow (``workloads.replayed_microbatches``) give the gc peak
   (for a budget given as a ratio), the calibration (mode ``hilore``) and the validated plan.
   Planning runs many extra forward/backward passes whose count depends on measurements; it
   must happen before ZeRO, whose gradient hooks and parameter gathers need every rank in
   lockstep. A smaller microbatch uses the same plan: each unit then holds fewer bytes.
   Then ``deepspeed.initialize`` and attach the recovery engine to the DeepSpeed module.
2. ``set_batch``: this rank's packed rows of the step; old log-probs with the current weights.
3. ``update``: the rows of one optimizer update, microbatch by microbatch: forward, loss
   (Eq. 1), online actions from omega (Eq. 4 -> Eq. 7 -> Eq. 13), ``engine.backward``; the
   measured peak goes to the budget coordinator, which may answer ``tighten``: shrink the
   plan's memory budget by the overshoot and re-plan before the next microbatch.
4. ``export_weights`` for rollout workers; ``save`` / ``load`` checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..grpo.microbatch import Microbatch, microbatch_loss
from .config import (
    hierarchize,
    lora_spec,
    param_dtype,
    plan_tokens,
    replay_sequences,
    skips_zero_advantage,
    world_size,
    worker_device,
)
from ..learner.coordinator import call
from ..learner.fault_injection import injected
from ..recovery.labels import ACTIONS, split_label
from ..runtime.distributed import init_deepspeed_distributed


def _fault(point: str, rank: int, step: int) -> None:
    """``HILORE_FAULT=learner:<rank>:<step>`` (``faults.py``) kills that rank (a hard exit, as
    a crashed worker) when it starts that step's update."""
    if injected(point, rank, step):
        os._exit(17)


class Learner:
    def __init__(
        self,
        flat_cfg: Dict,
        rank: int,
        master_addr: str,
        master_port: int,
        coordinator=None,
        resume_dir: Optional[str] = None,
        progress=None,
    ):
        """``progress``: told of planning's phases and passes and of each update's microbatches
        (``progress.Reporter``: the driver shows them)."""
        cfg = self.cfg = hierarchize(flat_cfg)
        self.progress = progress
        self.rank, self.world = rank, world_size(cfg)
        self.skip = skips_zero_advantage(cfg)  # rows may be fewer than gas: the boundary is set per row
        self.oom_reruns, self._oom_injected = 0, False  # microbatches rerun all-R after running out of memory
        self._warmed_up = False  # B rebased after the first microbatch and optimizer step (a checkpoint keeps it)
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK="0",
        )
        from ..runtime.memory import default_allocator_settings

        default_allocator_settings()  # expandable segments unless the user chose; before CUDA starts
        self.device = worker_device()
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // self.world))
        init_deepspeed_distributed(self.device.type)
        from ..models.source import load_policy

        self.dtype = param_dtype(cfg)
        model, _ = load_policy(cfg.actor.model_name_or_path, dtype=self.dtype, lora=lora_spec(cfg), seed=cfg.train.seed)
        model.to(self.device)
        self.backend = cfg.actor.backend
        # the chunked head reads the head weight directly (not under ZeRO-3). Whether the logits are the head on the
        # decoder's output is checked here, on the bare model, on every path: the check fails on the DeepSpeed engine
        # (its ``config`` is DeepSpeed's dict), which would fall back to the full logits, so a resumed rank (no
        # planning pass on the bare model) peaked 1.7x above an uninterrupted one. The verdict is kept per head.
        self.chunked_head = self.backend == "hilore" and cfg.hilore.chunked_head and cfg.ds.zero_stage < 3
        if self.chunked_head:
            from ..models.chunked_head import head_is_linear

            self.chunked_head = head_is_linear(model)
        self.plan = self._plan(model, resume_dir)
        if self.backend == "gc":
            from ..recovery import apply_baseline

            apply_baseline(model, "gc")
        self.ds = self._deepspeed(model)
        self.plan.rebase(self._resident(for_budget=True))  # device scope: measured bytes replace the estimate
        self.budget = self.plan.budget
        self.rec = None
        if self.backend == "hilore":
            from ..learner.plan import make_engine

            self.rec = make_engine(self.ds, cfg.hilore)
        self.coordinator = coordinator
        if coordinator is not None:
            call(coordinator.register, rank, self.budget)
        self.rows: List[Dict] = []
        self.unskipped: List[Dict] = []
        torch.manual_seed(cfg.train.seed + 1000 * rank)

    # ---- setup ------------------------------------------------------------------------------
    def loss_fn(self, model, mb, entropy: bool = True):
        """The loss the rank trains and plans with; with the policy's entropy over the response
        tokens as a statistic (``actor/entropy``), so planning measures the bytes it takes too."""
        return microbatch_loss(model, mb, chunked_head=self.chunked_head, entropy=entropy)

    def loss_options(self) -> Dict:
        cfg = self.cfg
        low_high = cfg.actor.eps_clip_low_high or (cfg.actor.eps_clip, cfg.actor.eps_clip)
        return dict(
            clip_eps_low=low_high[0],
            clip_eps_high=low_high[1],
            dual_clip=cfg.actor.dual_clip,
            kl_coef=cfg.algo.kl.init_coef if cfg.algo.kl.use_loss else 0.0,
            kl_estimator=cfg.algo.kl.estimator,
            loss_agg_mode=cfg.actor.loss_agg_mode,
        )

    def _plan(self, model, resume_dir: Optional[str]):
        """B, and for hilore the validated plan, before DeepSpeed (``learner/plan.py``)."""
        from ..learner.plan import plan_before_wrapping, restore_rank_planner
        from ..learner.scope import estimate_resident
        from .checkpoint import read_state

        cfg = self.cfg
        saved = read_state(resume_dir)["ranks"] if resume_dir else []
        if self.rank < len(saved) and not self._replan(resume_dir):  # same budget and plan, no profiling
            mine = saved[self.rank]
            plan = restore_rank_planner(model, mine, cfg.hilore, self.loss_fn, self.backend, self._log)
            # what the rank kept across steps: a resumed rank goes on as the uninterrupted one would
            self._warmed_up = bool(mine["warmed_up"])
            if plan.planner is not None:
                plan.planner.load_online_state(mine["online"])
            return plan
        return plan_before_wrapping(
            # the driver sets --hilore.plan_tokens from the real prompts; --data.prompt_max_len bounds them
            model,
            cfg.hilore,
            backend=self.backend,
            tokens=plan_tokens(cfg, cfg.data.prompt_max_len),
            seqs_per_microbatch=cfg.train.micro_batch_size,
            group_size=cfg.rollout.n_samples_per_prompt,
            loss_options=self.loss_options(),
            loss_fn=self.loss_fn,
            std_loss_fn=microbatch_loss,
            device=self.device,
            seed=cfg.train.seed + 7,
            write_calibration=self.rank == 0,
            resident=estimate_resident(
                model, world=self.world, zero_stage=cfg.ds.zero_stage, mixed_precision=self.dtype != torch.float32
            ),
            # L's risk is calibrated on the first step's real rollouts (Learner.calibration_share); under
            # ZeRO-3 passes outside DeepSpeed's gradient path are not possible, so synthetic ones before it
            calibrate_later=cfg.ds.zero_stage < 3,
            progress=self.progress,
            log=self._log,
        )

    def _replan(self, resume_dir: str) -> bool:
        """Whether ``--resume`` changed a memory setting (``train/resume.py``; the driver said so): the
        saved budget and plan were made for the old value, so this rank plans anew as a fresh one."""
        from .config import flatten_ns
        from .resume import replan_flags

        return bool(replan_flags(resume_dir, flatten_ns(self.cfg)))

    def _rebase_after_warm_up(self) -> None:
        """Once, after the first microbatch and optimizer step: ZeRO-2/3 allocate their reduce
        buckets and gradient partitions in the first backward and AdamW its state in the first
        step, after B's resident bytes were measured; measure again and raise B if they grew."""
        if self._warmed_up:
            return
        self._warmed_up = True
        if self.plan.rebase(self._resident(for_budget=True)):
            self.budget = self.plan.budget
            if self.coordinator is not None:
                call(self.coordinator.register, self.rank, self.budget)

    @property
    def _zero3_engine(self) -> bool:
        return self.rec is not None and self.cfg.ds.zero_stage == 3 and self.world > 1

    def _agree(self, actions):
        """ZeRO-3: an R unit's replay gathers its weights with the other ranks, so every rank takes
        one action per unit (``lockstep.agree_actions``: R where they differ)."""
        from ..learner.lockstep import agree_actions

        return agree_actions(actions) if self._zero3_engine else actions

    def _all_r_somewhere(self, tokens: int) -> bool:
        """ZeRO-3: a rank whose plan stores nothing runs torch's layer checkpointing, not the
        engine, and joins neither ``agree_actions`` nor the engine's gathers: where one rank's plan
        is all R, every rank's is (the agreed actions would be all R anyway)."""
        if not self._zero3_engine or self.plan.planner is None:
            return False
        from ..learner.lockstep import agree_max
        from ..recovery.policies import stores_nothing

        return bool(agree_max([stores_nothing(self.plan.for_tokens(tokens).plan)], None, self.device)[0])

    def _resident(self, for_budget: bool = False) -> int:
        """What the rank holds between microbatches, when B's scope counts it (device);
        ``for_budget``: also ZeRO-3's persistent weights the next forward gathers for good."""
        if self.plan.scope != "device":
            return 0
        from ..learner.scope import resident_now

        ds = getattr(self, "ds", None)
        if ds is None:
            return 0
        return resident_now(self.device, ds.module, ds.optimizer, persistent_to_come=for_budget)

    def _log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def _deepspeed(self, model):
        import deepspeed
        import transformers

        cfg = self.cfg
        params = [p for p in model.parameters() if p.requires_grad]
        bucket = int(min(5e8, max(2**20, sum(p.numel() for p in params))))
        opt = torch.optim.AdamW(
            params, lr=cfg.actor.adam.lr, betas=tuple(cfg.actor.adam.betas), weight_decay=cfg.actor.adam.weight_decay
        )
        seqs = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        self.updates_per_step = seqs // cfg.train.batch_size  # fresh rollouts; replay adds up to replay_sequences
        self.gas = cfg.train.batch_size // (self.world * cfg.train.micro_batch_size)
        total = max(1, cfg.max_steps * (seqs + replay_sequences(cfg)) // cfg.train.batch_size)
        sched = transformers.get_scheduler(
            cfg.actor.lr_scheduler,
            opt,
            num_warmup_steps=int(cfg.actor.lr_warmup_ratio * total),
            num_training_steps=total,
        )
        ds_cfg = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": cfg.actor.max_norm,
            # ZeRO-2 allocates a reduce bucket of this many elements in every backward (DeepSpeed's
            # default, 5e8, is 2 GB in fp32): with LoRA the trainable parameters need far less
            "zero_optimization": {
                "stage": cfg.ds.zero_stage,
                "reduce_bucket_size": bucket,
                "allgather_bucket_size": bucket,
            },
            "bf16": {"enabled": self.dtype == torch.bfloat16},
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=ds_cfg)
        engine.train()
        return engine

    # ---- training ---------------------------------------------------------------------------
    @torch.no_grad()
    def set_batch(self, step: int, rows: List[Dict], unskipped: Optional[List[Dict]] = None) -> List[torch.Tensor]:
        """Keep this rank's rows of the step and add old log-probs (the behaviour policy; a
        replayed rollout keeps the ones it had when fresh, ``given_old_log_probs``); a row without
        reference log-probs (no reference worker: no KL term) takes its old ones in their place. Returns
        each row's old log-probs (on the CPU), which the replay buffer stores. ``unskipped``:
        this rank's rows before the skip, kept for ``compare_skip`` only."""
        from ..models.logprobs import sequence_log_probs

        self.ds.eval()
        for r in rows + (unskipped or []):
            old = sequence_log_probs(
                self.ds, r["input_ids"].to(self.device), position_ids=r["position_ids"].to(self.device)
            ).float()
            if "given_mask" in r:
                old = torch.where(r["given_mask"].to(self.device), r["given_old_log_probs"].to(self.device), old)
            r["old_log_probs"] = old
        for r in rows + (unskipped or []):  # no reference worker, or the skip: no KL term reads them
            r.setdefault("ref_log_probs", r["old_log_probs"])
        self.ds.train()
        self.rows, self.unskipped = rows, unskipped or []
        return [r["old_log_probs"].cpu() for r in rows]

    def _microbatch(self, r: Dict):
        return Microbatch(
            r["input_ids"],
            r["position_ids"],
            r["old_log_probs"],
            r["ref_log_probs"],
            r["advantages"],
            r["action_mask"],
            loss_options=dict(self.loss_options(), **r.get("loss_options", {})),  # a skip's kept denominator
        ).to(self.device)

    def _rows(self, u: int) -> List[Tuple[int, Dict]]:
        """Update ``u``'s rows with their index among the step's rows (the skip may leave fewer than gas)."""
        return [(i, r) for i, r in enumerate(self.rows) if r["update"] == u]

    def update(self, step: int, u: int) -> Dict:
        """One optimizer update over the step's rows tagged ``u`` (gas of them, or fewer after the
        zero-advantage skip); returns its metrics. ``loss`` and ``policy_loss`` are the sum of the
        rows' losses over gas, what DeepSpeed trains and the same with the skip or without it (a
        skipped response adds 0); the other statistics are means over the trained rows."""
        from ..learner.microbatch_run import report

        _fault("learner", self.rank, step)
        rows = self._rows(u)
        stats: Dict[str, List[float]] = {}
        counts = dict.fromkeys(ACTIONS, 0)
        by_kind = {
            "fresh": dict.fromkeys(ACTIONS, 0),
            "replay": dict.fromkeys(ACTIONS, 0),
        }  # rows with replayed rollouts
        clip = {"fresh": [], "replay": []}
        peaks, t0, tokens, done = [], time.perf_counter(), 0, []
        for j, (i, r) in enumerate(rows):
            if self.progress is not None:
                self.progress.phase(f"update {u + 1}, microbatch", j + 1, len(rows), t0)
            mb = self._microbatch(r)
            if self.skip:  # the update's last row is its boundary, however many the skip left
                self.ds.set_gradient_accumulation_boundary(j == len(rows) - 1)
            out, rec = self._forward_backward(mb, step, i)
            self.ds.step()
            peaks.append(rec.scope_peak)
            done.append(self._microbatch_record(u, i, r, rec))
            report(self.plan, self.coordinator, self.rank, step, i, rec)
            self._rebase_after_warm_up()
            if r.get("pad"):  # a pad row trains nothing: its statistics would be the skipped response's
                continue
            tokens += mb.num_tokens
            kind = "replay" if r.get("replayed") else "fresh"
            for a, n in rec.counts.items():
                counts[a] += n
                by_kind[kind][a] += n
            clip[kind].append(float(out.stats.get("clip_fraction", float("nan"))))
            for k, v in dict(out.stats, loss=out.loss.detach()).items():
                stats.setdefault(k, []).append(float(v))
        seconds = time.perf_counter() - t0
        grad_norm = self.ds.get_global_grad_norm()
        total = sum(counts.values())  # 0: this rank ran only pad rows
        for k in SUMMED:  # ... whose losses are 0, as the skipped responses' are
            stats.setdefault(k, [])
        # DeepSpeed's ZeRO optimizer skips a step whose all-reduced gradient norm is not finite
        # (fp32, and bf16 with its check_grad_overflow), on every rank alike
        reruns, self.oom_reruns = self.oom_reruns, 0
        return {
            "rank": self.rank,
            "update_seconds": seconds,
            "tokens": tokens,
            "skipped": not self.ds.was_step_applied(),
            "oom_reruns": reruns,
            **{k: math.fsum(v) / self.gas if k in SUMMED else statistics.fmean(v) for k, v in stats.items()},
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "peak_bytes": max(peaks),
            "peak_over_budget": max(peaks) / self.budget,
            **{f"fraction_{a}": counts[a] / total if total else None for a in ACTIONS},
            **_split(by_kind, clip),
            "lr": self.ds.get_lr()[0],
            "microbatches": [dict(d, peak_over_budget=d["peak_bytes"] / self.budget) for d in done],  # B as above
        }

    def _microbatch_record(self, u: int, index: int, row: Dict, rec) -> Dict:
        """One microbatch as the run folder's ``actions.jsonl`` keeps it (``metrics.step_actions``):
        each unit's action, one letter per unit in ``info()["units"]``' order (empty without a
        recovery engine), whether it was a pad row of the zero-advantage skip, and its peak in B's scope."""
        units = self.rec.unit_names if self.rec is not None else []
        return {
            "update": u,
            "microbatch": index,
            "actions": "".join(split_label(rec.actions[n])[0] if n in rec.actions else "-" for n in units),
            "skipped": bool(row.get("pad")),
            "replayed": bool(row.get("replayed")),
            "tokens": int(rec.tokens),
            "peak_bytes": int(rec.scope_peak),
        }

    def _forward_backward(self, mb, step: int, index: int):
        """One microbatch under the plan. Out of memory before its backward (nothing reduced or
        accumulated yet): free it, tighten the plan, tell the coordinator, rerun it all-R with
        the same random state (LoRA dropout draws the same masks). Out of memory in the
        backward, or under ZeRO-3 (whose forward gathers parameters with the other ranks), is
        not recoverable: the error names it."""
        from ..allocation.runner import token_scores
        from ..learner.microbatch_run import out_of_memory, run_microbatch

        rng = torch.random.get_rng_state(), (torch.cuda.get_rng_state() if self.device.type == "cuda" else None)
        stage = "forward"
        try:
            with run_microbatch(
                self.plan,
                self.rec,
                self.device,
                mb.num_tokens,
                self._resident(),
                all_r=self._all_r_somewhere(mb.num_tokens),
                token_scores=token_scores(mb),
            ) as rec:
                out = self.loss_fn(self.ds, mb)
                if injected("oom", self.rank, step) and index == 0 and not self._oom_injected:
                    self._oom_injected = True
                    raise torch.OutOfMemoryError("injected by HILORE_FAULT")
                rec.set_actions(self.plan, out, agree=self._agree)
                if index == 0 and injected("nonfinite", self.rank, step):
                    out.loss = out.loss * float("nan")
                stage = "backward"
                self.ds.backward(out.loss)
            return out, rec
        except torch.OutOfMemoryError as e:
            if stage == "backward" or self.cfg.ds.zero_stage >= 3:
                raise RuntimeError(
                    f"rank {self.rank} ran out of memory in the {stage} of step {step + 1}'s microbatch "
                    f"{index} ({e}); lower --hilore.budget or the microbatch size"
                ) from None
            message = str(e).splitlines()[0] if str(e) else "out of memory"
        out = rec = None  # what the failed forward held goes now
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        by = out_of_memory(self.plan, self.coordinator, self.rank, step, index, mb.num_tokens)
        print(
            f"[learner {self.rank}] out of memory in step {step + 1}'s microbatch {index} ({message}): rerun all-R, "
            f"plan {by / 2**20:.1f} MiB smaller",
            flush=True,
        )
        self.oom_reruns += 1
        torch.random.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])
        with run_microbatch(self.plan, self.rec, self.device, mb.num_tokens, self._resident(), all_r=True) as rec:
            out = self.loss_fn(self.ds, mb)
            self.ds.backward(out.loss)
        return out, rec

    # ---- calibration on real rollouts -------------------------------------------------------
    @contextlib.contextmanager
    def _side_runner(self):
        """A runner on the DeepSpeed module outside DeepSpeed's gradient path: gradients go
        straight into ``.grad`` (``torch.autograd.grad``) and are cleared afterwards, so no
        planning pass leaves gradients for the next real update."""
        from ..allocation import Runner

        module = self.ds.module
        params = [p for p in module.parameters() if p.requires_grad]

        def backward(loss):
            for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True)):
                p.grad = g

        runner = Runner(module, self.rec, loss_fn=self.loss_fn, backward=backward)
        runner.progress = self.progress
        try:
            yield runner
        finally:
            for p in params:
                p.grad = None

    def calibration_share(self, n: int) -> Optional[Dict]:
        """This rank's share of the job's calibration (Eq. 10): single-unit L interventions on
        up to ``n`` of its microbatches of the current step; the driver pools every rank's
        samples (``allocation.calibration.merge``). None when the plan needs no calibration."""
        from dataclasses import asdict

        from ..allocation.calibration import calibrate_levels
        from ..recovery.labels import codec_levels

        if not self.plan.calibration_pending or self.rec is None:
            return None
        mbs = [self._microbatch(r) for r in self.rows if not r.get("pad")][:n]  # a pad trains nothing
        if not mbs:  # the skip left this rank only pads: the other ranks' samples serve
            return None
        t = time.perf_counter()
        with self._side_runner() as runner:
            with runner.phase("calibration"):
                cal = calibrate_levels(runner, mbs, codec_levels(self.cfg.hilore.codec)[1], room=self.plan.planner.room)
        self._log(
            f"[hilore] rank {self.rank}: calibrated on {len(mbs)} real microbatches in {time.perf_counter() - t:.0f}s"
        )
        return {a: asdict(c) for a, c in cal.items()}

    def adopt_calibration(self, cal: Dict) -> Dict:
        """Switch from H/R to the wanted mode with the job's calibration (``{level: fields}``;
        re-fit and validate the plan on the planning microbatch, outside DeepSpeed's gradient
        path); returns ``info``."""
        from ..allocation.calibration import Calibration
        from ..learner.plan import planning_microbatches

        cfg = self.cfg
        dev = planning_microbatches(
            self.ds.module,
            1,
            tokens=self.plan.info["plan_tokens"],
            seqs_per_microbatch=cfg.train.micro_batch_size,
            group_size=cfg.rollout.n_samples_per_prompt,
            seed=cfg.train.seed + 7,
            loss_options=self.loss_options(),
            device=self.device,
        )[0]
        with self._side_runner() as runner:
            self.plan.adopt_calibration({a: Calibration(**v) for a, v in cal.items()}, runner, dev, cfg.hilore)
        return self.info()

    def gradient_error(self, u: int) -> Optional[Dict[str, float]]:
        """Before update ``u``: its gradient under the plan against the exact one on the same
        microbatches (``learner/gradient_check.py``); None without a recovery engine."""
        from ..learner.gradient_check import update_gradient_error

        if self.rec is None:
            return None
        mbs = [self._microbatch(r) for _, r in self._rows(u) if not r.get("pad")]  # a pad's gradient is 0
        if not mbs:
            return None
        return update_gradient_error(self.plan, self.rec, self.ds.module, self.loss_fn, mbs, self.device)

    def compare(self, repeats: int = 1) -> Dict[str, float]:
        """Time gc and this rank's backend on the step's microbatches, interleaved, outside the
        optimizer's gradient path (``torch.autograd.grad``; no step). Seconds per update."""
        from ..allocation import Runner

        module = self.ds.module
        params = [p for p in module.parameters() if p.requires_grad]
        back = lambda loss: torch.autograd.grad(loss, params)  # noqa: E731
        gc = Runner(module, self.rec or _NoEngine(), loss_fn=microbatch_loss, backward=back)
        # the backend's loss without the logged entropy, as gc's: the timing compares backends
        ours = Runner(module, self.rec or _NoEngine(), loss_fn=partial(self.loss_fn, entropy=False), backward=back)
        mbs = [self._microbatch(r) for _, r in self._rows(0)]
        times = {"gc": [], self.backend: []}  # one entry when the backend is gc
        for _ in range(repeats):
            for name in times:
                times[name].append(
                    sum(gc.run(mb, "gc").seconds if name == "gc" else self._timed_run(ours, mb) for mb in mbs)
                )
        return {f"compare_{k}_seconds": statistics.median(v) for k, v in times.items()}

    def compare_skip(self, repeats: int) -> Dict[str, List[float]]:
        """Time the step's first update on this rank with every response (``all``), with the
        skip's rows (``skip``) and with every response again (``all_again``: the A/A floor),
        ``repeats`` times interleaved, outside the optimizer's gradient path (no step), under
        the backend's plan. Seconds per repeat."""
        from ..allocation import Runner

        module = self.ds.module
        params = [p for p in module.parameters() if p.requires_grad]
        back = lambda loss: torch.autograd.grad(loss, params)  # noqa: E731
        runner = Runner(module, self.rec or _NoEngine(), loss_fn=partial(self.loss_fn, entropy=False), backward=back)
        sets = {
            "all": [self._microbatch(r) for r in self.unskipped if r["update"] == 0],
            "skip": [self._microbatch(r) for _, r in self._rows(0)],
        }
        times: Dict[str, List[float]] = {"all": [], "skip": [], "all_again": []}
        for _ in range(repeats):
            for name in times:
                times[name].append(sum(self._timed_run(runner, mb) for mb in sets[name.replace("_again", "")]))
        return times

    def _timed_run(self, runner, mb) -> float:
        """One forward and backward of ``mb`` as the backend trains it (none: the model as it is,
        everything stored); seconds."""
        if self.backend == "gc":
            return runner.run(mb, "gc").seconds
        if self.backend == "hilore":
            sp = self.plan.for_tokens(mb.num_tokens)
            return runner.run(
                mb, sp.plan, partial(self.plan.actions, sp=sp), track_tokens=self.plan.track_tokens
            ).seconds
        return runner.run(mb, "as-is").seconds

    # ---- weights and checkpoints -------------------------------------------------------------
    def export_weights(self, kind: str) -> Optional[Dict[str, torch.Tensor]]:
        """Every rank must call this: under ZeRO-3 each module's parameters are gathered in turn
        (a collective), never the whole model; rank 0 returns the weights."""
        from ..models.weights import export_weights, zero3_gather

        gather = zero3_gather if self.cfg.ds.zero_stage == 3 else None
        return export_weights(self.ds.module, kind, gather=gather, keep=self.rank == 0)

    def adapter_config(self) -> Dict:
        """The LoRA adapter's PEFT config (JSON types), what a vLLM engine serving it reads."""
        from .vllm_sync import adapter_config

        return adapter_config(self.ds.module)

    def save(self, path: str) -> None:
        """DeepSpeed's checkpoint (model, optimizer, scheduler) + this rank's RNG, plan and the state
        it keeps across steps (the warm-up's rebase done, the online chooser's refresh count)."""
        from .checkpoint import rank_file, versioned

        p = Path(path)
        self.ds.save_checkpoint(str(p), tag="ds", save_latest=False)
        torch.save(
            {
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            },
            p / f"rng_rank{self.rank}.pt",
        )
        state = dict(self.plan.state(), warmed_up=self._warmed_up)
        state["online"] = self.plan.planner.online_state() if self.plan.planner is not None else None
        rank_file(p, self.rank).write_text(json.dumps(versioned(state)))

    def load(self, path: str) -> None:
        p = Path(path)
        load_path, _ = self.ds.load_checkpoint(str(p), tag="ds")
        if load_path is None:
            raise FileNotFoundError(f"{p}: no DeepSpeed checkpoint for rank {self.rank}")
        rng = torch.load(p / f"rng_rank{self.rank}.pt", weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])

    def save_hf(self, path: str) -> Optional[str]:
        """Final weights in HF format: the LoRA adapter (peft) or the full model (rank 0 writes)."""
        w = self.export_weights("adapter" if hasattr(self.ds.module, "peft_config") else "full")
        if self.rank == 0:
            self.ds.module.save_pretrained(path, state_dict=w)
            return path
        return None

    def info(self) -> Dict:
        from .placement import node_id

        return dict(
            self.plan.info,
            rank=self.rank,
            gas=self.gas,
            updates_per_step=self.updates_per_step,
            node_id=node_id(),
            units=self.rec.unit_names if self.rec is not None else [],  # in layer order: actions.jsonl's rows
        )


def _split(by_kind: Dict[str, Dict[str, int]], clip: Dict[str, List[float]]) -> Dict:
    """Per kind of microbatch (rows with replayed rollouts, rows with fresh ones only): the
    H/L/P/R split of its unit actions and its mean clip fraction; kinds with no row are absent."""
    out = {}
    for kind, counts in by_kind.items():
        n = sum(counts.values())
        if n:
            out.update({f"{kind}_fraction_{a}": counts[a] / n for a in ACTIONS})
        if clip[kind]:
            out[f"{kind}_clip_fraction"] = statistics.fmean(clip[kind])
        out[f"{kind}_rows"] = len(clip[kind])
    return out


SUMMED = ("loss", "policy_loss")  # per update: the rows' sum over gas (a skipped row's loss is 0)


class _NoEngine:
    """Stands in for a recovery engine where a backend has none (Runner needs ``engine``)."""

    unit_names: List[str] = []
