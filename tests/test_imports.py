"""``import hilore_actor`` needs torch alone: heavy dependencies are imported where used."""
import subprocess
import sys

HEAVY = ["transformers", "peft", "deepspeed", "ray", "vllm", "flash_attn", "openrlhf", "reasoning_gym", "math_verify", "matplotlib"]

BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
import hilore_actor, hilore_actor.grpo, hilore_actor.runtime, hilore_actor.models, hilore_actor.data, hilore_actor.rollout
import hilore_actor.recovery, hilore_actor.workloads
import hilore_actor.train, hilore_actor.train.config, hilore_actor.train.coordinator, hilore_actor.train.checkpoint
import hilore_actor.train.planning, hilore_actor.train_grpo, hilore_actor.openrlhf, hilore_actor.openrlhf.training_step
import hilore_actor.openrlhf.train_ppo_ray
import hilore_actor.grpo as g, torch
s = torch.randn(2, 3, requires_grad=True)
loss, _ = g.policy_loss(s, s.detach(), torch.ones(2))
print('ok')
"""


def test_package_imports_with_only_torch():
    code = BLOCKER.format(blocked=set(HEAVY))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
