"""Which committed results ``benchmarks/RESULTS.md`` shows, in what order, and the texts a reader
must know about each that its JSON cannot say: data in ``page.yaml`` beside the results
(``benchmarks/results/page.yaml``), read here into typed records.

Every figure on the page is computed from the JSON by ``results_page``; the texts carry no
figures, so they cannot drift from the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

PAGE_FILE = "page.yaml"


@dataclass
class Run:
    """One speed-benchmark result's section: ``stale`` replaces the current-planner line;
    ``hooked_compile_budget``: its compile-budget row's graph traced an engine's idle hooks."""

    name: str
    title: str
    about: str
    notes: List[str] = field(default_factory=list)
    stale: str = ""
    hooked_compile_budget: bool = False


@dataclass
class CodecRun:
    name: str
    title: str
    stale: str = ""


@dataclass
class DemoRun:
    name: str  # the metrics file's stem
    title: str
    commit: str  # the commit it ran at
    note: str


@dataclass
class Page:
    headline: List[Tuple[str, str, float]]  # rows of the headline table: (result, method, budget ratio)
    current_planner: str
    hooked_compile_budget_note: str
    runs: List[Run]
    codec_runs: List[CodecRun]
    demo_runs: List[DemoRun]
    skip_runs: List[DemoRun]  # the demo with the zero-advantage skip and --compare_skip
    diagnostics_aims: Dict[str, float]  # the aims the risk diagnostics are held to
    diagnostics_note: str
    paper_psi: Dict[str, float]  # the paper's risk-diagnostic figures for psi_u, quoted beside ours

    def hooked(self, name: str) -> bool:
        return any(r.name == name and r.hooked_compile_budget for r in self.runs)


def load_page(results: Path) -> Page:
    """The page's texts and layout from ``results/page.yaml``."""
    d = yaml.safe_load((Path(results) / PAGE_FILE).read_text())
    diag = d["diagnostics"]
    return Page(
        headline=[(str(n), str(m), float(b)) for n, m, b in d["headline"]],
        current_planner=d["current_planner"],
        hooked_compile_budget_note=d["hooked_compile_budget_note"],
        runs=[Run(**r) for r in d["runs"]],
        codec_runs=[CodecRun(**c) for c in d["codec_runs"]],
        demo_runs=[DemoRun(**x) for x in d["demo_runs"]],
        skip_runs=[DemoRun(**x) for x in d.get("skip_runs", [])],
        diagnostics_aims=diag["aims"],
        diagnostics_note=diag["note"],
        paper_psi=diag["paper_psi"],
    )
