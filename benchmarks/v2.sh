#!/usr/bin/env bash
# The committed benchmark v2 runs, one per argument, each its own process:
#   cpu-small-sweep   view (a): --budget-from gc, device scope, budgets 1.05..2.0
#   cpu-ref-a         view (a) at 1.10 and 1.25          cpu-real-a   the same on real weights
#   cpu-ref-b         view (b): --budget-from gc+full at 1.10, plus the gc+full row
#   cpu-real-b        the same on real weights
#   cpu-ref-allr      gc, hilore-hr, hilore head for head at 1.10 (activation scope): all-R plans against gc
#   cpu-small-p       a first look at P: gc, hilore-hr, hilore-hr-p (P offered) at 1.25 and 1.5
#   cpu-small-2codec  hilore with two L levels (int8-g64 and bf16) within B and the tolerance
#   cpu-real-p110    P at 1.10: gc, hilore-coarse, hilore at 1.10 on real weights, with P's
#                    saving measured on the whole microbatch and both P levels (P, P:core) offered
#                    (cpu-real-a's calibration reused; about 80 minutes)
#   cpu-ref-compile   view (b) at 1.10 with compiled units on cpu-ref (random weights; about 45 minutes)
#   cpu-real-compile  view (b) at 1.10 with compiled units: gc, gc+compile, hilore+compile and
#                    compile-budget, the +compile rows timed inside compile-budget's phase (paired)
#   cpu-real-compile-regions  the same with compiled layer regions (--compile-layer-regions) whose
#                    graphs trade memory as compile-budget's did in cpu-real-compile
#                    (--compile-activation-budget 0.9375, the activation_memory_budget it chose there);
#                    one update a timed repeat, so that it fits in about an hour
#   cpu-real-compile-a  view (a) at 1.10 with the same compiled layer regions: gc, gc+compile and
#                    hilore+compile (the aim against gc+compile), one update a repeat (about 50 minutes)
#   cpu-real-power    view (a) at 1.10 and 1.25, gc and hilore only (gc-aa beside them), in pieces
#                    of 8 repeats: cpu-real-power:1 .. :N, then cpu-real-power:pool pools every
#                    piece's paired ratios (merge --pool); about an hour a piece; REPEATS=N sets a
#                    piece's repeats (default 8: about 20 minutes of planning, then 3.4 minutes a repeat)
# hilore (P and token L offered) runs beside hilore-coarse (whole-unit H/L/R) in every run of
# every method (ALL).
# A run too long for one sitting goes in pieces: RUN:1 .. RUN:5 each time some of the methods
# beside their own gc (sharing one calibration file), then RUN:merge combines the pieces that
# exist (python -m benchmarks.bench.merge; it refuses pieces that measured different inputs).
# Every view (a) and (b) run runs HiLoRe without the leave-one-out check (--no-loo): three paired updates cannot
# resolve a unit's 1-3% saving on this CPU, and each run's plan is then what the allocation chose.
# Usage: bash benchmarks/v2.sh RUN [RUN ...]   (writes benchmarks/results/RUN.{json,png,md,log})
# Freed memory stays in the process (GLIBC_TUNABLES), as a GPU's caching allocator keeps it:
# otherwise every step re-faults its activation pages, a tax on storing that a GPU does not pay.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUTDIR=${OUTDIR:-benchmarks/results}
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184}
export PYTHONUNBUFFERED=1
ALL=no-gc,gc,gc+full,sac,sac-budget,compile-budget,all-l,hilore-hr,hilore-static,hilore-coarse,hilore
PIECES=(no-gc,gc,gc+full,sac gc,sac-budget gc,hilore-coarse,hilore gc,compile-budget gc,all-l,hilore-hr,hilore-static)
mkdir -p "$OUTDIR"
for spec in "$@"; do
  run=${spec%%:*} only= repeats=7 updates=3
  piece=${spec#"$run"}; piece=${piece#:}
  case "$run" in
    cpu-small-sweep) a=(--workload cpu-small --budgets 1.05,1.10,1.25,1.5,2.0 --calib 4 --calib-tokens 512 --no-loo) ;;
    cpu-ref-a)  a=(--workload cpu-ref --budgets 1.10,1.25 --calib 2 --calib-tokens 512 --no-loo) ;;
    cpu-real-a) a=(--workload cpu-real --budgets 1.10,1.25 --calib 2 --calib-tokens 512 --no-loo) ;;
    cpu-ref-b)  a=(--workload cpu-ref --budget-from gc+full --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo) ;;
    cpu-real-b) a=(--workload cpu-real --budget-from gc+full --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo) ;;
    # head for head at 1.10 in the activation scope nothing fits, so HiLoRe's plan is all-R
    cpu-ref-allr) a=(--workload cpu-ref --budget-scope activations --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo)
                  only=gc,hilore-hr,hilore ;;
    cpu-small-p) a=(--workload cpu-small --budgets 1.25,1.5)
                 only=gc,hilore-hr,hilore-hr-p ;;
    cpu-real-p110) a=(--workload cpu-real --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo
                      --calibration "$OUTDIR/cpu-real-a.calibration.json")
                   only=gc,hilore-coarse,hilore ;;
    cpu-small-2codec) a=(--workload cpu-small --budgets 1.10,1.25,1.5 --codec int8-g64,bf16)
                      only=gc,all-l,hilore-static,hilore ;;
    cpu-ref-compile) a=(--workload cpu-ref --budget-from gc+full --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo
                        --bisect-steps 2 --calibration "$OUTDIR/cpu-ref-a.calibration.json")
                     only=gc,gc+compile,hilore+compile,compile-budget ;;
    cpu-real-compile) a=(--workload cpu-real --budget-from gc+full --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo
                         --bisect-steps 2 --calibration "$OUTDIR/cpu-real-a.calibration.json")
                      only=gc,gc+compile,hilore+compile,compile-budget ;;
    cpu-real-compile-regions) a=(--workload cpu-real --budget-from gc+full --budgets 1.10 --calib 2 --calib-tokens 512
                                 --no-loo --bisect-steps 2 --compile-layer-regions --compile-activation-budget 0.9375
                                 --calibration "$OUTDIR/cpu-real-a.calibration.json")
                              only=gc,gc+compile,hilore+compile,compile-budget updates=1 ;;
    cpu-real-compile-a) a=(--workload cpu-real --budgets 1.10 --calib 2 --calib-tokens 512 --no-loo
                           --compile-layer-regions --compile-activation-budget 0.9375
                           --calibration "$OUTDIR/cpu-real-a.calibration.json")
                        only=gc,gc+compile,hilore+compile updates=1 ;;
    cpu-real-power) a=(--workload cpu-real --budgets 1.10,1.25 --calib 2 --calib-tokens 512 --no-loo
                       --calibration "$OUTDIR/cpu-real-a.calibration.json")
                    only=gc,hilore repeats=${REPEATS:-8} ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
  if [ "$piece" = pool ]; then  # pieces that are repeats of one run
    "$PY" -m benchmarks.bench.merge --pool "$OUTDIR/$run".[0-9]*.json \
      --json "$OUTDIR/$run.json" --plot "$OUTDIR/$run.png" --markdown "$OUTDIR/$run.md"
    continue
  fi
  if [ "$piece" = merge ]; then
    "$PY" -m benchmarks.bench.merge "$OUTDIR/$run".[0-9].json \
      --json "$OUTDIR/$run.json" --plot "$OUTDIR/$run.png" --markdown "$OUTDIR/$run.md"
    continue
  fi
  methods=${only:-$ALL} name=$run
  if [ "$run" = cpu-real-power ]; then
    [ -n "$piece" ] || { echo "cpu-real-power runs in pieces: cpu-real-power:1, :2, ... then :pool" >&2; exit 2; }
    name=$run.$piece piece=
  fi
  if [ -n "$piece" ]; then
    methods=${PIECES[$((piece - 1))]} name=$run.$piece
    calib=$run  # view (b) shares view (a)'s calibration: same workload, inputs and rows; risk does not depend on B
    case "$run" in *-b) calib=${run%-b}-a ;; esac
    a+=(--calibration "$OUTDIR/$calib.calibration.json")
  fi
  "$PY" -m benchmarks.bench "${a[@]}" --methods "$methods" --repeats "$repeats" --updates "$updates" \
    --json "$OUTDIR/$name.json" --plot "$OUTDIR/$name.png" --markdown "$OUTDIR/$name.md" 2>&1 \
    | grep --line-buffered -v '^USDT' | tee "$OUTDIR/$name.log"
done
