"""``python -m benchmarks.bench.report``: re-render results and the results page from their JSON.

``RESULT.json [...]``: rewrite each RESULT.md and RESULT.png (``outputs``), after a change to the
report, no re-measuring needed. ``--results DIR --out RESULTS.md [--readme README.md] [--check]``:
the results page and the README's headline table (``results_page``); ``--check`` only compares
and exits 1 when a file differs.

The command sits on top of the modules it calls: ``results_page`` (the page) imports
``results_studies`` and ``outputs`` (one result's tables), and nothing imports this module.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .outputs import markdown, plot
from .results_page import write


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench.report", description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="*", help="result JSON files whose markdown and plot to re-render")
    ap.add_argument("--results", help="folder of committed results: generate the results page from it")
    ap.add_argument("--out", default="benchmarks/RESULTS.md", help="the results page (with --results)")
    ap.add_argument("--readme", help="also regenerate this README's headline block (with --results)")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 when a file differs")
    args = ap.parse_args(argv)
    if args.results:
        stale = write(Path(args.results), Path(args.out), Path(args.readme) if args.readme else None, args.check)
        for p in stale:
            print(f"{'differs from its JSON' if args.check else 'rewritten'}: {p}")
        return 1 if (args.check and stale) else 0
    for path in args.json:
        data = json.loads(Path(path).read_text())
        records = data.pop("records")
        Path(path).with_suffix(".md").write_text(markdown(records, data))
        plot(
            Path(path).with_suffix(".png"),
            records,
            data["budgets"],
            f"{data['workload']['name']}: throughput vs peak ({data['budget_scope']} scope), relative to gc",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
