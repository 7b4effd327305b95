"""The codec benchmark on a tiny random model: every field present, byte ratios exact."""

import json

import pytest
import torch

from benchmarks.bench import codecs as bench_codecs


def test_codec_benchmark_reports_bytes_kinds_and_gradient_errors(tmp_path, capsys):
    seed = torch.seed() % 2**31
    print("seed", seed)
    out = tmp_path / "codecs.json"
    rc = bench_codecs.main(
        [
            "--model",
            "cpu-small",
            "--codecs",
            "int8,int8-g64,bf16",
            "--scopes",
            "all,mlp",
            "--tokens",
            "128",
            "--sets",
            "2",
            "--seed",
            str(seed),
            "--json",
            str(out),
            "--markdown",
            str(tmp_path / "codecs.md"),
        ]
    )
    assert rc == 0
    d = json.loads(out.read_text())
    res = d["codecs"]
    assert set(res) == {"int8", "int8-g64", "bf16"}
    hidden = d["workload"]["model"]["hidden_size"]
    kinds = res["int8"]["kinds"]
    assert {"query", "key", "value", "attention input", "attention output", "mlp input", "activation"} <= set(kinds)
    assert set(d["saved_bytes_by_kind"]) >= set(kinds)
    assert set(res["int8"]["kind_grad_rel_err"]) == {k for k, b in d["saved_bytes_by_kind"].items() if b}
    # per-token int8 stores one byte per value and one float32 scale per row; bf16 two bytes
    assert abs(kinds["attention input"]["compression"] - 4 * hidden / (hidden + 4)) < 1e-9
    assert all(abs(k["compression"] - 2.0) < 1e-9 for k in res["bf16"]["kinds"].values())
    for c in res.values():
        for s in ("all", "mlp"):
            g = c["grad_rel_err"][s]
            assert len(g["all"]) == 2 and all(0.0 < e < 0.1 for e in g["all"]) and g["max"] == max(g["all"])
    assert res["bf16"]["grad_rel_err"]["all"]["mean"] < res["int8"]["grad_rel_err"]["all"]["mean"]
    assert "| int8-g64 |" in (tmp_path / "codecs.md").read_text()


def test_codec_benchmark_rejects_unknown_codecs(capsys):
    with pytest.raises(SystemExit) as e:
        bench_codecs.main(["--codecs", "int3", "--json", "x.json"])
    assert e.value.code == 2 and "int3" in capsys.readouterr().err
