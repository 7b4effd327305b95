"""`ray job submit` against a local head (ray_jobs/submit_local.sh) runs the tiny preset to
completion. Slow (a head start plus the job): run with `pytest -m slow`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ray_job_submit_runs_tiny_preset(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(
        ["bash", str(ROOT / "ray_jobs" / "submit_local.sh"), "--preset", "tiny", "--save_path", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "succeeded" in (r.stdout + r.stderr).lower()
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in rows] == [1, 2]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_2"
