"""Progress on the driver while the job's Ray workers work: planning's phases and passes, then, within
a step, the rollouts and each rank's update, so that a run shows a sign of life from its first second.

Workers tell a ``ProgressBoard`` (a Ray actor of no CPU) what they are doing, without waiting for it;
the driver reads the board while it waits for their results (``Progress.get``). On a terminal each
worker has one updating line (tqdm); elsewhere (CI, ``ray job submit`` logs) a plain line when a
worker enters a phase and, while the wait lasts, every ``Progress.Config.every`` seconds.

Example::

    progress = Progress(ray)
    learners = [Learner.remote(..., progress=progress.reporter(f"learner-{r}")) for r in range(n)]
    infos = progress.get([l.info.remote() for l in learners], "planning")
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional


class ProgressBoard:
    """The latest event of each worker (a Ray actor)."""

    def __init__(self):
        self.events: Dict[str, Dict] = {}

    def tell(self, who: str, event: Dict) -> None:
        self.events[who] = event

    def read(self) -> Dict[str, Dict]:
        return self.events

    def clear(self) -> None:
        self.events = {}


class Reporter:
    """What a worker calls with ``{"phase", "pass", "total", "elapsed"}`` (``Runner.progress``'s
    events); it never waits and never fails the worker."""

    def __init__(self, board, who: str):
        self.board, self.who = board, who

    def __call__(self, event: Dict) -> None:
        try:
            self.board.tell.remote(self.who, dict(event, at=time.time()))
        except Exception:  # a board that is gone (the driver shutting down) costs the worker nothing
            pass

    def phase(self, name: str, i: int = 0, total: Optional[int] = None, since: Optional[float] = None) -> None:
        """A step's own events (rollouts, updates): ``elapsed`` since ``since`` (this process's
        ``perf_counter``; None: from now)."""
        elapsed = time.perf_counter() - since if since is not None else 0.0
        self({"phase": name, "pass": i, "total": total, "elapsed": elapsed})


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def describe(who: str, e: Dict, now: Optional[float] = None) -> str:
    """One worker's line: its phase, the pass within it (of how many, where known), and the time
    since the phase began, as of ``now`` (``time.time()``; default: as the worker told it)."""
    done = f" {e['pass']}/{e['total']}" if e.get("total") else f" pass {e['pass']}" if e.get("pass") else ""
    elapsed = e.get("elapsed", 0.0) + max(0.0, (now - e["at"]) if now is not None and "at" in e else 0.0)
    return f"{who}: {e['phase'] or 'working'}{done}, {_clock(elapsed)}"


class Progress:
    """The driver's side: a board the workers tell, read while the driver waits on them."""

    @dataclass(frozen=True)
    class Config:
        poll: float = 0.5  # seconds between reads of the board
        every: float = 30.0  # plain output: seconds between lines while nothing changes
        after: float = 3.0  # a step's wait shows progress once it lasts this long (planning: at once)

    def __init__(self, ray, stream=None, config: Optional["Progress.Config"] = None, tty: Optional[bool] = None):
        self.ray, self.config = ray, config or Progress.Config()
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.board = ray.remote(ProgressBoard).options(num_cpus=0).remote()

    def reporter(self, who: str) -> Reporter:
        return Reporter(self.board, who)

    def get(self, refs: List, label: str, after: Optional[float] = None):
        """``ray.get(refs)``, showing the workers' progress while it waits (from ``after`` seconds on;
        default ``Config.after``). A worker's error comes out of ``ray.get`` as before."""
        after = self.config.after if after is None else after
        t0, shown, last_line, bars = time.perf_counter(), {}, 0.0, {}
        self.ray.get(self.board.clear.remote())
        try:
            while True:
                _, waiting = self.ray.wait(refs, num_returns=len(refs), timeout=self.config.poll)
                now = time.perf_counter()
                if not waiting:
                    break
                if now - t0 < after:
                    continue
                events = self.ray.get(self.board.read.remote())
                if self.tty:
                    self._bars(bars, events, label)
                else:
                    changed = {w: e for w, e in events.items() if shown.get(w) != e.get("phase")}
                    if changed or now - last_line >= self.config.every:
                        for who, e in sorted((changed or events).items()):
                            print(f"[{label}] {describe(who, e, time.time())}", file=self.stream, flush=True)
                        shown.update({w: e.get("phase") for w, e in events.items()})
                        last_line = now
        finally:
            for bar in bars.values():
                bar.close()
        return self.ray.get(refs)

    def _bars(self, bars: Dict, events: Dict[str, Dict], label: str) -> None:
        from tqdm import tqdm

        for who, e in sorted(events.items()):
            bar = bars.get(who)
            if bar is None:
                bar = bars[who] = tqdm(
                    file=self.stream, position=len(bars), leave=False, dynamic_ncols=True, bar_format="{desc}"
                )
            bar.set_description_str(f"[{label}] {describe(who, e, time.time())}", refresh=True)
