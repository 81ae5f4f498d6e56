"""A post-import hook: torchacc's dynamo set-up runs as soon as ``torch._dynamo`` is imported.

``torch.compile`` imports ``torch._dynamo`` on first use, seconds of imports that
``import torchacc`` does not pay. Dynamo must see torchacc-device tensors as tensors before it
traces a frame with any backend (Note [torch.compile over torchacc tensors] in
torchacc/dynamo/device_tensors.py); a backend named by string (``"openxla"`` through the torch_xla
alias, ``"aot_eager"``) is looked up before tracing but imports nothing of torchacc. So
``install()`` puts a one-shot finder on ``sys.meta_path`` that lets ``torch._dynamo`` load as usual
and then imports ``torchacc.dynamo`` (which registers the backend and teaches dynamo); if dynamo
is already loaded it does that now.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_NAME = "torch._dynamo"


def _setup():
    try:
        from torchacc.dynamo import device_tensors

        device_tensors.install()
    except Exception as e:  # never break torch's own import
        warnings.warn(f"torchacc: dynamo set-up failed ({type(e).__name__}: {e})", stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot (and the lookup below must not find us)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_setup(module):
            exec_module(module)
            _setup()

        spec.loader.exec_module = exec_then_setup  # this spec's own loader instance
        return spec


def install():
    if _NAME in sys.modules:
        _setup()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
