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

__all__ = ["torchacc_data_state", "torchacc_file_module", "torchacc_launch"]


def torchacc_launch() -> ModuleType:
    return torchacc_file_module("torchacc.launch", "launch.py")


def torchacc_data_state() -> ModuleType:
    """:mod:`torchacc.distributed.data_state` (loader positions; torch and the standard library
    only), loaded by file for the same reason: the eager path's samplers save their state with it
    and must not bring up the compiler. Registered under its own name, so ``import
    torchacc.distributed.data_state`` later (the compiler path) finds this module: one
    ``DataStateError`` class either way."""
    return torchacc_file_module("torchacc.distributed.data_state", "distributed/data_state.py")


def torchacc_file_module(name: str, relpath: str) -> ModuleType:
    """The module ``name`` of the torchacc package, executed from its file (``relpath`` under the
    package) without running ``torchacc/__init__.py``; the module must not import torchacc."""
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    spec = importlib.util.find_spec("torchacc")  # locates the package, does not import it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("cannot find the torchacc package (run from the checkout or install it)")
    path = os.path.join(list(spec.submodule_search_locations)[0], *relpath.split("/"))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[name]
        raise
    return mod
