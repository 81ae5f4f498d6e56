"""Make ``import torch_xla...`` resolve to ``torchacc.torch_xla...`` (run torch_xla scripts as is).

One line, either::

    python -m torchacc.run_torch_xla train.py --its --own --flags
    # or, at the top of the script / in sitecustomize:
    import torchacc.alias

After :func:`install` (done on import), ``import torch_xla``, ``import torch_xla.core.xla_model as
xm``, ``from torch_xla.amp import syncfree``, ``import torch_xla.distributed.xla_backend`` ... all
give the torchacc modules (the very same module objects as ``torchacc.torch_xla.*``). The alias
takes precedence over a real torch_xla installation while installed; :func:`uninstall` removes it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

ALIAS = "torch_xla"
TARGET = "torchacc.torch_xla"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target
        self.real_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module):
        # the import machinery stamped the alias spec on the module: give it back its own
        module.__spec__ = self.real_spec


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch_xla`` and ``torch_xla.<x>`` as ``torchacc.torch_xla`` and
    ``torchacc.torch_xla.<x>``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        real = TARGET + fullname[len(ALIAS) :]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real))


_finder = AliasFinder()


def install():
    """Put the alias finder first on ``sys.meta_path`` (idempotent)."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall():
    """Remove the alias and forget the aliased module names."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    for name in [n for n in sys.modules if n == ALIAS or n.startswith(ALIAS + ".")]:
        if sys.modules[name].__name__.startswith(TARGET):
            del sys.modules[name]


install()
