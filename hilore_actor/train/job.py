"""The Ray actors of one training run and the calls the recipe (``train_grpo.py``) makes on them:
learner ranks (placed by ``placement.py``), rollout workers (restarted by Ray when they die),
the reference worker (only where the loss reads it: ``config.uses_reference``) and the budget
coordinator (restarted too, ``learner/coordinator.py``). Each actor is named after its role
(``actor_names``), so Ray itself lists what the job started."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import torch

from .config import flatten_ns, skips_zero_advantage, uses_reference, world_size
from .errors import JobError

ACTOR_PREFIX = "hilore-"  # the job's actors are named hilore-learner-0, hilore-rollout-0, hilore-reference ...

# environment the workers need to see (Ray workers do not inherit the driver's environment)
PASS_ENV = (
    "HILORE_FAULT",
    "HILORE_CACHE",
    "DS_ACCELERATOR",
    "TORCH_EXTENSIONS_DIR",
    "GLIBC_TUNABLES",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)


class Job:
    """The Ray actors of one run and the calls the recipe makes on them."""

    def __init__(self, cfg, resume_dir: Optional[str], checkpoints: str, local_ray: bool = False):
        """``local_ray``: Ray is the instance this process started (one node: no placement tasks)."""
        import ray

        from ..learner.coordinator import BudgetCoordinator
        from .learner import Learner
        from .placement import check_shared, learner_placement
        from .progress import Progress
        from .workers import HFRolloutWorker, ReferenceWorker, VLLMRolloutWorker

        self.ray, self.cfg = ray, cfg
        self.progress = Progress(ray)  # what the workers are doing, shown while the driver waits
        flat = flatten_ns(cfg)
        cuda = torch.cuda.is_available()
        env = {"runtime_env": {"env_vars": {k: os.environ[k] for k in PASS_ENV if k in os.environ}}}
        # Ray restarts a dead coordinator, which reloads the last checkpoint's state (coordinator.py)
        self.coordinator = (
            ray.remote(BudgetCoordinator)
            .options(name=ACTOR_PREFIX + "coordinator", num_cpus=0, max_restarts=3, **env)
            .remote(checkpoints=checkpoints, resume_from=resume_dir)
        )
        try:  # ranks placed (one bundle each), checkpoint storage checked, then the learners start
            self.pg, place, addr, port = learner_placement(ray, world_size(cfg), cfg.actor.num_nodes, cuda, local_ray)
            if not local_ray:
                check_shared(ray, place, checkpoints, **env)
        except RuntimeError as e:
            raise JobError(str(e)) from None
        self.learners = [
            ray.remote(Learner)
            .options(name=f"{ACTOR_PREFIX}learner-{r}", **place[r], **env)
            .remote(flat, r, addr, port, self.coordinator, resume_dir, self.progress.reporter(f"learner-{r}"))
            for r in range(world_size(cfg))
        ]
        ropts = dict(num_cpus=0, max_restarts=cfg.rollout.max_restarts, **env)  # a dead worker comes back (generate)
        if cfg.vllm.num_engines > 0:
            if not cuda:
                raise JobError(
                    "--vllm.num_engines > 0 needs CUDA; on CPU use HF generate workers (--vllm.num_engines 0)"
                )
            self.rollout = [
                ray.remote(VLLMRolloutWorker)
                .options(name=f"{ACTOR_PREFIX}rollout-{i}", num_gpus=cfg.vllm.tensor_parallel_size, **ropts)
                .remote(flat, i)
                for i in range(cfg.vllm.num_engines)
            ]
        else:
            self.rollout = [
                ray.remote(HFRolloutWorker)
                .options(name=f"{ACTOR_PREFIX}rollout-{i}", num_gpus=cfg.rollout.num_gpus if cuda else 0, **ropts)
                .remote(flat, i)
                for i in range(cfg.rollout.num_workers)
            ]
        self.ref = (  # None: nothing reads reference log-probs (the learners take their own old ones)
            ray.remote(ReferenceWorker)
            .options(name=ACTOR_PREFIX + "reference", num_cpus=0, num_gpus=cfg.ref.num_gpus if cuda else 0, **env)
            .remote(flat)
            if uses_reference(cfg)
            else None
        )
        self.infos = self.progress.get([l.info.remote() for l in self.learners], "plan", after=0)  # planning
        self.weight_kind, self.adapter_config, self.weight_dtype = self.sync_form()
        self.sync_bytes = 0  # what each rollout worker received at the last sync

    def get(self, refs):
        return self.ray.get(refs)

    def actor_names(self) -> List[str]:
        """The job's actors as Ray lists them (its named actors in this job's namespace), sorted."""
        from ray.util import list_named_actors

        return sorted(n for n in list_named_actors() if n.startswith(ACTOR_PREFIX))

    @property
    def calibration_pending(self) -> bool:
        return any(i.get("calibration") == "pending" for i in self.infos)

    def calibrate(self) -> None:
        """L's risk, once for the job, on this step's real rollout microbatches: every rank
        runs the interventions on its share of ``--hilore.calibration_batches`` of them, the
        samples are pooled into one calibration, and every rank re-plans with it (the
        checkpoint keeps it; ``--hilore.calibration PATH`` saves it too)."""
        from dataclasses import asdict

        from ..allocation.calibration import Calibration, merge, save_levels

        t = time.perf_counter()
        share = -(-self.cfg.hilore.calibration_batches // len(self.learners))
        parts = [
            p for p in self.progress.get([l.calibration_share.remote(share) for l in self.learners], "calibrate") if p
        ]
        if not parts and skips_zero_advantage(self.cfg):  # every rank ran only pad rows: the next step calibrates
            print("[train] L's calibration waits for a step with trained responses", flush=True)
            return
        if not any(p[a]["samples"] for p in parts for a in p):
            raise JobError("L's calibration found no microbatch on any learner rank")
        cal = {a: merge([Calibration(**p[a]) for p in parts]) for a in parts[0]}  # per L level, every rank's samples
        if self.cfg.hilore.calibration:
            save_levels(cal, self.cfg.hilore.calibration)
        self.infos = self.progress.get(  # the re-plan: fit candidates and validation, minutes on a real model
            [l.adopt_calibration.remote({a: asdict(c) for a, c in cal.items()}) for l in self.learners], "plan"
        )
        n = len({s["batch"] for s in next(iter(cal.values())).samples})
        print(
            f"[train] calibrated L's risk on {n} real microbatches in {time.perf_counter() - t:.0f}s; "
            f"plan {self.infos[0].get('plan')}",
            flush=True,
        )
        if self.infos[0].get("plan_why"):
            print(f"[train] rank 0's plan: {self.infos[0]['plan_why']}", flush=True)

    def close(self) -> None:
        """Stop every actor now, however the run ends. Dropped handles let them exit one by one
        after the driver: seconds of CPU, on a small machine, that the next command pays for."""
        import contextlib

        for actor in [a for a in (*self.learners, *self.rollout, self.ref, self.coordinator) if a is not None]:
            with contextlib.suppress(Exception):  # teardown: never in place of the error that ended the run
                self.ray.kill(actor, no_restart=True)

    def sync_form(self):
        """``(weight kind, adapter config, dtype)`` of the weight sync, asked once: the kind the
        rollout workers take; under LoRA to a vLLM engine ("adapter") also the learner's PEFT
        config and the engine's dtype, in which the adapter is sent (``vllm_sync.cast_floats``)."""
        kind = self.get(self.rollout[0].weight_kind.remote())
        if kind != "adapter":
            return kind, None, None
        return kind, self.get(self.learners[0].adapter_config.remote()), self.get(self.rollout[0].weight_dtype.remote())

    def sync_weights(self) -> int:
        """The learners' weights into every rollout worker, in the form they take (``weight_kind``:
        the adapter, merged or full weights); ``sync_bytes``: the bytes each worker received."""
        from .vllm_sync import cast_floats

        w = self.get([l.export_weights.remote(self.weight_kind) for l in self.learners])[0]
        if self.weight_kind == "adapter":
            w = cast_floats(w, self.weight_dtype)
        ref = self.ray.put(w)
        self.sync_bytes = max(self.get([r.load_weights.remote(ref, self.adapter_config) for r in self.rollout]))
        return self.sync_bytes

    def generate(self, prompts: List[str], step: int, greedy: bool = False) -> Dict:
        """The step's rollouts. A rollout worker that dies is restarted by Ray (up to
        ``--rollout.max_restarts`` times); the restarted workers get the current weights and the
        step's rollouts are redone with the same seeds, so the step runs once, as it would have.
        ``greedy``: one argmax response per prompt (held-out evaluation, ``evaluation.py``)."""
        from ray.exceptions import RayActorError

        from ..learner.coordinator import call

        for attempt in range(self.cfg.rollout.max_restarts):
            try:
                return self._generate(prompts, step, greedy)
            except RayActorError as e:
                print(
                    f"[train] a rollout worker died in step {step + 1} ({type(e).__name__}); Ray restarts it "
                    f"(restart {attempt + 1} of at most {self.cfg.rollout.max_restarts}); redoing the step's rollouts",
                    flush=True,
                )
                for w in self.rollout:  # each answers once Ray has restarted it (call waits while it restarts)
                    call(w.weight_kind)
                self.sync_weights()
        # restarts used up: a death now ends the job (train_grpo._worker_failure)
        return self._generate(prompts, step, greedy)

    def _generate(self, prompts: List[str], step: int, greedy: bool = False) -> Dict:
        k = len(self.rollout)
        chunks = [prompts[i * len(prompts) // k : (i + 1) * len(prompts) // k] for i in range(k)]
        outs = self.progress.get(
            [
                w.generate.remote(
                    c,
                    self.cfg.train.seed * 100003 + step * 101 + i,
                    step,
                    greedy,
                    self.progress.reporter(f"rollout-{i}"),
                )
                for i, (w, c) in enumerate(zip(self.rollout, chunks))
                if c
            ],
            "rollout",
        )
        seqs, texts = [], []
        for o in outs:
            for i in range(len(o["texts"])):
                n = o["prompt_lens"][i] + o["response_lens"][i]
                seqs.append([o["sequences"][i, :n], o["prompt_lens"][i], o["response_lens"][i]])
                texts.append(o["texts"][i])
        return {"seqs": seqs, "texts": texts}
