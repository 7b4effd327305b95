"""Rollout and reference workers of the training job (``ray.remote`` wraps these classes).

- ``HFRolloutWorker``: HF ``generate`` (CPU, or GPU without vLLM); holds a plain copy of the
  policy and receives the merged weights under LoRA (or the full weights) after every update.
- ``VLLMRolloutWorker``: a vLLM engine (GPU); under LoRA it serves the learner's adapter
  (vLLM's own LoRA path, a new adapter id per update), under full fine-tuning it receives the
  weights through a vLLM worker extension, in bounded chunks (``vllm_sync.py``). vLLM is
  imported here, when the worker starts, never at module level.
- ``ReferenceWorker``: the frozen base model; reference log-probs for the KL term.
"""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence

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

    def load_weights(self, weights: Dict[str, torch.Tensor], adapter_config: Optional[Dict] = None) -> int:
        """Returns the bytes received (``adapter_config``: only a vLLM engine serving LoRA reads it)."""
        from ..models.weights import load_weights
        from .vllm_sync import payload_bytes

        load_weights(self.model, {k: v.to(self.device) for k, v in weights.items()}, self.weight_kind())
        return payload_bytes(weights)

    def generate(self, prompts: Sequence[str], seed: int, step: int = -1, greedy: bool = False, progress=None) -> Dict:
        """G sampled responses per prompt; ``greedy`` (held-out evaluation): one argmax response each.
        ``progress``: told how decoding goes (``progress.Reporter``; an argument of the call, not of the
        actor, whose constructor arguments Ray must keep to restart it)."""
        from ..rollout.hf_generate import generate_groups

        _fault(self.index, step)
        c = self.cfg.rollout
        t0, what = time.perf_counter(), "evaluating" if greedy else "generating"
        told = (lambda n, total: progress.phase(what, n, total, t0)) if progress is not None else None
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
            progress=told,
        )
        return {
            "sequences": r.sequences.cpu(),
            "prompt_lens": r.prompt_lens,
            "response_lens": r.response_lens,
            "texts": r.texts,
        }


class VLLMRolloutWorker:
    """A vLLM engine. Under LoRA (``weight_kind`` "adapter") the engine starts with LoRA enabled
    at the run's rank and keeps its base weights; each sync loads the learner's adapter under a
    new id (``vllm_sync.AdapterSync``) and ``generate`` names it. Under full fine-tuning (or a
    rank above vLLM's largest ``max_lora_rank``: merged weights) the sync loads HF-named tensors
    into the engine's model by name through ``vllm_sync.WeightSyncExtension`` (no pickled
    function, no message over ``vllm_sync.CHUNK_BYTES`` per tensor group). The engine is not
    exercised on CPU (vLLM's kernels are CUDA-only; see docs/testing.md, "What is tested
    where"); the sync is, against a stand-in engine (tests/train/test_vllm_sync.py)."""

    def __init__(self, flat_cfg: Dict, index: int):
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(f"--vllm.num_engines > 0 needs vllm (pip install 'hilore-actor[gpu]'): {e}") from None
        from vllm.lora.request import LoRARequest

        from ..models.smollm2 import convert_smollm2
        from .vllm_sync import EXTENSION, AdapterSync, engine_lora_args, lora_ranks

        self.cfg = hierarchize(flat_cfg)
        spec = self.cfg.actor.model_name_or_path
        path = str(convert_smollm2()) if spec == "smollm2" else spec
        self.kind = vllm_weight_kind(self.cfg.ds.lora.rank, lora_ranks())
        lora, self.adapter = {}, None
        if self.kind == "adapter":
            lora, self.adapter = engine_lora_args(self.cfg.ds.lora.rank, lora_ranks()), AdapterSync(LoRARequest)
        elif self.kind == "merged":
            print(
                f"[vllm] LoRA rank {self.cfg.ds.lora.rank} is above vLLM's largest max_lora_rank "
                f"{max(lora_ranks())}: the engine gets the merged weights after every update",
                flush=True,
            )
        self.llm = vllm.LLM(
            model=path,
            tensor_parallel_size=self.cfg.vllm.tensor_parallel_size,
            seed=self.cfg.train.seed,
            gpu_memory_utilization=self.cfg.vllm.gpu_memory_utilization,
            dtype="bfloat16" if self.cfg.ds.param_dtype == "bf16" else "auto",
            enable_prefix_caching=True,
            worker_extension_cls=EXTENSION,
            **lora,
        )
        self.tok = self.llm.get_tokenizer()

    def weight_kind(self) -> str:
        return self.kind

    def weight_dtype(self) -> str:
        """The dtype the engine computes in (an adapter's too: vLLM's ``lora_dtype`` "auto")."""
        return str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def load_weights(self, weights: Dict[str, torch.Tensor], adapter_config: Optional[Dict] = None) -> int:
        """The learner's update into the engine; returns the bytes sent to it. Under LoRA:
        ``weights`` is the adapter, ``adapter_config`` its PEFT config."""
        from .vllm_sync import sync_weights

        if self.kind == "adapter":
            if adapter_config is None:
                raise ValueError("an adapter sync needs the adapter's PEFT config")
            sent = self.adapter.load(self.llm, weights, adapter_config)
        else:
            sent = sync_weights(self.llm, weights)
        # cached KV blocks were computed with the old weights (under LoRA their hashes hold the old
        # adapter's name, so they would never match again: this frees them at once)
        self.llm.reset_prefix_cache()
        return sent

    def generate(self, prompts: Sequence[str], seed: int, step: int = -1, greedy: bool = False, progress=None) -> Dict:
        """G sampled responses per prompt; ``greedy`` (held-out evaluation): one at temperature 0 each.
        ``progress``: told that the engine generates, for how many prompts (the engine batches them all)."""
        import vllm

        _fault(self.index, step)
        from ..rollout.hf_generate import apply_chat

        if progress is not None:
            progress.phase("evaluating" if greedy else "generating, prompts", 0, len(prompts))
        c = self.cfg.rollout
        ids = [apply_chat(self.tok, p, self.cfg.data.apply_chat_template) for p in prompts]
        params = vllm.SamplingParams(
            n=1 if greedy else c.n_samples_per_prompt,
            temperature=0.0 if greedy else c.temperature,
            top_p=1.0 if greedy else c.top_p,
            max_tokens=c.max_new_tokens,
            seed=seed,
        )
        prompts_in = [vllm.TokensPrompt(prompt_token_ids=x) for x in ids]
        lora = self.adapter.request if self.adapter is not None else None
        outs = self.llm.generate(prompts_in, params, use_tqdm=False, lora_request=lora)
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


def vllm_weight_kind(lora_rank: int, ranks: Sequence[int]) -> str:
    """What a vLLM engine receives: the adapter under LoRA, merged weights for a rank above
    every ``max_lora_rank`` vLLM accepts (``ranks``), every weight under full fine-tuning."""
    from .vllm_sync import max_lora_rank

    if lora_rank <= 0:
        return "full"
    return "adapter" if max_lora_rank(lora_rank, ranks) is not None else "merged"


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
