"""A launcher worker that calls ``MODULE:FUNCTION(argv)``: ``python launch_worker.py
MODULE:FUNCTION ARGS...``, as torchrun starts it for ``--model MODULE:FUNCTION``.

Run as a script, not as ``-m torchacc.launch_worker``, so that the eager path never imports the
``torchacc`` package (JAX): the worker guard (Note [Worker lifetime] in
``torchacc/launch_checks.py``) is loaded from its file. Standard library only.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def _guard_worker() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    mod = sys.modules.get("torchacc.launch_checks")
    if mod is None:
        spec = importlib.util.spec_from_file_location(
            "torchacc.launch_checks", os.path.join(here, "launch_checks.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["torchacc.launch_checks"] = mod
        spec.loader.exec_module(mod)
    mod.guard_worker()


def main(argv: list[str]) -> int:
    if not argv or ":" not in argv[0]:
        print("usage: launch_worker.py MODULE:FUNCTION [ARGS...]", file=sys.stderr)
        return 2
    _guard_worker()
    module, _, func = argv[0].partition(":")
    getattr(importlib.import_module(module), func)(argv[1:])
    return 0


if __name__ == "__main__":
    # the working directory, not this file's directory, is where MODULE is found (as with -m)
    sys.path[0] = os.getcwd()
    sys.exit(main(sys.argv[1:]))
