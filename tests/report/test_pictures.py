"""The run's pictures (``hilore_actor/report/pictures.py``): the heatmap paints each (unit,
microbatch) cell in its action's colour, a pad row in the skipped colour, with a legend of every
kind; the peaks chart draws B's line at 1; a PNG's size is read from its header."""

import random

import numpy as np
import pytest

from hilore_actor.report import pictures


def _pixel(fig, ax, x, y, drawn=None):
    """The RGB colour ``fig`` drew at data point (x, y) of ``ax`` (``drawn``: ``_drawn(fig)``)."""
    buf = _drawn(fig) if drawn is None else drawn
    px, py = ax.transData.transform((x, y))
    return tuple(int(c) for c in buf[buf.shape[0] - int(round(py)), int(round(px)), :3])


def _drawn(fig):
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())


def _rgb(hex_colour):
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def test_each_cell_has_its_actions_colour_and_a_pad_row_the_skipped_one():
    seed = random.randrange(2**31)
    print("seed", seed)
    rng = random.Random(seed)
    units = [f"model.layers.{i}.{b}" for i in range(3) for b in ("self_attn", "mlp")]
    columns = [("".join(rng.choice("HPLR") for _ in units), False) for _ in range(5)]
    columns[3] = ("H" * len(units), True)  # a pad row: skipped whatever ran
    fig = pictures.actions_heatmap(units, columns, "t", [str(k) for k in range(5)], [(0, "rank 0"), (3, "rank 1")])
    ax, drawn = fig.axes[0], _drawn(fig)
    for j, (acts, skipped) in enumerate(columns):
        for i, a in enumerate(acts):
            want = pictures.COLOURS["skipped" if skipped else a]
            assert _pixel(fig, ax, j, i, drawn) == _rgb(want), (i, j, a, skipped)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [pictures.MEANING[k] for k in pictures.KINDS]
    assert len({pictures.COLOURS[k] for k in pictures.KINDS}) == len(pictures.KINDS)  # distinct colours
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "0 self_attn",
        "0 mlp",
        "1 self_attn",
        "1 mlp",
        "2 self_attn",
        "2 mlp",
    ]
    pictures._plt().close(fig)


def test_step_pictures_of_an_actions_line(tmp_path):
    line = {
        "units": ["layers.0.self_attn", "layers.0.mlp"],
        "ranks": {
            "1": [{"actions": "RR", "skipped": False, "peak_over_budget": 0.7}],
            "0": [{"actions": "HL", "skipped": False, "peak_over_budget": 1.2}],
        },
    }
    fig = pictures.step_heatmap(line, 3)
    ax = fig.axes[0]
    assert _pixel(fig, ax, 0, 1) == _rgb(pictures.COLOURS["L"])  # rank 0 first, whatever the dict's order
    assert _pixel(fig, ax, 1, 0) == _rgb(pictures.COLOURS["R"])
    assert "step 3" in ax.get_title()
    path = pictures.png(fig, tmp_path / "a.png")
    w, h = pictures.png_size(path)
    from PIL import Image

    assert Image.open(path).size == (w, h) and w > 200 and h > 100
    assert pictures.step_heatmap(dict(line, units=[]), 3) is None  # gc or none: no recovery engine
    fig = pictures.step_peaks(line, 3)
    ax = fig.axes[0]
    b = [ln for ln in ax.get_lines() if ln.get_label() == "B"]
    assert len(b) == 1 and list(b[0].get_ydata()) == [1.0, 1.0]
    assert ax.get_ylim()[1] >= 1.2  # the peak over B stays in view
    pictures._plt().close(fig)
    (tmp_path / "b.png").write_text("not an image")
    with pytest.raises(ValueError, match="not a PNG"):
        pictures.png_size(tmp_path / "b.png")


def test_a_long_runs_heatmap_shows_evenly_spaced_steps_the_last_included():
    mbs = [{"actions": "H", "skipped": False} for _ in range(100)]
    records = [{"step": s, "units": ["u"], "ranks": {"0": mbs}} for s in range(1, 11)]  # 1000 columns
    fig = pictures.run_heatmap(records)
    title = fig.axes[0].get_title()
    shown = [t.get_text() for t in fig.axes[0].texts]
    assert "4 of 10 steps" in title and shown == ["step 1", "step 4", "step 7", "step 10"], (title, shown)
    pictures._plt().close(fig)
