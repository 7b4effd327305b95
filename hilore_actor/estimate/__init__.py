"""Memory and speed of a learner update before the run: ``python -m hilore_actor.estimate``.

- ``meta.py``: the learner's microbatch on the meta device (each unit's saved bytes, each
  pass's peak, exactly, without memory);
- ``roofline.py``: seconds from FLOPs on a device preset (the stated model of speed);
- ``plan.py``: a rank's resident bytes, gc's and no-gc's peaks, B, and the knapsack's plan at B
  with its predicted gain;
- ``__main__.py``: the command.
"""

from .plan import Estimate, Setting, estimate

__all__ = ["Estimate", "Setting", "estimate"]
