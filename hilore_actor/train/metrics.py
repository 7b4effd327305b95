"""Per-step metrics: one JSON object per line in ``<save_path>/metrics.jsonl``; the same scalars
in TensorBoard and, with ``--use_wandb``, in Weights & Biases, both under the names ``tag`` gives
(grouped by area: ``reward/mean``, ``actor/entropy``, ``memory/peak_over_budget/0`` ...); a few
sample generations per step in ``samples.jsonl`` (and TensorBoard text, a W&B table); and a
one-line summary for the progress bar. wandb is imported only when it is on."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .config import flatten_ns
from .errors import JobError
from .run_dir import ACTIONS_FILE, METRICS_FILE, PICTURES_DIR, SAMPLES_FILE

# metrics.jsonl key -> TensorBoard / W&B name; nested keys keep their tail (peak_over_budget/0)
TAGS = {
    "reward_mean": "reward/mean",
    "reward_std": "reward/std",
    "reward_min": "reward/min",
    "reward_max": "reward/max",
    "accuracy": "reward/accuracy",
    "response_length": "rollout/response_length",
    "response_length_max": "rollout/response_length_max",
    "loss": "actor/loss",
    "policy_loss": "actor/policy_loss",
    "kl": "actor/kl",
    "entropy": "actor/entropy",
    "clip_fraction": "actor/clip_fraction",
    "grad_norm": "actor/grad_norm",
    "lr": "actor/lr",
    "skipped_updates": "actor/skipped_updates",
    "fresh_clip_fraction": "actor/fresh_clip_fraction",
    "replay_clip_fraction": "actor/replay_clip_fraction",
    "update_seconds": "perf/update_seconds",
    "rollout_seconds": "perf/rollout_seconds",
    "ref_seconds": "perf/ref_seconds",
    "tokens_per_second": "perf/tokens_per_second",
    "peak_over_budget": "memory/peak_over_budget",
    "peak_over_budget_max": "memory/peak_over_budget_max",
    "plan_peak_over_budget": "memory/plan_peak_over_budget",
    "oom_reruns": "memory/oom_reruns",
    "coordinator": "coordinator",
    "coordinator_restarts": "coordinator/restarts",
    "replayed": "replay/replayed",
    "replay_microbatches": "hilore/replay_microbatches",
    "zero_adv_share": "rollout/zero_adv_share",
    "zero_adv_token_share": "rollout/zero_adv_token_share",
    "zero_adv_skip": "hilore/zero_adv_skip",
    "pad_microbatches": "hilore/pad_microbatches",
}
# then by prefix, first match wins (longer prefixes first)
PREFIX_TAGS = (
    ("eval_", "eval/"),
    ("compare_", "perf/compare_"),
    ("grad_", "hilore/grad_"),
    ("fraction_", "hilore/fraction_"),
    ("fresh_", "hilore/fresh_"),
    ("replay_fraction_", "hilore/replay_fraction_"),
    ("replay_", "replay/"),
)
PREFIX_TAGS = tuple(sorted(PREFIX_TAGS, key=lambda p: -len(p[0])))
SAMPLES_TAG = "rollout/samples"  # sample generations: TensorBoard text, a W&B table
# each step's pictures (``report/pictures.py``): file name -> TensorBoard / W&B image name
PICTURES = {"actions": "hilore/actions", "peaks": "memory/peak_over_budget_per_microbatch"}


def tag(key: str) -> str:
    """The TensorBoard and W&B name of a metrics.jsonl key (nested keys joined by ``/``): one
    mapping for both writers, so they hold the same scalars under the same names. A key no
    area claims goes under ``train/``."""
    head, sep, rest = key.partition("/")
    name = TAGS.get(head)
    if name is None:
        name = next((to + head[len(pre) :] for pre, to in PREFIX_TAGS if head.startswith(pre)), "train/" + head)
    return name + sep + rest


def scalars(metrics: Dict) -> Dict[str, float]:
    """``{tag: value}``: every finite number of a step's metrics, nested dicts flattened."""
    return {tag(k): v for k, v in _scalars(metrics).items()}


def rollout_metrics(rewards: Sequence[float], response_lengths: Sequence[int]) -> Dict[str, float]:
    """The spread of a step's rewards (population std: 0 for one response) and its longest
    response, beside ``reward_mean`` and ``response_length`` (the mean)."""
    r = [float(x) for x in rewards]
    mean = sum(r) / len(r)
    return {
        "reward_std": math.sqrt(sum((x - mean) ** 2 for x in r) / len(r)),
        "reward_min": min(r),
        "reward_max": max(r),
        "response_length_max": max(response_lengths),
    }


def step_actions(per_update: Sequence[Sequence[Dict]], units: Sequence[str]) -> Dict:
    """A step's line of ``actions.jsonl`` (its ``step`` added by ``MetricsLog.log``): ``units``, the
    recovery units in layer order, and per rank its microbatches in the order they ran, each with
    ``actions`` (one letter per unit: H, P, L or R; empty without a recovery engine), ``skipped``
    (a pad row of the zero-advantage skip), ``replayed``, ``update``, ``microbatch``, ``tokens``,
    ``peak_bytes`` and ``peak_over_budget`` (``Learner.update``'s ``microbatches``)."""
    ranks: Dict[str, List[Dict]] = {}
    for upd in per_update:
        for r in upd:
            ranks.setdefault(str(r["rank"]), []).extend(r.get("microbatches", []))
    return {"units": list(units), "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))}


def learner_means(rows: Sequence[Dict], keys: Sequence[str]) -> Dict[str, float]:
    """Means over ranks of statistics a learner may not report (then the key is absent)."""
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def pick_samples(
    examples, texts: Sequence[str], rewards: Sequence[float], group_size: int, k: int, split: str = "train"
) -> List[Dict]:
    """``k`` generations to read beside the curves: the first response to each of the first
    ``k`` prompts (then the second responses, when there are fewer prompts)."""
    n = len(texts)
    order = [p * group_size + j for j in range(group_size) for p in range(n // group_size)]
    return [
        {
            "split": split,
            "prompt": examples[i // group_size].prompt,
            "response": texts[i],
            "reward": float(rewards[i]),
            "answer": examples[i // group_size].answer,
        }
        for i in order[: max(k, 0)]
    ]


def _prompt_text(prompt) -> str:
    if isinstance(prompt, list):  # chat messages
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
    return str(prompt)


def _keep_until(path: Path, resume_step: Optional[int]) -> None:
    """On resume keep the rows of the steps the checkpoint covers (later ones are recomputed);
    on a fresh start remove the file."""
    if resume_step is not None and path.is_file():
        kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= resume_step]
        path.write_text("".join(ln + "\n" for ln in kept))
    elif path.exists():
        path.unlink()


def _trim_events(folder: Path, resume_step: Optional[int]) -> None:
    """On resume, TensorBoard's event files keep only the events of the steps the checkpoint
    covers, as ``_keep_until`` does for the JSONL files: a run that logged steps past its last
    checkpoint would otherwise hold those steps twice (any reader, not only TensorBoard's
    purge, sees each step once). A torn last record (a crash mid-write) is dropped."""
    if resume_step is None or not folder.is_dir():
        return
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    for path in sorted(folder.glob("events.out.tfevents.*")):
        kept, dropped = [], 0
        try:
            for raw in RawEventFileLoader(str(path)).Load():
                if Event.FromString(raw).step <= resume_step:
                    kept.append(raw)
                else:
                    dropped += 1
        except Exception:  # noqa: BLE001  a torn record ends the file: what came before it stays
            dropped += 1
        if not dropped:
            continue
        tmp = path.with_name(path.name + ".trim")
        with tmp.open("wb") as f:
            writer = RecordWriter(f)
            for raw in kept:
                writer.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def _keep_pictures(folder: Path, resume_step: Optional[int]) -> None:
    """The step pictures as ``_keep_until`` keeps the rows: on resume those of the covered steps."""
    for f in folder.glob("step_*.png") if folder.is_dir() else ():
        if resume_step is None or int(f.name.split("_")[1]) > resume_step:
            f.unlink()


def _append(path: Path, rows: Sequence[Dict]) -> None:
    with path.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


class MetricsLog:
    def __init__(
        self,
        save_path,
        tensorboard_dir: Optional[str] = None,
        resume_step: Optional[int] = None,
        wandb: Optional[Dict] = None,
    ):
        self.path = Path(save_path) / METRICS_FILE
        self.samples_path = Path(save_path) / SAMPLES_FILE
        self.actions_path = Path(save_path) / ACTIONS_FILE
        self.pictures = Path(save_path) / PICTURES_DIR
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for path in (self.path, self.samples_path, self.actions_path):
            _keep_until(path, resume_step)
        _keep_pictures(self.pictures, resume_step)
        self.tb_dir = tensorboard_dir or str(Path(save_path) / "tensorboard")
        _trim_events(Path(self.tb_dir), resume_step)
        self._purge_step = None if resume_step is None else resume_step + 1  # TensorBoard's own restart marker
        self._tb = None
        self._wandb = _start_wandb(wandb) if wandb else None

    def _writer(self):
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                self._tb = False
            else:
                self._tb = SummaryWriter(self.tb_dir, purge_step=self._purge_step)
        return self._tb or None

    def log(self, step: int, metrics: Dict, samples: Sequence[Dict] = (), actions: Optional[Dict] = None) -> None:
        """The step's row, its scalars (TensorBoard, W&B) and its sample generations; ``actions``
        (``step_actions``): its line of ``actions.jsonl`` and its pictures (the run folder's
        ``pictures/``, TensorBoard and W&B images)."""
        _append(self.path, [dict(step=step, **metrics)])
        if samples:
            _append(self.samples_path, [dict(step=step, **s) for s in samples])
        pictures = {}
        if actions is not None:
            _append(self.actions_path, [dict(step=step, **actions)])
            pictures = self._pictures(step, actions)
        values = scalars(metrics)
        tb = self._writer()
        if tb is not None:
            for k, v in values.items():
                tb.add_scalar(k, v, step)
            if samples:
                tb.add_text(SAMPLES_TAG, _markdown(samples), step)
            for name, path in pictures.items():
                tb.add_image(PICTURES[name], _rgb(path), step, dataformats="HWC")
            tb.flush()
        if self._wandb is not None:
            if samples:  # this step's rows (a table per step keeps the run's size linear in steps)
                cols = ["split", "prompt", "response", "reward", "answer"]
                rows = [[_prompt_text(s[c]) if c == "prompt" else s[c] for c in cols] for s in samples]
                values = dict(values, **{SAMPLES_TAG: self._wandb.Table(columns=cols, data=rows)})
            values.update({PICTURES[name]: self._wandb.Image(str(path)) for name, path in pictures.items()})
            self._wandb.log(values, step=step)

    def _pictures(self, step: int, actions: Dict) -> Dict[str, Path]:
        """The step's heatmap of actions (none without a recovery engine) and its peaks against B, as
        PNG files in ``pictures/`` (``{name: path}``)."""
        from ..report.pictures import png, step_heatmap, step_peaks

        figs = {"actions": step_heatmap(actions, step), "peaks": step_peaks(actions, step)}
        return {k: png(f, self.pictures / f"step_{step:06d}_{k}.png") for k, f in figs.items() if f is not None}

    def close(self) -> None:
        if self._tb:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _rgb(path: Path):
    """A PNG file as an ``[H, W, 3]`` uint8 array, as TensorBoard's ``add_image`` takes it."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _markdown(samples: Sequence[Dict]) -> str:
    """Samples as TensorBoard text (markdown): one block each."""

    def quote(t):
        return "\n".join("    " + ln for ln in str(t).splitlines()) or "    (empty)"

    return "\n\n".join(
        f"**{s['split']} sample, reward {s['reward']:.4g}** (answer: {s.get('answer', '')!s})\n\n"
        f"prompt:\n\n{quote(_prompt_text(s['prompt']))}\n\nresponse:\n\n{quote(s['response'])}"
        for s in samples
    )


def wandb_options(cfg) -> Optional[Dict]:
    """``wandb.init``'s arguments from ``--logger.wandb.*`` (None when W&B is off): the run lives
    in ``<save_path>/wandb``, its config is the flags (without the API key)."""
    w = cfg.logger.wandb
    if not (w.enable or w.key):
        return None
    config = {k: v for k, v in flatten_ns(cfg).items() if k != "logger.wandb.key"}
    return dict(
        project=w.project,
        entity=w.org,
        group=w.group,
        name=w.run_name or Path(cfg.save_path).resolve().name,
        dir=str(cfg.save_path),
        config=config,
        key=w.key,
    )


def _start_wandb(opts: Dict):
    """``wandb.init``; a failure (no login, no network in online mode) is one line, not a trace."""
    import wandb

    opts = dict(opts)
    key = opts.pop("key", None)
    if key:
        os.environ["WANDB_API_KEY"] = key  # read by wandb.init; not written to ~/.netrc
    Path(opts["dir"]).mkdir(parents=True, exist_ok=True)
    try:
        wandb.init(**opts)
    except Exception as e:  # noqa: BLE001  wandb raises many kinds (UsageError, CommError, AuthenticationError ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise JobError(
            f"W&B did not start ({type(e).__name__}: {first}); WANDB_MODE=offline logs without network, "
            "`wandb sync` uploads later"
        ) from None
    return wandb


def _scalars(d: Dict, prefix: str = "") -> Dict[str, float]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[prefix + k] = float(v)
    return out


def summary(m: Dict) -> str:
    parts = [
        f"reward {m['reward_mean']:.3f}",
        f"acc {m['accuracy']:.2f}",
        f"loss {m['loss']:+.4g}",
        f"update {m['update_seconds']:.1f}s",
        f"peak/B {m['peak_over_budget_max']:.3f}",
    ]
    if m.get("entropy") is not None:
        parts.insert(3, f"entropy {m['entropy']:.3f}")
    if m.get("zero_adv_skip"):
        parts.append(f"skipped {m['zero_adv_share']:.0%} (A=0)")
    if "eval_accuracy" in m:
        parts.append(f"eval acc {m['eval_accuracy']:.3f}")
    if "grad_rel_error" in m:
        parts.append(f"grad err {m['grad_rel_error']:.4f}")
    if "compare_speedup_vs_gc" in m:
        parts.append(f"x{m['compare_speedup_vs_gc']:.2f} vs gc")
    return ", ".join(parts)
