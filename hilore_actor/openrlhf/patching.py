"""Shadow an object's methods with instance attributes for a while, nesting safely.

The drop-in intercepts OpenRLHF calls (``strategy.backward``, ``strategy.optimizer_step``) by
setting instance attributes for the duration of one call; the verification script does the
same around the drop-in. ``del obj.attr`` on exit would remove an outer layer's attribute
too; ``shadowed`` puts back whatever instance attribute was there before.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def shadowed(obj, **attrs) -> Iterator[None]:
    saved = {k: obj.__dict__[k] for k in attrs if k in obj.__dict__}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k in attrs:
            if k in saved:
                setattr(obj, k, saved[k])
            else:
                delattr(obj, k)
