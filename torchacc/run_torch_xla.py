"""Run an unchanged torch_xla script on torchacc.

::

    python -m torchacc.run_torch_xla train.py [script args...]
    python -m torchacc.run_torch_xla -m package.module [module args...]

Installs :mod:`torchacc.alias` (so ``import torch_xla...`` resolves to ``torchacc.torch_xla...``)
and runs the script as ``__main__`` with ``sys.argv`` set as if it had been started directly.
Works under torchrun too: ``torchrun --nproc_per_node=2 -m torchacc.run_torch_xla train.py``.
The device is named ``xla`` here, so tensors report ``xla:0`` as under torch_xla
(``TORCHACC_DEVICE_TYPE=torchacc`` keeps ``torchacc:0``; Note [The device's name]).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m torchacc.run_torch_xla (SCRIPT.py | -m MODULE) [ARGS...]"


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 2 if not argv else 0
    from torchacc import alias
    from torchacc.lazy.device import DEVICE_TYPE

    # child processes (multiprocessing spawn) name the device as this one does; a process whose
    # device is named torchacc (main() called in-process) exports nothing: its children would
    # otherwise keep that name even where they are started with run_torch_xla themselves
    if DEVICE_TYPE == "xla":
        os.environ.setdefault("TORCHACC_DEVICE_TYPE", DEVICE_TYPE)
    alias.install()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            return 2
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    script = argv[0]
    if not os.path.exists(script):
        print(f"run_torch_xla: no such script: {script}", file=sys.stderr)
        return 2
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
