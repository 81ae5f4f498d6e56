"""How a gallery worker stops for a reason it printed: one line, an exit code, and a marker in
the launcher's run directory so that the launcher adds no failure box of its own (Note [Worker
lifetime] in ``torchacc/launch_checks.py``)."""

from __future__ import annotations

import os
import sys

from gallery.common.launchlib import torchacc_launch

checks = torchacc_launch().checks  # torchacc/launch_checks.py, without the compiler core

__all__ = ["Reported", "exit_reported"]


class Reported(SystemExit):
    """Exit with ``code`` after printing why; the launcher then adds no failure box."""


def exit_reported(code: int, line: str | None, rank: int = 0) -> Reported:
    if line and rank == 0:
        print(line, file=sys.stderr if code == 2 else sys.stdout, flush=True)
    run_dir = os.environ.get(checks.RUN_DIR_ENV)
    if run_dir and os.path.isdir(run_dir):
        try:
            with open(os.path.join(run_dir, f"reported-rank{rank}"), "w") as f:
                f.write(str(code))
        except OSError:
            pass
    sys.stdout.flush()
    return Reported(code)
