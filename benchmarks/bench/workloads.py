"""Benchmark workloads, pinned so numbers stay comparable over time (issue: benchmark)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict

import torch


@dataclass(frozen=True)
class Workload:
    name: str
    arch: str
    model: Dict = field(default_factory=dict)  # tiny_config overrides
    dtype: str = "float32"
    microbatches: int = 2  # per update
    tokens: int = 1024  # per packed microbatch
    group_size: int = 8
    prompt_frac: float = 0.2
    lora_rank: int = 16
    lora_alpha: int = 32
    kl_coef: float = 0.001
    kl_estimator: str = "k3"
    calib_tokens: int = 512  # calibration microbatches may be shorter: kappa and e_bar are ratios
    source: str = "tiny"  # "tiny": random weights of ``model``'s shape, random tokens; "smollm2": real weights and text
    lora_b_std: float = (
        1e-3  # LoRA B starts at N(0, std), seeded, as after training (peft's B = 0 zeroes lora_A's gradient)
    )
    note: str = ""

    def describe(self) -> Dict:
        return asdict(self)

    @property
    def torch_dtype(self):
        return getattr(torch, self.dtype)


WORKLOADS = {
    "cpu-small": Workload(
        "cpu-small",
        "qwen2",
        dict(hidden_size=256, intermediate_size=1408, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=8192),
        tokens=1024,
        note="quick checks; gc + hilore in under 2 minutes on 2 cores",
    ),
    "cpu-ref": Workload(
        "cpu-ref",
        "qwen2",
        dict(
            hidden_size=512,
            intermediate_size=2816,
            num_layers=12,
            num_heads=8,
            num_kv_heads=2,
            vocab_size=32768,
            tie_word_embeddings=False,
        ),
        tokens=2048,
        calib_tokens=1024,
        note="the reference on CPU",
    ),
    "cpu-real": Workload(
        "cpu-real",
        "llama",
        source="smollm2",
        tokens=2048,
        calib_tokens=1024,
        note="the bundled SmolLM2-135M-Instruct, real weights, real prompts and self-sampled responses",
    ),
    "gpu-ref": Workload(
        "gpu-ref",
        "qwen2",
        dict(
            hidden_size=2048,
            intermediate_size=11008,
            num_layers=36,
            num_heads=16,
            num_kv_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
        dtype="bfloat16",
        microbatches=4,
        tokens=4096,
        calib_tokens=1024,
        note="Qwen2.5-3B shape, random weights, for one GPU",
    ),
}
