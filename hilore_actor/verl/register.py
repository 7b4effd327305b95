"""What verl imports in every process, Ray workers included: registers HiLoRe's engine.

Loaded through verl's plugin hooks, so verl is never forked: the ``verl.plugins`` entry point
(setup.py; verl loads every installed plugin on ``import verl``) and
``VERL_USE_EXTERNAL_MODULES=hilore_actor.verl.register``, which the launcher puts into the
driver's and the Ray workers' environment. Idempotent (both hooks may fire in one process).
"""

from .fsdp_engine import register

register()
