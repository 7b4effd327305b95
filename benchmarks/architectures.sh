#!/usr/bin/env bash
# The benchmark's exactness check on the architectures GRPO users train most: for each, a tiny
# random config (tests/helpers/arch_sweep.py's), then
#   python -m benchmarks.bench --workload cpu-small --model-config <config.json>
#       --methods no-gc,gc,all-h,all-r,all-l --repeats 1 --updates 1
# gc, all-H and all-R must give no-gc's gradient exactly; all-L's error is reported. About 15 s
# per architecture on 2 cores. Writes benchmarks/results/architectures/<arch>.json.
# CPU_METER=storage measures peaks by live tensor storages instead of the profiler's event log
# (state-space models' reference scans make millions of events: Mamba reached 22.5 GB).
# Usage: [TIMEOUT=seconds] [CPU_METER=profiler|storage] bash benchmarks/architectures.sh [ARCH ...]
#        (a failure is reported, the rest run)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUTDIR:-benchmarks/results/architectures}
ARCHS=("$@")
[ ${#ARCHS[@]} -gt 0 ] || ARCHS=(olmo2 gemma3_text qwen3_moe mixtral gpt_oss phi3 qwen3 mistral smollm3 llama qwen2
                                  qwen3_next gptj falcon)
CFG=$(mktemp -d)
trap 'rm -rf "$CFG"' EXIT
mkdir -p "$OUT"
"$PY" tests/helpers/arch_sweep.py --configs "$CFG" "${ARCHS[@]}"
for a in "${ARCHS[@]}"; do
  echo "[architectures] $a"
  timeout "${TIMEOUT:-900}" "$PY" -m benchmarks.bench --workload cpu-small --model-config "$CFG/$a/config.json" \
    --methods no-gc,gc,all-h,all-r,all-l --repeats 1 --updates 1 --cpu-meter "${CPU_METER:-profiler}" \
    --json "$OUT/$a.json" > "$CFG/$a.log" 2>&1 \
    && grep -v '^USDT' "$CFG/$a.log" | tail -7 \
    || { echo "[architectures] $a FAILED (exit $?):"; grep -v '^USDT' "$CFG/$a.log" | tail -3; }
done
