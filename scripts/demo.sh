#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the CPU default. Extra arguments are passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m hilore_actor.demo "$@"
