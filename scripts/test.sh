#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite: the unit and integration tiers, every test
# not marked slow (pytest.ini; docs/testing.md). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
"${VENV:-.venv}/bin/ruff" check --select F,E9 hilore_actor benchmarks tests  # undefined names, unused imports, syntax
"${VENV:-.venv}/bin/ruff" format --check --quiet hilore_actor benchmarks tests  # ruff.toml: lines of at most 120
exec "${VENV:-.venv}/bin/python" -m pytest -q "$@"
