"""The benchmark's ``--json`` file while the run goes (``benchmarks.bench.partial``): a run
stopped midway, as ``timeout`` stops a stage of ``benchmarks/gpu_check.sh`` (SIGTERM, then
SIGKILL), keeps every piece it finished."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.bench.partial import Progress, write_atomic
from benchmarks.bench.outputs import FIELDS
from hilore_actor.models import tiny_config

ROOT = Path(__file__).resolve().parents[2]

# the benchmark with the second method's record held back: the run is stopped while the first
# method's record is written and the second one's is not
HOLD_SECOND_RECORD = """
import sys, time
from benchmarks.bench import cli, records
made = []
real = records.method_record
def method_record(*a, **k):
    if made:
        time.sleep(600)
    made.append(1)
    return real(*a, **k)
records.method_record = method_record
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_run_stopped_by_sigterm_keeps_what_it_finished(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(tiny_config("llama", hidden_size=64, num_layers=2, vocab_size=2048).to_json_string())
    out = tmp_path / "r.json"
    args = [
        "--workload",
        "cpu-small",
        "--model-config",
        str(cfg),
        "--device",
        "cpu",
        "--methods",
        "gc,no-gc",
        "--repeats",
        "2",
        "--updates",
        "1",
        "--cpu-meter",
        "storage",
        "--json",
        str(out),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_SECOND_RECORD, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    seen, deadline = [], time.monotonic() + 400
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if out.exists():
                doc = json.loads(out.read_text())  # whole at every moment: written through a temporary file
                seen.append(doc["partial"]["stage"])
                if doc["records"]:
                    break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(signal.SIGTERM)  # what timeout sends first
        log = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    print(log[-3000:], seen[:3], seen[-3:])
    assert proc.returncode == 143 and "[bench] stopped (signal SIGTERM)" in log
    doc = json.loads(out.read_text())
    part = doc["partial"]
    assert part["stopped"] == "signal SIGTERM during measuring peaks and gradients"
    assert part["done"][:2] == ["model and microbatches built", "B measured"] and "timing" in part["done"]
    assert doc["budget_base_bytes"] > 0 and doc["workload"]["name"] == "cpu-small" and "--cpu-meter" in doc["command"]
    assert [p["method"] for p in doc["prepared"]] == ["gc", "gc-aa", "no-gc"]
    phase = doc["phases"][-1]
    assert phase["label"] == "main phase" and phase["complete"]
    assert set(phase["times"]) == {"gc", "gc-aa", "no-gc"} and all(len(t) == 2 for t in phase["times"].values())
    assert [r["method"] for r in doc["records"]] == ["gc"] and set(FIELDS) <= set(doc["records"][0])
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_progress_keeps_the_file_whole_and_current(tmp_path):
    path = tmp_path / "r.json"
    p = Progress(str(path), "python -m benchmarks.bench", "cpu-small")
    assert json.loads(path.read_text())["partial"]["stage"] == "starting"
    p.stage("preparing methods", done="B measured", budget_base_bytes=7)
    p.prepared({"method": "gc", "budget_ratio": None})
    p.phase_times("main phase", {"gc": [1.0]}, 1, 2)
    p.phase_times("main phase", {"gc": [1.0, 1.1]}, 2, 2)  # replaces the unfinished phase
    p.record({"method": "gc"})
    doc = json.loads(path.read_text())
    assert doc["budget_base_bytes"] == 7 and doc["prepared"] == [{"method": "gc", "budget_ratio": None}]
    assert doc["phases"] == [{"label": "main phase", "times": {"gc": [1.0, 1.1]}, "complete": True}]
    assert doc["partial"]["done"] == [
        "B measured",
        "prepared gc",
        "main phase: repeat 1/2",
        "main phase: repeat 2/2",
        "measured gc",
    ]
    p.stopped("signal SIGTERM during measuring peaks and gradients")
    assert json.loads(path.read_text())["partial"]["stopped"].startswith("signal SIGTERM")
    write_atomic(path, {"records": [], "done": True})  # the whole result
    p.finished()
    p.stopped("too late")  # nothing may overwrite the whole result
    assert json.loads(path.read_text()) == {"records": [], "done": True}
    with pytest.raises(TypeError):
        write_atomic(path, {"records": [object()]})
    assert json.loads(path.read_text()) == {"records": [], "done": True}
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.json"]
    Progress(None, "cmd", "cpu-small").stage("anything")  # no --json: nothing written
