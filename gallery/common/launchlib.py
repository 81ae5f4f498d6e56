"""Load :mod:`torchacc.launch` without importing the ``torchacc`` package.

``import torchacc.launch`` would first run ``torchacc/__init__.py``, which brings up the compiler
core (JAX, the lazy device). The eager baseline must not pay for that or depend on it — as in
the TorchAcc recipe, torchacc is imported only under ``if enable_torchacc_compiler():`` — so the
launcher's module (stdlib-only at import time) is loaded from its file directly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["torchacc_launch"]

_NAME = "torchacc.launch"


def torchacc_launch() -> ModuleType:
    mod = sys.modules.get(_NAME)
    if mod is not None:
        return mod
    spec = importlib.util.find_spec("torchacc")  # locates the package, does not import it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("cannot find the torchacc package (run from the checkout or install it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "launch.py")
    spec = importlib.util.spec_from_file_location(_NAME, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[_NAME]
        raise
    return mod
