"""HiLoRe allocation: exposure (Eq. 7), utility (Eq. 9), calibrated risk, the knapsack (Eq. 13),
the planner (validated plans per shape class and online actions). Imports torch (and numpy for
the knapsack) only."""

from .budget import BudgetError, parse_budget, resolve_budget
from .calibration import Calibration, calibrate, fit_kappa
from .exposure import exposures, token_weights, unit_exposure
from .knapsack import Option, solve
from .planner import MODES, Planner, ShapePlan
from .profiling import UnitCosts, profile_units, shape_class
from .runner import Runner, RunResult

__all__ = [
    "MODES",
    "BudgetError",
    "Calibration",
    "Option",
    "Planner",
    "RunResult",
    "Runner",
    "ShapePlan",
    "UnitCosts",
    "calibrate",
    "exposures",
    "fit_kappa",
    "parse_budget",
    "profile_units",
    "resolve_budget",
    "shape_class",
    "solve",
    "token_weights",
    "unit_exposure",
]
