"""CPU micro-benchmark of the chunked LM head over chunk sizes: time and peak memory of one
forward + backward of the token log-probs (the LoRA case: hidden states get a gradient, the head
is frozen), against the full head, at a 32k vocabulary and a narrow hidden size so it runs in
about a minute on 2 cores. Each chunk reads the whole [V, H] head three times (forward, the
backward's recompute, the hidden-state gradient; here 16 MB): small chunks pay that read more
often and run small matmuls, large ones hold more logits.

``python -m benchmarks.probes.chunked_head_sizes [--out benchmarks/results/chunked_head_sizes]``
writes ``results.json`` and ``results.md`` there. Timings are medians over interleaved repeats;
peaks come from a separate pass under the CPU memory meter (``runtime/memory.py``). Maintained:
``tests/benchmarks/test_benchmarks_probes.py`` runs it on a small head (every chunk size's gradient must equal
the full head's)."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hilore_actor.models.chunked_head import ChunkedTokenLogProbs, head_chunk_rows
from hilore_actor.runtime import MemoryMeter


def step(h, w, labels, chunk):
    """One forward + backward; ``chunk`` None: the full head (float32 logits, log-softmax)."""
    h = h.detach().requires_grad_()
    if chunk is None:
        lp = F.linear(h, w).float().log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    else:
        lp = ChunkedTokenLogProbs.apply(h, w, None, labels, chunk)
    lp.sum().backward()
    return h.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/chunked_head_sizes")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=gen)
    w = 0.1 * torch.randn(a.vocab, a.hidden, generator=gen)
    labels = torch.randint(0, a.vocab, (a.tokens,), generator=gen)
    cpu_rule = head_chunk_rows("cpu", a.vocab, a.hidden, w.dtype)
    cuda_rule = head_chunk_rows("cuda", a.vocab, a.hidden, torch.bfloat16)
    sizes = sorted({64, 128, cpu_rule, 512, min(cuda_rule, a.tokens)})
    cases = [(str(c), c) for c in sizes] + [("full", None)]
    ref = step(h, w, labels, None)
    for _, c in cases[:-1]:  # warm-up, and the same gradient at every size
        torch.testing.assert_close(step(h, w, labels, c), ref, rtol=1e-4, atol=1e-6)
    times = {name: [] for name, _ in cases}
    for _ in range(a.repeats):
        for name, c in cases:
            t = time.perf_counter()
            step(h, w, labels, c)
            times[name].append(time.perf_counter() - t)
    rows = []
    head_bytes = a.vocab * a.hidden * w.element_size()
    for name, c in cases:
        with MemoryMeter("cpu") as m:
            step(h, w, labels, c)
        reads = 2 if c is None else 3 * math.ceil(a.tokens / c)  # the full head: forward and the gradient
        rows.append(
            {
                "chunk": name,
                "rows": c or a.tokens,
                "seconds_median": statistics.median(times[name]),
                "seconds": times[name],
                "peak_bytes": m.report.peak_bytes,
                "head_reads": reads,
                "head_read_bytes": reads * head_bytes,
                "rule": "cpu"
                if c == cpu_rule
                else "cuda (capped at the tokens)"
                if c == min(cuda_rule, a.tokens)
                else "",
            }
        )
    out = {
        "tokens": a.tokens,
        "hidden": a.hidden,
        "vocab": a.vocab,
        "dtype": "float32",
        "repeats": a.repeats,
        "cpu_rule_rows": cpu_rule,
        "cuda_rule_rows_bf16": cuda_rule,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "rows": rows,
    }
    d = Path(a.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.json").write_text(json.dumps(out, indent=1) + "\n")
    md = [
        f"# Chunked head over chunk sizes (CPU, {out['threads']} threads)",
        "",
        f"{a.tokens} tokens, hidden {a.hidden}, vocabulary {a.vocab}, float32; one forward + backward of the "
        f"token log-probs (hidden-state gradient, frozen head); median of {a.repeats} interleaved repeats; peak "
        f"above the start from the CPU memory meter. Load average at the end: "
        f"{', '.join(f'{x:.1f}' for x in out['load_average'])} (a shared machine: times are rough). "
        f"Rule: CPU {cpu_rule} rows, CUDA {cuda_rule} rows (bf16) at this vocabulary.",
        "",
        "| chunk rows | rule | seconds | peak MiB | head reads | head read MB |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['chunk']} | {r['rule']} | {r['seconds_median']:.3f} | {r['peak_bytes'] / 2**20:.1f} | "
            f"{r['head_reads']} | {r['head_read_bytes'] / 1e6:.0f} |"
        )
    (d / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
