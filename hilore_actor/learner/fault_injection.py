"""Fault injection for tests: ``HILORE_FAULT=KIND:ARGS[,KIND:ARGS...]`` names the faults to inject.

The kinds, where they strike and what the job does about each are listed in
``train/faults.py``; this is only the switch, shared by the learner room and the job.
"""

from __future__ import annotations

import os


def injected(kind: str, *args) -> bool:
    """Whether ``HILORE_FAULT`` (one spec, or several joined by commas) asks for fault ``kind``
    at ``args`` (e.g. a rank and a step; ``*`` in a spec matches any value)."""
    want = [kind, *map(str, args)]
    for spec in os.environ.get("HILORE_FAULT", "").split(","):
        parts = spec.strip().split(":")
        if len(parts) == len(want) and all(s in (w, "*") for s, w in zip(parts, want)):
            return True
    return False


def reconstructed() -> bool:
    """Whether this process is a Ray actor that Ray restarted (a fault fires once, not again in
    the restarted copy)."""
    try:
        import ray

        return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:
        return False
