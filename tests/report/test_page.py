"""The run report (``python -m hilore_actor.report``): the page and its pictures from a run folder
alone (a folder written by the job's own writers from made-up steps, and the tiny job's reference
run, whose report the job writes itself), rendered by a real browser (headless Chromium), whose
screenshot shows every picture loaded at its size; a folder that is not a run is one line, exit 2."""

import html
import json
import math
import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hilore_actor.report import pictures
from hilore_actor.report.__main__ import main
from hilore_actor.report.page import write

from synthetic_run import write_run  # noqa: E402

IMG = re.compile(r'<img src="([^"]+)" width="(\d+)" height="(\d+)"')


def _images(page: Path):
    """``[(file, width, height)]`` of the page's pictures, as its HTML states them."""
    return [(f, int(w), int(h)) for f, w, h in IMG.findall(page.read_text())]


def test_the_page_of_a_run_folder(tmp_path):
    seed = random.randrange(2**31)
    print("seed", seed)
    run = tmp_path / "run"
    write_run(run, seed, steps=4)
    page = write(run)
    assert page == run / "report" / "index.html"
    text = page.read_text()
    shown = _images(page)
    assert [f for f, _, _ in shown] == ["reward.png", "peaks.png", "actions.png", "shares.png", "time.png", "skip.png"]
    for f, w, h in shown:
        assert pictures.png_size(page.parent / f) == (w, h), f
    assert "http" not in text.replace("http-equiv", "") and "<script" not in text  # nothing fetched, nothing run
    assert "<th>hilore.budget</th><td>0.58</td>" in text and "<th>world_size</th><td>2</td>" in text
    assert "gc 8.0 s, hilore 6.4 s on the same microbatches (x1.250)" in text  # 4 steps of 2.0 s and 1.6 s
    heat = np.asarray(Image.open(page.parent / "actions.png").convert("RGB"))
    for kind in pictures.KINDS:  # every kind the made-up actions hold is painted (step 2 holds a pad row)
        colour = tuple(int(pictures.COLOURS[kind][i : i + 2], 16) for i in (1, 3, 5))
        assert (heat == colour).all(axis=-1).sum() > 100, kind
    before = {f: (page.parent / f).read_bytes() for f, _, _ in shown}
    out = tmp_path / "elsewhere"
    assert write(run, out) == out / "index.html" and {f: (out / f).read_bytes() for f in before} == before


def test_a_run_without_actions_or_checkpoints_still_has_its_curves(tmp_path):
    """A run folder written before ``actions.jsonl`` existed, its checkpoints under --ckpt.path:
    the peaks come from the budget coordinator's record, the flags are said to be elsewhere."""
    run = tmp_path / "run"
    write_run(run, 1, steps=2)
    (run / "actions.jsonl").unlink()
    shutil.rmtree(run / "checkpoints")
    page = write(run)
    assert [f for f, _, _ in _images(page)] == ["reward.png", "peaks.png", "shares.png", "time.png", "skip.png"]
    text = page.read_text()
    assert "holds no checkpoint" in text and "gc 4.0 s, hilore 3.2 s" in text  # the backend from its timing's name


@pytest.mark.parametrize("case", ["missing", "a file", "error.log only", "no step yet", "not JSON"])
def test_a_folder_that_is_not_a_run_is_one_line_and_exit_2(tmp_path, capsys, case):
    folder = tmp_path / "f"
    if case == "a file":
        folder.write_text("x")
    elif case != "missing":
        folder.mkdir()
        name, text = {
            "error.log only": ("error.log", "trace"),
            "no step yet": ("metrics.jsonl", ""),
            "not JSON": ("metrics.jsonl", '{"step": 1}\n{"step": 2, \n'),
        }[case]
        (folder / name).write_text(text)
    assert main([str(folder)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and str(folder) in err, err
    assert not (folder / "report").exists()


def test_the_command_prints_the_pages_path(tmp_path, capsys):
    write_run(tmp_path / "run", 2, steps=1)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "out" / "index.html")
    (tmp_path / "a file").write_text("x")
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "a file" / "out")]) == 2  # cannot be written there
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "choose --out DIR" in err, err


# ---- the tiny job's reference run (tests/conftest.py's ``uninterrupted``) -------------------------


def test_the_job_records_each_units_action_and_draws_its_pictures_every_step(uninterrupted):
    """Every step: a line of actions.jsonl (every unit of the tiny model, each rank's microbatches,
    their peaks as the metrics hold them), its two pictures in the run folder, TensorBoard and the
    offline W&B run; the job writes the report and names it in its last line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from train_job import metrics, wandb_history

    out, r = uninterrupted
    rows = metrics(out)
    lines = [json.loads(ln) for ln in (out / "actions.jsonl").read_text().splitlines()]
    assert [a["step"] for a in lines] == [1, 2, 3]
    for a, m in zip(lines, rows):
        layers = {int(re.search(r"\.(\d+)\.", u).group(1)) for u in a["units"]}
        assert len(a["units"]) == 2 * len(layers) and layers == set(range(len(layers))), a["units"]
        assert sorted(a["ranks"]) == ["0", "1"]
        for rank, mbs in a["ranks"].items():
            assert len(mbs) == m["coordinator"][rank]["microbatches"] == 2
            assert all(len(mb["actions"]) == len(a["units"]) and set(mb["actions"]) <= set("HPLR") for mb in mbs)
            assert [mb["tokens"] for mb in mbs] == m["coordinator"][rank]["tokens"]
            assert max(mb["peak_over_budget"] for mb in mbs) == m["peak_over_budget"][rank]  # one update a step
        letters = "".join(mb["actions"] for mbs in a["ranks"].values() for mb in mbs)
        assert m["fraction_H"] == pytest.approx(letters.count("H") / len(letters))
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    history = wandb_history(out)
    for name, tag in (("actions", "hilore/actions"), ("peaks", "memory/peak_over_budget_per_microbatch")):
        events = acc.Images(tag)
        assert [e.step for e in events] == [1, 2, 3], tag
        for e in events:
            assert (e.width, e.height) == pictures.png_size(out / "pictures" / f"step_{e.step:06d}_{name}.png")
        assert [history[s][f"{tag}._type"] for s in (1, 2, 3)] == ["image-file"] * 3, tag
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"[train] report: {out / 'report' / 'index.html'}", last
    assert [f for f, _, _ in _images(out / "report" / "index.html")][:3] == ["reward.png", "peaks.png", "actions.png"]


def test_pad_rows_are_recorded_skipped_and_zero3_ranks_take_one_action_per_unit(skip_runs):
    """The skip's run under ZeRO-3 at B = 1.02 x gc (``skip_runs["on"]``): each step's microbatches
    marked skipped are its pad rows, and the report's heatmap paints them grey; the ranks agree on
    every unit's action microbatch by microbatch, and the plan mixes H and R."""
    from train_job import metrics

    on = [json.loads(ln) for ln in (skip_runs["on"] / "actions.jsonl").read_text().splitlines()]
    pads = [sum(mb["skipped"] for mbs in a["ranks"].values() for mb in mbs) for a in on]
    assert pads == [m["pad_microbatches"] for m in metrics(skip_runs["on"])] == [1, 2, 3]
    heat = np.asarray(Image.open(skip_runs["on"] / "report" / "actions.png").convert("RGB"))
    grey = tuple(int(pictures.COLOURS["skipped"][i : i + 2], 16) for i in (1, 3, 5))
    assert (heat == grey).all(axis=-1).sum() > 100
    for a in on:
        assert [mb["actions"] for mb in a["ranks"]["0"]] == [mb["actions"] for mb in a["ranks"]["1"]], a["step"]
    taken = {c for a in on for mbs in a["ranks"].values() for mb in mbs for c in mb["actions"]}
    assert {"H", "R"} <= taken, taken


BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# run in the page once it has loaded: where each picture is and what the browser decoded of it
PROBE = """<script>addEventListener("load", () => {
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify({height: document.documentElement.scrollHeight, images: [...document.images].map(
    i => ({src: i.getAttribute("src"), complete: i.complete, natural: [i.naturalWidth, i.naturalHeight],
           x: i.getBoundingClientRect().left + scrollX, y: i.getBoundingClientRect().top + scrollY,
           shown: [i.getBoundingClientRect().width, i.getBoundingClientRect().height]}))});
  document.body.appendChild(pre);
});</script>"""
WIDTH = 1300


def _browser():
    found = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if found is None:
        pytest.skip(
            "no headless Chromium on PATH (scripts/setup.sh installs chromium-headless-shell with apt where it runs as "
            "root; elsewhere install chromium or chromium-headless-shell)"
        )
    return found


def _chromium(browser, *args):
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--force-device-scale-factor=1"]
    r = subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_a_browser_shows_every_picture_of_the_tiny_runs_report(uninterrupted, tmp_path):
    """Headless Chromium loads the page the job wrote: every picture decoded at the PNG's own size
    and shown at it; the screenshot's pixels where each picture sits are that picture's."""
    browser = _browser()
    report = tmp_path / "report"
    shutil.copytree(uninterrupted[0] / "report", report)
    files = {f: (w, h) for f, w, h in _images(report / "index.html")}
    assert {"reward.png", "peaks.png", "actions.png", "time.png"} <= set(files), files
    probe = report / "probe.html"
    probe.write_text((report / "index.html").read_text().replace("</body>", PROBE + "</body>"))
    dom = _chromium(browser, f"--window-size={WIDTH},900", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri())
    found = json.loads(html.unescape(re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S).group(1)))
    assert [i["src"] for i in found["images"]] == list(files)
    shot = tmp_path / "shot.png"
    _chromium(
        browser, f"--window-size={WIDTH},{found['height']}", f"--screenshot={shot}", (report / "index.html").as_uri()
    )
    screen = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert screen.shape[:2] == (found["height"], WIDTH)
    for i in found["images"]:
        size = files[i["src"]]
        assert i["complete"] and i["natural"] == list(size) and i["shown"] == list(size), i
        drawn = np.asarray(Image.open(report / i["src"]).convert("RGB")).astype(int)
        x = round(i["x"])
        # the layout may place it at a fractional row: the whole row above or below it, whichever matches
        seen = min(
            (screen[y : y + size[1], x : x + size[0]] for y in {math.floor(i["y"]), math.ceil(i["y"])}),
            key=lambda part: np.abs(part - drawn).mean() if part.shape == drawn.shape else np.inf,
        )
        assert seen.shape == drawn.shape, i
        assert seen.std() > 20 and len(np.unique(seen.reshape(-1, 3), axis=0)) > 50, i  # not blank
        assert np.abs(seen - drawn).mean() < 2.0, i  # the picture itself, not a broken-image box
