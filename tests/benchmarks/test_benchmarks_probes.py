"""The maintained probes in ``benchmarks/probes/`` still run against the code they measure (cheap
smokes from a checkout); the frozen ones say so in their docstrings."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "benchmarks" / "probes"
FROZEN = ("compile_hooks_probe", "compile_regions_probe")  # evidence quoted in docs/compile.md


def _run(module, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", f"benchmarks.probes.{module}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def test_chunked_head_sizes_on_a_small_head(tmp_path):
    """Every chunk size's gradient equals the full head's (the probe asserts it), and both files come out."""
    _run(
        "chunked_head_sizes",
        "--tokens",
        "128",
        "--hidden",
        "16",
        "--vocab",
        "1024",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    )
    out = json.loads((tmp_path / "results.json").read_text())
    assert [r["chunk"] for r in out["rows"]][-1] == "full" and (tmp_path / "results.md").is_file()


def test_compile_probe_on_cpu_small_with_a_known_peak(tmp_path):
    """A known peak that fits ends the search at 1.0 without compiling: the benchmark's inputs,
    runners and compile-budget search are what the probe still calls."""
    _run(
        "compile_probe",
        "--workload",
        "cpu-small",
        "--room",
        str(2**40),
        "--known",
        "1.0=1",
        "--json",
        str(tmp_path / "out.json"),
    )
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["fits_at"] == 1.0 and out["peaks"] == {"1.0000": 1}


def test_every_probe_is_run_here_or_marked_frozen():
    smoked = {"chunked_head_sizes", "compile_probe"}
    for f in PROBES.glob("*.py"):
        if f.stem == "__init__":
            continue
        doc = f.read_text()
        if f.stem in FROZEN:
            assert "Frozen evidence, not maintained" in doc and "docs/compile.md" in doc, f.name
        else:
            assert f.stem in smoked and "tests/benchmarks/test_benchmarks_probes.py" in doc, f.name
