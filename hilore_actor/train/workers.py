"""Rollout and reference workers of the training job (``ray.remote`` wraps these classes).

- ``HFRolloutWorker``: HF ``generate`` (CPU, or GPU without vLLM); holds the same peft model
  as the learner and receives the adapter (or full weights) after every update.
- ``VLLMRolloutWorker``: a vLLM engine (GPU); receives merged weights through a vLLM worker
  extension, in bounded chunks (``vllm_sync.py``). vLLM is imported here, when the worker
  starts, never at module level.
- ``ReferenceWorker``: the frozen base model; reference log-probs for the KL term.
"""

from __future__ import annotations

import os
from typing import Dict, List, Sequence

import torch

from .config import hierarchize, param_dtype, worker_device
from ..learner.fault_injection import injected, reconstructed


def _fault(index: int, step: int) -> None:
    """``HILORE_FAULT=rollout:<worker>:<step>`` (``faults.py``): the worker dies (a hard exit)
    in that step's ``generate``, once: the copy Ray restarts does not."""
    if injected("rollout", index, step) and not reconstructed():
        os._exit(17)


def _threads(cfg) -> None:
    if not torch.cuda.is_available():
        torch.set_num_threads(cfg.threads or os.cpu_count() or 1)


class HFRolloutWorker:
    """HF ``generate`` on a plain copy of the policy: with LoRA, the learner sends the base
    weights with the LoRA deltas merged in (``models.weights``, exact and deterministic), so
    sampling runs no LoRA branch; all of a step's prompts go through one batched call."""

    def __init__(self, flat_cfg: Dict, index: int):
        from ..models.source import load_policy

        self.cfg = hierarchize(flat_cfg)
        _threads(self.cfg)
        self.index = index
        self.device = worker_device()
        self.model, self.tok = load_policy(
            self.cfg.actor.model_name_or_path, dtype=param_dtype(self.cfg), lora=None, seed=self.cfg.train.seed
        )
        self.model.to(self.device).eval()

    def weight_kind(self) -> str:
        return "merged" if self.cfg.ds.lora.rank > 0 else "full"

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        from ..models.weights import load_weights

        load_weights(self.model, {k: v.to(self.device) for k, v in weights.items()}, self.weight_kind())

    def generate(self, prompts: Sequence[str], seed: int, step: int = -1, greedy: bool = False) -> Dict:
        """G sampled responses per prompt; ``greedy`` (held-out evaluation): one argmax response each."""
        from ..rollout.hf_generate import generate_groups

        _fault(self.index, step)
        c = self.cfg.rollout
        r = generate_groups(
            self.model,
            self.tok,
            prompts,
            1 if greedy else c.n_samples_per_prompt,
            c.max_new_tokens,
            c.temperature,
            seed,
            c.top_p,
            batched=True,
            greedy=greedy,
            chat_template=self.cfg.data.apply_chat_template,
        )
        return {
            "sequences": r.sequences.cpu(),
            "prompt_lens": r.prompt_lens,
            "response_lens": r.response_lens,
            "texts": r.texts,
        }


class VLLMRolloutWorker:
    """A vLLM engine. Weight sync loads merged HF-named tensors into the engine's model by
    name through ``vllm_sync.WeightSyncExtension`` (no pickled function, no message over
    ``vllm_sync.CHUNK_BYTES`` per tensor group). The engine is not exercised on CPU (vLLM's
    kernels are CUDA-only; see docs/testing.md, "What is tested where"); the sync is, against
    a stand-in engine (tests/train/test_vllm_sync.py)."""

    def __init__(self, flat_cfg: Dict, index: int):
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(f"--vllm.num_engines > 0 needs vllm (pip install 'hilore-actor[gpu]'): {e}") from None
        from ..models.smollm2 import convert_smollm2
        from .vllm_sync import EXTENSION

        self.cfg = hierarchize(flat_cfg)
        spec = self.cfg.actor.model_name_or_path
        path = str(convert_smollm2()) if spec == "smollm2" else spec
        self.llm = vllm.LLM(
            model=path,
            tensor_parallel_size=self.cfg.vllm.tensor_parallel_size,
            seed=self.cfg.train.seed,
            gpu_memory_utilization=self.cfg.vllm.gpu_memory_utilization,
            dtype="bfloat16" if self.cfg.ds.param_dtype == "bf16" else "auto",
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,
        )
        self.tok = self.llm.get_tokenizer()

    def weight_kind(self) -> str:
        return "merged" if self.cfg.ds.lora.rank > 0 else "full"

    def load_weights(self, weights: Dict[str, torch.Tensor]) -> None:
        from .vllm_sync import sync_weights

        sync_weights(self.llm, weights)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def generate(self, prompts: Sequence[str], seed: int, step: int = -1, greedy: bool = False) -> Dict:
        """G sampled responses per prompt; ``greedy`` (held-out evaluation): one at temperature 0 each."""
        import vllm

        _fault(self.index, step)
        from ..rollout.hf_generate import apply_chat

        c = self.cfg.rollout
        ids = [apply_chat(self.tok, p, self.cfg.data.apply_chat_template) for p in prompts]
        params = vllm.SamplingParams(
            n=1 if greedy else c.n_samples_per_prompt,
            temperature=0.0 if greedy else c.temperature,
            top_p=1.0 if greedy else c.top_p,
            max_tokens=c.max_new_tokens,
            seed=seed,
        )
        outs = self.llm.generate([vllm.TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
        seqs, plens, rlens, texts = [], [], [], []
        for p_ids, o in zip(ids, outs):
            for comp in o.outputs:
                resp = list(comp.token_ids)
                seqs.append(torch.tensor(p_ids + resp))
                plens.append(len(p_ids))
                rlens.append(len(resp))
                texts.append(comp.text)
        L = max(len(s) for s in seqs)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        padded = torch.full((len(seqs), L), pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            padded[i, : len(s)] = s
        return {"sequences": padded, "prompt_lens": plens, "response_lens": rlens, "texts": texts}


class ReferenceWorker:
    def __init__(self, flat_cfg: Dict):
        from ..models.source import load_policy

        self.cfg = hierarchize(flat_cfg)
        _threads(self.cfg)
        self.device = worker_device()
        self.model, _ = load_policy(
            self.cfg.actor.model_name_or_path, dtype=param_dtype(self.cfg), seed=self.cfg.train.seed
        )
        self.model.to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def log_probs(self, rows: List[Dict]) -> List[torch.Tensor]:
        from ..models.logprobs import sequence_log_probs

        return [
            sequence_log_probs(
                self.model, r["input_ids"].to(self.device), position_ids=r["position_ids"].to(self.device)
            )
            .float()
            .cpu()
            for r in rows
        ]
