"""``torch_xla.experimental.eager`` on torchacc: torchacc is always lazy.

``eager_mode(False)`` / ``is_eager_mode()`` work (lazy is the only mode); turning eager mode on
raises ``NotImplementedError``: executing every op on its own is what plain PyTorch on the CPU or
GPU already does (run the script without torchacc for that).
"""

from __future__ import annotations

import contextlib

from torchacc.torch_xla._api import differs


def _refuse(call):
    raise NotImplementedError(
        f"{call}: torchacc records ops lazily and runs them at mark_step; it has no op-by-op eager "
        "mode (run without torchacc for eager PyTorch)"
    )


@differs("always lazy: eager_mode(True) raises NotImplementedError")
def eager_mode(enable):
    if enable:
        _refuse("torch_xla.experimental.eager_mode(True)")


def is_eager_mode():
    return False


@differs("always lazy: eager_mode_context(True) raises NotImplementedError")
@contextlib.contextmanager
def eager_mode_context(enable):
    if enable:
        _refuse("torch_xla.experimental.eager_mode_context(True)")
    yield
