"""The training job's vLLM weight sync (``train/vllm_sync.py``) against a stand-in engine.

``FakeLLM`` does what vLLM V1 does between ``LLM.collective_rpc`` and a worker without
``VLLM_ALLOW_INSECURE_SERIALIZATION``: the call goes through msgpack (a function or a tensor
in the arguments is refused: vLLM's encoder refuses functions, and a tensor in an untyped
utility argument would not come back as a tensor), then the method is looked up by name on a
worker class that has the extension mixed in, as vLLM's ``WorkerWrapperBase.init_worker`` does.
"""

import subprocess
import sys

import msgpack
import pytest
import torch

from hilore_actor.models import build_model, tiny_config
from hilore_actor.train import vllm_sync
from hilore_actor.train.workers import VLLMRolloutWorker


def _refuse(obj):
    kind = "a tensor (it would arrive as [dtype, shape, buffer index])" if isinstance(obj, torch.Tensor) else type(obj)
    raise TypeError(f"not msgpack-serialisable without insecure serialisation: {kind}")


class FakeWorkerBase:
    """vLLM's GPU worker, as far as the extension sees it: ``model_runner.model`` and ``device``."""

    def __init__(self, model):
        self.device = torch.device("cpu")
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = model


class FakeModel(torch.nn.Module):
    """An HF model with vLLM's ``load_weights``: copy by name, skipping ``lm_head.`` when tied
    (vLLM's ``AutoWeightsLoader(skip_prefixes=["lm_head."])``)."""

    def __init__(self, hf):
        super().__init__()
        self.hf, self.loaded = hf, []

    def load_weights(self, weights):
        params = dict(self.hf.named_parameters())
        tied = self.hf.config.tie_word_embeddings
        for name, t in weights:
            self.loaded.append(name)
            if tied and name.startswith("lm_head."):
                continue
            with torch.no_grad():
                params[name].copy_(t)


class FakeLLM:
    def __init__(self, model, tied):
        self.worker = type("Worker", (FakeWorkerBase, vllm_sync.WeightSyncExtension), {})(model)
        self.llm_engine = type("Engine", (), {"model_config": type("MC", (), {"hf_config": model.hf.config})()})()
        assert tied == model.hf.config.tie_word_embeddings
        self.calls = []  # (method, bytes on the wire)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if not isinstance(method, str):
            raise TypeError("a function method needs VLLM_ALLOW_INSECURE_SERIALIZATION=1")
        wire = msgpack.packb([method, list(args), kwargs or {}], use_bin_type=True, default=_refuse)
        self.calls.append((method, len(wire)))
        name, a, kw = msgpack.unpackb(wire, raw=False)
        result = getattr(self.worker, name)(*a, **kw)
        msgpack.packb(result, default=_refuse)  # the reply is plain msgpack too
        return [result]

    def apply_model(self, fn):
        return self.collective_rpc(fn)

    def reset_prefix_cache(self):
        self.reset = True


def _worker(tied):
    seed = torch.seed() % 2**31
    print("seed", seed)
    cfg = tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=512, tie_word_embeddings=tied)
    engine_model = FakeModel(build_model(cfg, seed=seed))
    learner = build_model(cfg, seed=seed + 1)
    w = object.__new__(VLLMRolloutWorker)
    w.llm = FakeLLM(engine_model, tied)
    # the learner's export (models.weights): a CPU copy per name, so a tied head is an equal copy
    return w, engine_model, {k: v.detach().clone() for k, v in learner.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_weights_arrive_by_name_in_bounded_chunks(tied, monkeypatch):
    limit = 64 * 1024
    monkeypatch.setattr(vllm_sync, "CHUNK_BYTES", limit)
    w, engine_model, weights = _worker(tied)
    w.load_weights(weights)
    got = engine_model.hf.state_dict()
    assert all(torch.equal(got[k], v) for k, v in weights.items())
    assert w.llm.reset
    methods = {m for m, _ in w.llm.calls}
    assert methods == {vllm_sync.RPC_METHOD}
    largest = max(v.numel() * v.element_size() for v in weights.values())
    overhead = 4096  # names, dtypes, shapes of one chunk
    assert all(n <= max(limit, largest) + overhead for _, n in w.llm.calls), w.llm.calls
    assert len(w.llm.calls) > 1
    heads = [n for n in engine_model.loaded if n == "lm_head.weight"]
    assert heads == ([] if tied else ["lm_head.weight"])
    assert sorted(engine_model.loaded) == sorted(k for k in weights if not (tied and k == "lm_head.weight"))


def test_the_lambda_sync_is_what_msgpack_refuses():
    """What the job did before: a function through ``apply_model``; without insecure
    serialisation vLLM's encoder refuses it, as the stand-in does."""
    w, _, weights = _worker(False)
    items = list(weights.items())
    with pytest.raises(TypeError, match="INSECURE"):
        w.llm.apply_model(lambda model: model.load_weights(items))


def test_chunks_round_trip_dtypes_and_shapes():
    ts = {
        "a": torch.randn(3, 5).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.tensor(2.5),
        "d": torch.empty(0, 4),
        "e": torch.randn(4, 6)[:, ::2],
    }
    out = dict(vllm_sync.decode(e) for g in vllm_sync.chunks(ts, max_bytes=16) for e in g)
    assert list(out) == list(ts)
    for k, v in ts.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v.contiguous())


def test_a_tied_head_that_differs_is_refused():
    e = torch.randn(8, 4)
    with pytest.raises(ValueError, match="differs"):
        vllm_sync.without_tied_head({"model.embed_tokens.weight": e, "lm_head.weight": e + 1}, tied=True)
    shared = {"model.embed_tokens.weight": e, "lm_head.weight": e}
    assert list(vllm_sync.without_tied_head(shared, tied=True)) == ["model.embed_tokens.weight"]
    assert list(vllm_sync.without_tied_head(shared, tied=False)) == list(shared)


def test_the_extension_imports_no_vllm():
    code = "import sys; import hilore_actor.train.vllm_sync, hilore_actor.train.workers; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
