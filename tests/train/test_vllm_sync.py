"""The training job's vLLM weight sync (``train/vllm_sync.py``) against a stand-in engine.

``FakeLLM`` does what vLLM V1 does between ``LLM.collective_rpc`` and a worker without
``VLLM_ALLOW_INSECURE_SERIALIZATION``: the call goes through msgpack (a function or a tensor
in the arguments is refused: vLLM's encoder refuses functions, and a tensor in an untyped
utility argument would not come back as a tensor), then the method is looked up by name on a
worker class that has the extension mixed in, as vLLM's ``WorkerWrapperBase.init_worker`` does.

Under LoRA, ``FakeLoRAEngine`` does what vLLM 0.29 does between ``LLMEngine.add_lora`` and its CPU
adapter cache (``LRUCacheWorkerLoRAManager.add_adapter`` -> ``_load_adapter``: ``PEFTHelper``
reads and validates ``adapter_config.json``, ``LoRAModel.from_local_checkpoint`` reads the
safetensors file, refuses modules the model cannot serve, casts to the LoRA dtype; a new id past
``max_cpu_loras`` evicts the oldest). The job's side runs as it is: ``Job.sync_form`` and
``Job.sync_weights`` over stand-in Ray handles (arguments pickled, as Ray does), the learner's
``export_weights`` and ``adapter_config`` on a peft model after an optimizer step.
"""

import json
import math
import os
import pickle
import subprocess
import sys
import types
from collections import OrderedDict
from dataclasses import dataclass

import msgpack
import pytest
import torch

from hilore_actor.models import build_model, tiny_config
from hilore_actor.models.factory import LoraSpec
from hilore_actor.train import vllm_sync
from hilore_actor.train.job import Job
from hilore_actor.train.learner import Learner
from hilore_actor.train.workers import VLLMRolloutWorker, vllm_weight_kind


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


@dataclass
class FakeLoRARequest:
    """vLLM 0.29's ``LoRARequest`` fields the sync uses (``vllm/lora/request.py``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"id must be > 0, got {self.lora_int_id}")
        assert self.lora_path, "lora_path cannot be empty"


# Qwen2ForCausalLM's LoRA modules in vLLM 0.29: its LinearBase layers (qkv_proj, o_proj, gate_up_proj,
# down_proj), packed ones expanded by packed_modules_mapping; no embedding_modules (no embedding or head LoRA)
QWEN2_LORA_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


class FakeLoRAEngine:
    """``LLMEngine.add_lora`` of vLLM 0.29 down to the worker's CPU adapter cache (module docstring)."""

    def __init__(self, max_lora_rank, max_cpu_loras=1, dtype=torch.bfloat16, modules=QWEN2_LORA_MODULES):
        self.max_lora_rank, self.capacity, self.dtype, self.modules = max_lora_rank, max_cpu_loras, dtype, modules
        self.cache = OrderedDict()  # id -> (scaling, {module: [A, B]})
        self.added = []

    def load(self, request):
        from safetensors import safe_open

        path = request.lora_path
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
        missing = {"r", "lora_alpha", "target_modules"} - set(cfg)
        if missing:
            raise ValueError(f"Missing required configuration fields: {missing}")
        errors = []
        if cfg.get("modules_to_save"):
            errors.append("vLLM only supports modules_to_save being None.")
        if cfg.get("use_dora"):
            errors.append("vLLM does not yet support DoRA.")
        if cfg["r"] > self.max_lora_rank:
            errors.append(f"LoRA rank {cfg['r']} is greater than max_lora_rank {self.max_lora_rank}.")
        if cfg.get("bias", "none") != "none":
            errors.append("Adapter bias is not supported.")
        if errors:
            raise ValueError(" ".join(errors))
        scaling = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg.get("use_rslora") else cfg["r"])
        loras = {}
        with safe_open(os.path.join(path, "adapter_model.safetensors"), framework="pt") as f:
            for key in f.keys():
                name = key.removeprefix("base_model.model.")
                parts = name.split(".")
                if parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
                    raise ValueError(f"{name} is unsupported LoRA weight")
                module = ".".join(parts[:-2])
                if module.rsplit(".", 1)[-1] not in self.modules:
                    raise ValueError(f"expected target modules in {self.modules} but received {[module]}")
                loras.setdefault(module, [None, None])[parts[-2] == "lora_B"] = f.get_tensor(key).to(self.dtype)
        return scaling, loras

    def add_lora(self, request):
        assert request.lora_int_id > 0, "lora_id must be greater than 0."
        if request.lora_int_id not in self.cache:
            lora = self.load(request)
            if len(self.cache) + 1 > self.capacity:
                self.cache.popitem(last=False)
            self.cache[request.lora_int_id] = lora
            self.added.append(request)
        self.cache.move_to_end(request.lora_int_id)
        return True


class FakeLLM:
    def __init__(self, model, tied, lora=None):
        self.worker = type("Worker", (FakeWorkerBase, vllm_sync.WeightSyncExtension), {})(model)
        mc = type("MC", (), {"hf_config": model.hf.config, "dtype": lora.dtype if lora else torch.float32})()
        self.llm_engine = lora or type("Engine", (), {})()
        self.llm_engine.model_config = mc
        assert tied == model.hf.config.tie_word_embeddings
        self.calls = []  # (method, bytes on the wire)
        self.generated = []  # the lora_request of each generate call

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

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        """vLLM's scheduler loads a request's adapter when its id is not cached (from its path)."""
        if lora_request is not None:
            self.llm_engine.add_lora(lora_request)
        self.generated.append(lora_request)
        out = types.SimpleNamespace(token_ids=[3, 4], text="ok")
        return [types.SimpleNamespace(outputs=[out] * params.n) for _ in prompts]


def _worker(tied):
    seed = torch.seed() % 2**31
    print("seed", seed)
    cfg = tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=512, tie_word_embeddings=tied)
    engine_model = FakeModel(build_model(cfg, seed=seed))
    learner = build_model(cfg, seed=seed + 1)
    w = object.__new__(VLLMRolloutWorker)
    w.llm, w.kind, w.adapter = FakeLLM(engine_model, tied), "full", None
    # the learner's export (models.weights): a CPU copy per name, so a tied head is an equal copy
    return w, engine_model, {k: v.detach().clone() for k, v in learner.state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_weights_arrive_by_name_in_bounded_chunks(tied, monkeypatch):
    limit = 64 * 1024
    monkeypatch.setattr(vllm_sync, "CHUNK_BYTES", limit)
    w, engine_model, weights = _worker(tied)
    sent = w.load_weights(weights)
    assert sent == sum(v.numel() * v.element_size() for k, v in weights.items() if not (tied and k == "lm_head.weight"))
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


# ---- LoRA: the adapter to vLLM -------------------------------------------------------------------


class Handle:
    """A Ray actor handle as far as the job uses it: ``handle.method.remote(*args)`` runs the
    method on pickled copies of the arguments (Ray serialises them) and returns the result."""

    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        method = getattr(self._obj, name)
        return types.SimpleNamespace(remote=lambda *a: method(*pickle.loads(pickle.dumps(a))))


class FakeRay:
    calls = 0

    def get(self, refs):
        return refs

    def put(self, obj):
        self.calls += 1
        return pickle.loads(pickle.dumps(obj))


class LearnerStandIn:
    """The learner's export for sync (``Learner.export_weights``, ``Learner.adapter_config``, run as
    they are) on a model outside DeepSpeed, rank 0 under ZeRO-2."""

    export_weights = Learner.export_weights
    adapter_config = Learner.adapter_config

    def __init__(self, model):
        self.cfg = types.SimpleNamespace(ds=types.SimpleNamespace(zero_stage=2))
        self.ds, self.rank = types.SimpleNamespace(module=model), 0


def _config(tied=False):
    return tiny_config("qwen2", hidden_size=64, num_layers=2, vocab_size=512, tie_word_embeddings=tied)


def _updated(model, seed):
    """``model`` after one optimizer step (LoRA B no longer zero), as a learner holds it after an update."""
    torch.manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    model(input_ids=ids).logits.float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model


def _lora_job(tmp_path, rank=8, engine_dtype=torch.bfloat16, engines=2, seed=0):
    """A job of a peft learner (rank ``rank``, all-linear) and ``engines`` vLLM stand-ins serving LoRA."""
    learner = _updated(build_model(_config(), seed=seed, lora=LoraSpec(rank, 2.0 * rank, 0.0, "all-linear")), seed)
    workers = []
    for i in range(engines):
        w = object.__new__(VLLMRolloutWorker)
        w.kind = vllm_weight_kind(rank, vllm_sync.LORA_RANKS)
        args = vllm_sync.engine_lora_args(rank)
        assert args["enable_lora"] and args["max_loras"] == 1
        engine = FakeLoRAEngine(args["max_lora_rank"], args["max_cpu_loras"], engine_dtype)
        w.llm = FakeLLM(FakeModel(build_model(_config(), seed=seed)), False, lora=engine)
        w.adapter = vllm_sync.AdapterSync(FakeLoRARequest, root=str(tmp_path / f"engine{i}"))
        w.cfg = types.SimpleNamespace(
            rollout=types.SimpleNamespace(n_samples_per_prompt=2, temperature=1.0, top_p=1.0, max_new_tokens=4),
            data=types.SimpleNamespace(apply_chat_template=False),
        )
        w.tok = lambda text: {"input_ids": [1, 2]}
        w.tok.pad_token_id = 0
        w.index = i
        workers.append(w)
    job = object.__new__(Job)
    job.ray, job.learners, job.rollout = FakeRay(), [Handle(LearnerStandIn(learner))], [Handle(w) for w in workers]
    job.weight_kind, job.adapter_config, job.weight_dtype = job.sync_form()
    return job, learner, workers


def test_lora_sends_the_adapter_only_under_a_new_id_each_update(tmp_path):
    from peft import get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    job, learner, workers = _lora_job(tmp_path)
    assert job.weight_kind == "adapter" and job.weight_dtype == "bfloat16"
    assert job.adapter_config["r"] == 8 and job.adapter_config["lora_alpha"] == 16.0
    for update in (1, 2, 3):
        sent = job.sync_weights()
        adapter = {k: v.detach().to(torch.bfloat16) for k, v in get_peft_model_state_dict(learner).items()}
        assert sent == job.sync_bytes == sum(v.numel() * 2 for v in adapter.values())
        for w in workers:
            engine = w.llm.llm_engine
            assert w.adapter.request.lora_int_id == update and w.adapter.request.lora_name == f"hilore-{update}"
            assert list(engine.cache) == [update]  # one CPU slot: the new id evicted the last
            scaling, loras = engine.cache[update]
            got = {
                f"base_model.model.{m}.lora_{ab}.weight": t for m, pair in loras.items() for ab, t in zip("AB", pair)
            }
            assert sorted(got) == sorted(adapter)  # names: the adapter's tensors only
            assert all(torch.equal(got[k], v) for k, v in adapter.items())  # values: the learner's, in bf16
            layers = [m for m in learner.modules() if isinstance(m, LoraLayer)]
            assert layers and all(scaling == m.scaling["default"] for m in layers)
            assert not w.llm.calls  # no base weight crossed: the engine keeps its own
            assert w.llm.reset
            folders = sorted(os.listdir(w.adapter.root))
            assert folders == [f"hilore-{update}"]  # the last folder removed, the current one kept
        _updated(learner, 100 + update)  # the next update


def test_rollouts_name_the_current_adapter(tmp_path, monkeypatch):
    job, _, workers = _lora_job(tmp_path, engines=1)
    fake_vllm = types.SimpleNamespace(
        SamplingParams=lambda **k: types.SimpleNamespace(**k),
        TokensPrompt=lambda **k: k,
    )
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    w = workers[0]
    w.generate(["a"], seed=0)  # before any sync: the base model (no adapter yet)
    assert w.llm.generated == [None]
    for update in (1, 2):
        job.sync_weights()
        out = w.generate(["a", "b"], seed=update, step=update)
        assert w.llm.generated[-1].lora_int_id == update
        assert out["sequences"].shape == (4, 4)


def test_the_adapter_folder_is_the_learner_as_peft_reads_it(tmp_path):
    """The folder the engine reads, loaded by peft onto the base model, computes the learner's logits
    exactly (engine in float32, so no cast): names, values and scaling as the learner has them."""
    from peft import PeftModel

    job, learner, workers = _lora_job(tmp_path, engine_dtype=torch.float32, engines=1)
    assert job.weight_dtype == "float32"
    job.sync_weights()
    served = PeftModel.from_pretrained(build_model(_config(), seed=0), workers[0].adapter.path).eval()
    learner.eval()
    ids = torch.randint(0, 512, (2, 10))
    with torch.no_grad():
        assert torch.equal(served(input_ids=ids).logits, learner(input_ids=ids).logits)
    cfg = json.loads((tmp_path / "engine0" / "hilore-1" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(cfg["target_modules"]) and not cfg["use_dora"]


def test_full_fine_tuning_sends_every_weight_as_before(tmp_path):
    learner = _updated(build_model(_config(tied=True), seed=1), 1)
    w = object.__new__(VLLMRolloutWorker)
    w.kind, w.adapter = vllm_weight_kind(0, vllm_sync.LORA_RANKS), None
    engine_model = FakeModel(build_model(_config(tied=True), seed=2))
    w.llm = FakeLLM(engine_model, True)
    job = object.__new__(Job)
    job.ray, job.learners, job.rollout = FakeRay(), [Handle(LearnerStandIn(learner))], [Handle(w)]
    job.weight_kind, job.adapter_config, job.weight_dtype = job.sync_form()
    assert (job.weight_kind, job.adapter_config, job.weight_dtype) == ("full", None, None)
    sent = job.sync_weights()
    want = {k: v for k, v in learner.state_dict().items()}
    assert all(torch.equal(engine_model.hf.state_dict()[k], v) for k, v in want.items())
    assert sent == job.sync_bytes == sum(v.numel() * v.element_size() for k, v in want.items() if k != "lm_head.weight")
    assert {m for m, _ in w.llm.calls} == {vllm_sync.RPC_METHOD}


def test_what_a_vllm_engine_takes_by_rank():
    ranks = vllm_sync.LORA_RANKS
    assert [vllm_weight_kind(r, ranks) for r in (0, 4, 16, 512, 1024)] == [
        "full",
        "adapter",
        "adapter",
        "adapter",
        "merged",
    ]
    assert [vllm_sync.max_lora_rank(r) for r in (1, 4, 8, 16, 17, 300, 512, 513)] == [1, 8, 8, 16, 32, 320, 512, None]
    assert vllm_sync.engine_lora_args(16) == dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16)
    with pytest.raises(ValueError, match="above vLLM's largest"):
        vllm_sync.engine_lora_args(1024)
    assert vllm_sync.lora_ranks() == ranks  # no vLLM here: 0.29's list


def test_an_adapter_vllm_cannot_serve_is_refused_before_the_engine(tmp_path):
    w = vllm_sync.AdapterSync(FakeLoRARequest, root=str(tmp_path))
    ok = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "bias": "none", "use_dora": False}
    for bad, name in (({"use_dora": True}, "use_dora"), ({"rank_pattern": {"q_proj": 4}}, "rank_pattern")):
        with pytest.raises(ValueError, match=name):
            w.load(None, {"x.lora_A.weight": torch.zeros(1)}, dict(ok, **bad))
    assert os.listdir(tmp_path) == []
    vllm_sync.check_servable(dict(ok, rank_pattern={}, modules_to_save=None))


def test_a_refused_load_leaves_no_folder_and_keeps_the_current_adapter(tmp_path):
    job, learner, workers = _lora_job(tmp_path, engines=1)
    job.sync_weights()
    w = workers[0]
    w.llm.llm_engine.modules = {"q_proj"}  # an engine that serves fewer modules than the adapter has
    with pytest.raises(ValueError, match="expected target modules"):
        job.sync_weights()
    assert w.adapter.request.lora_int_id == 1 and os.listdir(w.adapter.root) == ["hilore-1"]


def test_adapter_folders_go_to_shared_memory_and_dead_workers_folders_are_removed(tmp_path):
    import socket

    host = socket.gethostname()
    dead = tmp_path / f"hilore-lora-{host}-{2**22 + 7}-x"  # above Linux's largest pid: no such process
    live = tmp_path / f"hilore-lora-{host}-{os.getpid()}-y"
    other = tmp_path / "hilore-lora-elsewhere-1-z"
    for d in (dead, live, other):
        d.mkdir()
    root = vllm_sync.adapter_root(str(tmp_path))
    assert not dead.exists() and live.exists() and other.exists()
    assert os.path.basename(root).startswith(f"hilore-lora-{host}-{os.getpid()}-")
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = vllm_sync.adapter_root()
        try:
            assert os.path.dirname(shm) == "/dev/shm"
        finally:
            os.rmdir(shm)


def _qwen25_3b():
    import transformers

    return transformers.Qwen2Config(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    )


def test_bytes_per_update_for_qwen25_3b_lora16_all_linear():
    """The numbers docs/training-job.md gives, counted on the meta device (no weights), bf16:
    the adapter is r * sum over layers and adapted linears of (in + out) values; the merged model
    every base weight once (the tied head is not sent)."""
    import transformers
    from peft import get_peft_model_state_dict

    from hilore_actor.models.factory import apply_lora

    cfg = _qwen25_3b()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    merged = vllm_sync.payload_bytes(vllm_sync.without_tied_head(dict(model.state_dict()), tied=True))
    adapter = get_peft_model_state_dict(apply_lora(model, LoraSpec(16, 32.0, 0.0, "all-linear")))
    sent = vllm_sync.payload_bytes(vllm_sync.cast_floats(adapter, "bfloat16"))
    h, i, q, kv, layers, r = 2048, 11008, 16 * 128, 2 * 128, 36, 16
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 3 * (h + i)  # q, k, v, o, gate, up, down
    assert len(adapter) == 2 * 7 * layers
    assert sent == r * layers * per_layer * 2 == 59_867_136
    assert merged == 6_171_877_376
    assert round(merged / sent) == 103


def test_the_job_logs_the_bytes_of_each_sync(uninterrupted):
    """The tiny preset (LoRA rank 8, an HF generate worker, which takes merged weights): every
    step's ``sync_bytes`` in metrics.jsonl is the policy's base weights in the run's dtype."""
    from hilore_actor.models.source import load_policy
    from hilore_actor.train.config import param_dtype, parse_config

    from train_job import TINY, metrics

    cfg = parse_config(TINY)
    model, _ = load_policy(cfg.actor.model_name_or_path, dtype=param_dtype(cfg), lora=None, seed=cfg.train.seed)
    want = vllm_sync.payload_bytes(model.state_dict())
    rows = metrics(uninterrupted[0])
    assert rows and all(m["sync_bytes"] == want for m in rows), ([m.get("sync_bytes") for m in rows], want)


def test_adapters_go_to_the_temporary_directory_when_shared_memory_is_short(tmp_path, monkeypatch):
    """A container's /dev/shm (64 MiB by default) can be smaller than an adapter and its successor."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(vllm_sync.tempfile, "tempdir", str(tmp))
    job, _, workers = _lora_job(tmp_path, engines=1)
    job.sync_weights()
    w = workers[0]
    first = w.adapter.path
    real = vllm_sync.shutil.disk_usage
    monkeypatch.setattr(vllm_sync.shutil, "disk_usage", lambda p: real(p)._replace(free=job.sync_bytes))
    job.sync_weights()
    assert os.path.dirname(os.path.dirname(w.adapter.path)) == str(tmp)
    assert w.adapter.request.lora_int_id == 2 and not os.path.exists(first)
    assert 2 in w.llm.llm_engine.cache
