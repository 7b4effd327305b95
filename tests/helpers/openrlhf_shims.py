"""Import-time shims for OpenRLHF's GPU-only imports, for CPU tests.

OpenRLHF 0.11.2 imports ``vllm`` (``openrlhf.trainer.ray``) and ``flash_attn``
(``openrlhf.models.ring_attn_utils``) at module top level. Neither installs on a CPU machine.
``install()`` makes every ``vllm.*`` import and OpenRLHF's module-level ``flash_attn`` imports succeed with a
module whose
attributes raise when called. The tests run OpenRLHF code that never calls them: ``Actor``
without sample packing (packing is what uses flash_attn's unpad helpers), ``PolicyLoss``,
``compute_approx_kl``, ``ActorPPOTrainer.training_step`` (no vLLM weight sync) and the
argparse block of ``openrlhf.cli.train_ppo_ray`` (which stops before ``train``).
"""

import importlib.abc
import importlib.machinery
import sys
import types

SHIMMED = ("vllm", "flash_attn")
# flash_attn: only what OpenRLHF imports at module level. Its lazy `flash_attn.ops...` import
# (the fused cross-entropy in log_probs_from_logits) must fail, so OpenRLHF takes its own
# torch fallback, as it does on any machine without flash-attn.
FLASH_ATTN_MODULES = {"flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed"}


class _Shim(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "__version__":
            return "0.0.0+cpu-shim"

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} is a CPU test shim; this code path needs a GPU")

        unavailable.__name__ = name
        return type(name, (), {"__init__": unavailable, "__call__": unavailable}) if name[:1].isupper() else unavailable


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == "vllm" or fullname in FLASH_ATTN_MODULES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _Shim(spec.name)
        m.__path__ = []
        m.__version__ = "0.0.0+cpu-shim"
        return m

    def exec_module(self, module):
        pass


def install():
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def uninstall():
    """Remove the finder and the shim modules (other tests then see vllm/flash_attn as absent)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
    for name in [n for n in sys.modules if n.split(".")[0] in SHIMMED]:
        del sys.modules[name]
