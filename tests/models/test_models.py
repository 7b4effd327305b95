"""Model factory: tiny configs in code, local paths, LoRA, and the bundled SmolLM2."""

import json

import pytest
import torch

from hilore_actor.models import ARCHS, LoraSpec, build_model, load_model, load_smollm2, tiny_config


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_models_forward_and_shapes(arch):
    cfg = tiny_config(arch, hidden_size=32, num_layers=2, num_heads=4, vocab_size=128)
    model = build_model(cfg, seed=torch.seed() % 2**31)
    expected_kv = 4 if arch == "phi3" else 2
    assert model.config.num_key_value_heads == expected_kv
    ids = torch.randint(0, 128, (2, 11))
    out = model(input_ids=ids)
    assert out.logits.shape == (2, 11, 128)
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_trains_only_adapters(arch):
    cfg = tiny_config(arch, hidden_size=32, vocab_size=64)
    base = build_model(cfg)
    linear_names = {n.split(".")[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
    model = build_model(cfg, lora=LoraSpec(rank=4, alpha=8, dropout=0.1))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == linear_names - {"lm_head"}


def test_load_from_config_json_and_checkpoint_dir(tmp_path):
    cfg = tiny_config("llama", hidden_size=32, vocab_size=64)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(cfg.to_json_string())
    a = load_model(tmp_path / "cfg" / "config.json", seed=1)
    b = load_model(tmp_path / "cfg", seed=1)
    assert type(a).__name__ == "LlamaForCausalLM"
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    a.save_pretrained(tmp_path / "ckpt")
    c = load_model(tmp_path / "ckpt")
    ids = torch.randint(0, 64, (1, 7))
    torch.testing.assert_close(c(input_ids=ids).logits, a(input_ids=ids).logits)


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="model_type"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="unknown arch"):
        tiny_config("gpt9")


def test_smollm2_answers_arithmetic():
    """The bundled SmolLM2-135M-Instruct, loaded offline, answers with greedy decoding."""
    model, tok = load_smollm2()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.chat_template
    answers = {}
    for a, b in [(7, 5), (3, 4)]:
        msgs = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
        answers[a + b] = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    for total, text in answers.items():
        assert str(total) in text, answers


def test_all_linear_lora_is_peft_s_all_linear_less_layers_peft_cannot_run():
    import peft

    from hilore_actor.models.factory import all_linear_targets

    class Router(torch.nn.Linear):  # an MoE router: a Linear that returns (scores, logits)
        def forward(self, x):
            z = super().forward(x)
            return z.softmax(-1), z

    same = build_model(tiny_config("qwen2"), seed=0), build_model(tiny_config("qwen2"), seed=0)
    torch.manual_seed(0)
    a = peft.get_peft_model(same[0], peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))
    torch.manual_seed(0)
    b = peft.get_peft_model(
        same[1], peft.LoraConfig(r=4, target_modules=all_linear_targets(same[1]), task_type="CAUSAL_LM")
    )
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert sorted(pa) == sorted(pb) and all(torch.equal(pa[k], pb[k]) for k in pa)
    m = build_model(tiny_config("qwen2"), seed=0)
    m.model.layers[0].mlp.gate_proj = Router(64, m.model.layers[0].mlp.gate_proj.out_features)

    class OwnForward(torch.nn.Linear):  # Falcon's FalconLinear: its own forward, a tensor out
        def forward(self, x):
            return x @ self.weight.T

    m.model.layers[1].mlp.up_proj = OwnForward(64, m.model.layers[1].mlp.up_proj.out_features, bias=False)
    names = all_linear_targets(m)
    assert "model.layers.0.mlp.gate_proj" not in names and "model.layers.1.mlp.gate_proj" in names
    assert "model.layers.1.mlp.up_proj" in names  # adapted, as peft's all-linear does
    assert "lm_head" not in names
