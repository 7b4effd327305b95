#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the CPU default: the Ray GRPO training job
# on the bundled SmolLM2-135M-Instruct (--preset cpu-demo). Extra arguments are passed on. Its last
# line names the run's report page (python -m hilore_actor.report writes it again from the run folder).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# keep freed memory in the process (glibc otherwise returns it and re-faults every
# activation page each step, a CPU-only tax on storing that a GPU's caching allocator has not)
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=17179869184}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
exec "${VENV:-.venv}/bin/python" -m hilore_actor.train_grpo --preset cpu-demo "$@"
