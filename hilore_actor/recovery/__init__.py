"""The recovery engine: graph-valid units whose saved activations are stored (H), compressed
(L) or recomputed (R). Imports torch only; ``engine.py``'s docstring is the map."""

from .codecs import CODECS, Codec, get_codec, reconstruction_error, register
from .engine import RecoveryEngine, Step
from .labels import ACTIONS, ALLOWED, PLANS
from .policies import BASELINES, ENGINE_POLICIES, apply_baseline
from .state import storage_key
from .units import discover_units

__all__ = [
    "ACTIONS",
    "ALLOWED",
    "BASELINES",
    "CODECS",
    "Codec",
    "ENGINE_POLICIES",
    "PLANS",
    "RecoveryEngine",
    "Step",
    "apply_baseline",
    "discover_units",
    "get_codec",
    "reconstruction_error",
    "register",
    "storage_key",
]
