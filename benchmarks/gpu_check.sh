#!/usr/bin/env bash
# One GPU check (docs/benchmark.md, "One GPU check"): a self-check, then gpu-ref (gc, no-gc and
# hilore-hr at B = 1.10 x gc), a reduced verl engine check and the CUDA tests, each under its own
# timeout; logs, results and summary.json go to $OUT (a temp dir when unset), each stage's as it goes.
# Exit status 0 only if every stage that was not skipped passed. Each stage's estimate and timeout:
# benchmarks/gpu_check_plan.py (every timeout >= 2 x its estimate, at most 540 s in all).
# Usage: bash benchmarks/gpu_check.sh [--dry-run]
#   --dry-run: self-check (no GPU needed), check every stage's command line and the plan, print it.
# Environment: PYTHON (default python3), OUT, GPU_CHECK_SITE (where .whl/*.whl go, /tmp/site),
#   GPU_CHECK_BENCH_ARGS / GPU_CHECK_VERL_ARGS / GPU_CHECK_TEST_ARGS: words appended to a stage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
DRY=0
(( $# <= 1 )) || { echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2; }
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}
SITE=${GPU_CHECK_SITE:-/tmp/site}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 GPU_CHECK_DRY=$DRY OUT
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
if ! mkdir -p "$OUT" || ! touch "$OUT/.write-test"; then
  echo "error: OUT=$OUT is not a writable directory" >&2; exit 1
fi
rm -f "$OUT/.write-test"

# ---- stages: name, log file, command; estimates and timeouts come from benchmarks/gpu_check_plan.py ----
STAGES=(selfcheck gpu-ref verl cuda-tests)
declare -A LOG=([selfcheck]=selfcheck.txt [gpu-ref]=gpu-ref.log [verl]=verl.log [cuda-tests]=cuda-tests.log)
declare -A LIMIT=() ESTIMATE=() STATUS=() SECS=()
read -r -a EXTRA_BENCH <<< "${GPU_CHECK_BENCH_ARGS:-}"
read -r -a EXTRA_VERL <<< "${GPU_CHECK_VERL_ARGS:-}"
read -r -a EXTRA_TEST <<< "${GPU_CHECK_TEST_ARGS:-}"
# gpu-ref's work is cut to fit its timeout with 2 x headroom (hilore, with calibration, profiling of L and P
# and four risk scales, does not: it runs in the verl stage, on a small model)
BENCH=(--workload gpu-ref --device cuda --methods gc,no-gc,hilore-hr --budgets 1.10 --budget-from gc
       --budget-scope device --head chunked --repeats 3 --updates 1 --no-loo
       --json "$OUT/gpu-ref.json" "${EXTRA_BENCH[@]}")
VERL=(--out "$OUT/verl.json" --workdir /tmp/hilore-verl-gpu-check "${EXTRA_VERL[@]}")
# only tests that run CUDA: the CPU suites (tests/runtime/test_memory.py, tests/recovery/test_engine.py) took 15-163 s here
TESTS=("tests/benchmarks/test_gpu_check.py::TestCuda" "${EXTRA_TEST[@]}")
PLANNER=benchmarks/gpu_check_plan.py  # standard library only; with python3 where $PY does not run
PLAN_PY=$PY; "$PY" -c "" 2> /dev/null || PLAN_PY=python3
TIMES=$("$PLAN_PY" "$PLANNER" --timeouts -- "${BENCH[@]}") || { echo "error: $PLANNER does not run" >&2; exit 1; }
while read -r s t e; do LIMIT[$s]=$t; ESTIMATE[$s]=$e; done <<< "$TIMES"
TOTAL=0; for s in "${STAGES[@]}"; do TOTAL=$((TOTAL + LIMIT[$s])); done

# The verl stage: install the carried wheels (.whl/*.whl) when there are any, then run the check.
VERL_STAGE='
if compgen -G ".whl/*.whl" > /dev/null; then
  echo "[verl] installing $(ls .whl/*.whl | wc -l) wheels from .whl into $SITE (--no-deps)"
  if "$0" -m pip --version > /dev/null 2>&1; then
    "$0" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" .whl/*.whl || exit 1
  else  # no pip in this environment: a wheel is a zip archive
    "$0" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
      "$SITE" .whl/*.whl || exit 1
  fi
  export PYTHONPATH="$SITE:$PYTHONPATH"
else
  echo "[verl] no .whl/*.whl: verl and the modules its engine imports must already be installed"
fi
exec "$0" "$@"'

SELFCHECK='
import importlib, importlib.metadata as md, importlib.util, os, shutil, sys
dry, bad = os.environ["GPU_CHECK_DRY"] == "1", []
def line(state, what, detail=""):
    print(f"{state:8s} {what}: {detail}", flush=True)
def version(mod, dist=None):
    try:
        return md.version(dist or mod)
    except Exception:
        return "importable (no package metadata)"
line("ok", "python", f"{sys.version.split()[0]} at {sys.executable}")
try:
    import torch
    line("ok", "torch", f"{torch.__version__} (CUDA build: {torch.version.cuda})")
    if torch.cuda.is_available():
        p, (free, _) = torch.cuda.get_device_properties(0), torch.cuda.mem_get_info(0)
        line("ok", "cuda", f"{torch.cuda.device_count()} device(s); {p.name}, {p.total_memory / 2**30:.0f} GiB "
             f"({free / 2**30:.0f} GiB free)")
    elif dry:
        line("note", "cuda", "no CUDA device visible (fine for a dry run; a run needs one)")
    else:
        line("MISSING", "cuda", "no CUDA device visible"); bad.append("a CUDA device")
except Exception as e:
    line("MISSING", "torch", f"{type(e).__name__}: {e}"); bad.append("torch")
for mod in ("hilore_actor", "transformers", "peft", "pytest", "numpy"):
    try:
        m = importlib.import_module(mod)
        line("ok", mod, f"from {os.path.dirname(m.__file__)}" if mod == "hilore_actor" else version(mod))
    except Exception as e:
        line("MISSING", mod, f"not importable with {sys.executable}: {type(e).__name__}: {e}"); bad.append(mod)
for mod, dist in (("accelerate", None), ("safetensors", None), ("verl", None), ("tensordict", None), ("ray", None),
                  ("deepspeed", None), ("flash_attn", "flash-attn")):
    try:
        found = importlib.util.find_spec(mod) is not None
    except Exception:
        found = False
    line("ok" if found else "absent", mod, version(mod, dist) if found else "not installed (optional)")
wheels = sorted(f for f in os.listdir(".whl") if f.endswith(".whl")) if os.path.isdir(".whl") else []
line("ok" if wheels else "absent", ".whl",
     " ".join(wheels) or "no carried wheels (the verl stage needs verl importable)")
for path in ("/tmp", os.environ["OUT"]):
    line("ok", "free disk", f"{shutil.disk_usage(path).free / 2**30:.1f} GiB at {path}")
line("ok", "OUT", os.environ["OUT"] + " (writable)")
if bad:
    print("self-check failed: missing " + ", ".join(bad), flush=True)
sys.exit(1 if bad else 0)
'

plan() {
  echo "plan ($([[ $DRY == 1 ]] && echo dry run || echo run); OUT=$OUT; PYTHON=$PY):"
  printf '  %-11s %4ss  %s\n' selfcheck "${LIMIT[selfcheck]}" "python, torch, CUDA, GPU, imports, .whl, disk, \$OUT" \
    gpu-ref "${LIMIT[gpu-ref]}" "$PY -m benchmarks.bench ${BENCH[*]}" \
    verl "${LIMIT[verl]}" "[.whl -> $SITE] $PY -m hilore_actor.verl.gpu_check ${VERL[*]}" \
    cuda-tests "${LIMIT[cuda-tests]}" "$PY -m pytest ${PYTEST_OPTS[*]} ${TESTS[*]}"
  echo "  total       ${TOTAL}s of timeouts (at most 540s)"
  echo "estimates ($PLANNER):"
  "$PLAN_PY" "$PLANNER" --explain -- "${BENCH[@]}"
}
# -v: one line per test as it ends, -s: each test's printed numbers as they come (a timeout keeps both)
PYTEST_OPTS=(-v -s -rfEs)

# run_stage NAME CMD...: the command under the stage's timeout, its output to stdout and the log
run_stage() {
  local name=$1 t0=$SECONDS rc; shift
  local shown="$*"; [[ ${2:-} == -c ]] && shown="$1 -c <script in benchmarks/gpu_check.sh> ${*:4}"
  echo "== $name (timeout ${LIMIT[$name]}s)"
  echo "\$ $shown" > "$OUT/${LOG[$name]}"
  timeout -k 2 "${LIMIT[$name]}" "$@" 2>&1 | tee -a "$OUT/${LOG[$name]}"
  rc=${PIPESTATUS[0]}
  SECS[$name]=$((SECONDS - t0))
  case $rc in
    0) STATUS[$name]=passed ;;
    124|137) STATUS[$name]=timed-out; echo "$name: timed out after ${LIMIT[$name]}s" | tee -a "$OUT/${LOG[$name]}" ;;
    3) if [[ $name == verl ]]; then STATUS[$name]=skipped; else STATUS[$name]=failed; fi ;;
    *) STATUS[$name]=failed ;;
  esac
  echo "== $name: ${STATUS[$name]} (exit status $rc, ${SECS[$name]}s)"
}

BENCH_PARSE='
import sys
from benchmarks.bench.cli import build_parser, method_names
from benchmarks.bench.workloads import WORKLOADS
args = build_parser().parse_args(sys.argv[1:])
try:
    method_names(args)
except ValueError as e:
    sys.exit(f"python -m benchmarks.bench: error: {e}")
print("[gpu-ref] arguments ok:", args.workload, "-", WORKLOADS[args.workload].note, "; methods", args.methods)
'

PLAN=$(plan); echo "$PLAN"
if (( TOTAL > 540 )); then echo "error: the stage timeouts sum to ${TOTAL}s, over 540s" >&2; exit 1; fi
if ! CHECKED=$("$PLAN_PY" "$PLANNER" --check -- "${BENCH[@]}"); then
  if [[ $DRY == 1 ]]; then
    echo "error: the plan breaks its rule (a timeout under 2 x its estimate, or over 540 s in all):" >&2
    grep 'plan problem' <<< "$CHECKED" >&2; exit 1
  fi
  echo "warning: the plan breaks its rule; running anyway (see the dry run):"; grep 'plan problem' <<< "$CHECKED"
fi
run_stage selfcheck "$PY" -c "$SELFCHECK"
echo "$PLAN" >> "$OUT/selfcheck.txt"
for s in gpu-ref verl cuda-tests; do
  if [[ ${STATUS[selfcheck]} != passed ]]; then
    STATUS[$s]=skipped; SECS[$s]=0; echo "== $s: skipped (the self-check failed: see $OUT/selfcheck.txt)"; continue
  fi
  if [[ $DRY == 1 ]]; then
    case $s in
      gpu-ref) run_stage "$s" "$PY" -c "$BENCH_PARSE" "${BENCH[@]}" ;;
      verl) run_stage "$s" "$PY" -m hilore_actor.verl.gpu_check "${VERL[@]}" --parse-only ;;
      cuda-tests) run_stage "$s" "$PY" -m pytest "${PYTEST_OPTS[@]}" --collect-only -qq "${TESTS[@]}" ;;
    esac
  else
    case $s in
      gpu-ref) run_stage "$s" "$PY" -m benchmarks.bench "${BENCH[@]}" ;;
      verl) run_stage "$s" env SITE="$SITE" bash -c "$VERL_STAGE" "$PY" -m hilore_actor.verl.gpu_check "${VERL[@]}" ;;
      cuda-tests) run_stage "$s" "$PY" -m pytest "${PYTEST_OPTS[@]}" "${TESTS[@]}" ;;
    esac
  fi
done

RC=0; ENTRIES=""
for s in "${STAGES[@]}"; do
  [[ ${STATUS[$s]} == passed || ${STATUS[$s]} == skipped ]] || RC=1
  ENTRIES+="${ENTRIES:+,
  }{\"name\": \"$s\", \"status\": \"${STATUS[$s]}\", \"seconds\": ${SECS[$s]}, \"estimate_s\": ${ESTIMATE[$s]},\
 \"timeout_s\": ${LIMIT[$s]}, \"log\": \"${LOG[$s]}\"}"
done
SUMMARY='{"mode": "%s", "out": "%s", "python": "%s", "planned_timeout_s": %d, "exit_status": %d,\n'
SUMMARY+=' "stages": [\n  %s\n ]}\n'
printf "$SUMMARY" \
  "$([[ $DRY == 1 ]] && echo dry-run || echo run)" "$OUT" "$PY" "$TOTAL" "$RC" "$ENTRIES" > "$OUT/summary.json"
echo "summary ($OUT/summary.json):"
for s in "${STAGES[@]}"; do
  printf '  %-11s %-9s %4ss (estimate %ss, timeout %ss)\n' "$s" "${STATUS[$s]}" "${SECS[$s]}" "${ESTIMATE[$s]}" \
    "${LIMIT[$s]}"
done
echo "exit status $RC"
exit $RC
