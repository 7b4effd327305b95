#!/usr/bin/env bash
# Start a local Ray head bound to 127.0.0.1, submit the training job with `ray job submit`,
# wait for it, and stop only this head. Arguments go to train_grpo (default: --preset tiny).
#
#   bash ray_jobs/submit_local.sh                         # tiny preset, 2 steps
#   bash ray_jobs/submit_local.sh --preset cpu-demo       # the README's demo, as a Ray job
#
# What Ray 2.55+ needs here:
#   - `ray[default]` (plain `ray` cannot start a head: the dashboard packages are missing);
#   - token authentication is on by default: the client needs RAY_AUTH_MODE=token, and
#     RAY_API_SERVER_ADDRESS (or --address) pointing at the dashboard, http://127.0.0.1:<port>;
#   - the entrypoint names the venv's python by full path (plain `python` on the head may be
#     another interpreter).
# `ray stop` would stop every Ray process on the machine; this script kills only the
# processes of its own head (found by its private temp dir).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$(cd "$(dirname "${PYTHON:-${VENV:-.venv}/bin/python}")" && pwd)/$(basename "${PYTHON:-${VENV:-.venv}/bin/python}")"
RAY="$(dirname "$PY")/ray"
[ -x "$PY" ] || { echo "no python at $PY: run scripts/setup.sh first, or set PYTHON=/path/to/python" >&2; exit 2; }
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GCS_PORT=$(free_port); DASH_PORT=$(free_port)
# short path: Ray's unix sockets must fit in 107 bytes
RAY_TMP=$(mktemp -d /tmp/hlray.XXXX)
cleanup() { pkill -f "$RAY_TMP" 2>/dev/null || true; sleep 1; pkill -9 -f "$RAY_TMP" 2>/dev/null || true; rm -rf "$RAY_TMP"; }
trap cleanup EXIT
"$RAY" start --head --node-ip-address=127.0.0.1 --port="$GCS_PORT" --dashboard-host=127.0.0.1 \
  --dashboard-port="$DASH_PORT" --num-cpus="$(nproc)" --disable-usage-stats --temp-dir="$RAY_TMP" >"$RAY_TMP.start.log" 2>&1 \
  || { cat "$RAY_TMP.start.log" >&2; exit 1; }
export RAY_AUTH_MODE=token RAY_API_SERVER_ADDRESS="http://127.0.0.1:$DASH_PORT"
[ $# -gt 0 ] || set -- --preset tiny
# --working-dir is not needed: the package is installed in the venv the workers run from.
"$RAY" job submit --runtime-env-json "{\"env_vars\": {\"DS_ACCELERATOR\": \"cpu\"}}" -- \
  "$PY" -m hilore_actor.train_grpo "$@"
