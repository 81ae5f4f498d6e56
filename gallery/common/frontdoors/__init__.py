"""The gallery trainer's front doors: one setup per way of running the training step.

:func:`gallery.common.trainer.train` is one loop for every front door; what differs between them
is set up here, one module each (Note [Front door hooks] in ``base.py`` lists the hooks and
when the loop calls them):

=================  ===============================================  ===========================
module             front door                                       flags
=================  ===============================================  ===========================
``eager.py``       eager PyTorch, DDP (the baseline)                (none), ``--torch_compile``
``compiler.py``    the TorchAcc recipe on the lazy XLA device       ``--compiler-opt``
``fsdp.py``        FSDPv2 through XLA's SPMD partitioner; FSDP2     ``--fsdp [--compiler-opt]``
``pipeline.py``    pipeline stages on a (dp, fsdp, pp) mesh, or     ``--fsdp --compiler-opt --pp``
                   uniform ones on (dp, pp, sp, tp) with tp / cp    ``[--tp] [--cp]``
``parallel.py``    torchacc.parallel's modes                        ``--parallel_mode``
``dynamo.py``      the whole step through ``compile_step``          ``--compile_mode=dynamo``
=================  ===============================================  ===========================

Horovod is not a front door of this loop: ``gallery/horovod/train.py`` is its own script, as a
Horovod user's would be.
"""

from __future__ import annotations

import argparse

from gallery.common.frontdoors.base import FrontDoor
from gallery.common.logger import enable_torchacc_compiler

__all__ = ["FrontDoor", "select"]


def select(args: argparse.Namespace, logger) -> FrontDoor:
    """The front door of this run's flags."""
    dynamo = bool(args.compiler_opt) and getattr(args, "compile_mode", "lazy") == "dynamo"
    # --compile_mode=dynamo: tensors stay on the eager device, the step is compiled as a whole
    compiler = enable_torchacc_compiler() and not dynamo
    fsdp = bool(getattr(args, "fsdp", False))
    if compiler:
        if fsdp and getattr(args, "pp", 1) > 1:
            from gallery.common.frontdoors.pipeline import Pipeline as door
        elif fsdp:
            from gallery.common.frontdoors.fsdp import FSDPv2 as door
        elif getattr(args, "parallel_mode", None):
            from gallery.common.frontdoors.parallel import ParallelMode as door
        else:
            from gallery.common.frontdoors.compiler import Compiler as door
    elif fsdp:
        from gallery.common.frontdoors.fsdp import EagerFSDP as door
    elif dynamo:
        from gallery.common.frontdoors.dynamo import Dynamo as door
    else:
        from gallery.common.frontdoors.eager import Eager as door
    return door(args, logger)
