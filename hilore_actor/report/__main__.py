"""``python -m hilore_actor.report RUN_DIR``: the run's report page (``page.py``) into
``RUN_DIR/report/index.html``, PNGs beside it; prints the page's path. A folder that holds no run,
or a page that cannot be written there, is one line and exit code 2."""

from __future__ import annotations

import argparse
import sys

from .run_folder import NotARun


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m hilore_actor.report",
        description="Write a training run's report: one HTML page with its pictures (reward, held-out accuracy, "
        "peak against B, the action each unit took, update time against gc, the zero-advantage skip, the flags), "
        "from the run folder alone.",
    )
    p.add_argument("run_dir", help="the run's folder (--save_path of python -m hilore_actor.train_grpo)")
    p.add_argument("--out", default=None, help="where to write the page and its PNGs (default: RUN_DIR/report)")
    args = p.parse_args(argv)
    from .page import write

    try:
        print(write(args.run_dir, args.out))
    except NotARun as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the page's folder cannot be written (a read-only copy of a run: --out elsewhere)
        print(f"error: cannot write the report ({e.strerror or e}: {e.filename}); choose --out DIR", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
