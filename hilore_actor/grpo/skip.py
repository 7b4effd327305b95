"""Responses the learner may leave out: those whose token coefficients are exactly zero.

With no loss term but the clipped policy term, a token's coefficient (Eq. 4 of
``docs/DESIGN.md``) is its aggregation weight times a policy derivative proportional to the
response's advantage, so a response with advantage exactly 0 adds exactly nothing to the
gradient, whatever its log-probs (``group_advantages`` gives a group of equal rewards exactly 0).
A KL or entropy term reaches those log-probs, and so does a denominator that counts the
response; the integrations name such terms and ``skip_active`` decides.
"""

from __future__ import annotations

from typing import Sequence

SETTINGS = ("auto", "on", "off")
FLAG = "--hilore.skip_zero_advantage"


def skip_active(setting: str, blockers: Sequence[str]) -> bool:
    """Whether to skip: ``off`` never, ``auto`` exactly when no term of ``blockers`` (each a
    short description of a loss term or denominator that gives a zero-advantage response a
    gradient, naming its flag) is active, ``on`` likewise, or ``ValueError`` with one line."""
    if setting not in SETTINGS:
        raise ValueError(f"{FLAG} {setting!r}: choose {', '.join(SETTINGS)}")
    if setting == "on" and blockers:
        raise ValueError(
            f"{FLAG} on: {blockers[0]}, so a response with advantage 0 still has a gradient and skipping it "
            "would change the update; use auto (skips exactly when that is exact) or off"
        )
    return setting != "off" and not blockers
