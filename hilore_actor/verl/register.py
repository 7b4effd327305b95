"""What verl imports in every process, Ray workers included: registers HiLoRe's engine.

Loaded through verl's plugin hooks, so verl is never forked: the ``verl.plugins`` entry point
(setup.py; verl loads every installed plugin on ``import verl``) and
``VERL_USE_EXTERNAL_MODULES=hilore_actor.verl.register``, which the launcher puts into the
driver's and the Ray workers' environment. Idempotent (both hooks may fire in one process).

In a process of a verl worker group (verl sets ``WG_BACKEND=ray`` and ``RANK`` there) that the
launcher configured, one line says that the engine is registered: Ray shows it in the driver's
output prefixed with the worker's pid, one line per rank.
"""

import os

from .fsdp_engine import BACKEND, register
from .settings import CONFIG_ENV

register()
if os.environ.get(CONFIG_ENV) and os.environ.get("WG_BACKEND") == "ray":
    print(
        f"[hilore] rank {os.environ.get('RANK', '?')}: HiLoRe's actor engine is registered in this verl worker "
        f"(backend {BACKEND})",
        flush=True,
    )
