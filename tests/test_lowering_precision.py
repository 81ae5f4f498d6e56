"""float32 precision follows torch's flags (Note [float32 precision follows torch] in
torchacc/lowering/precision.py): the lowered dots/convolutions carry the precision torch's
settings ask for, and a compiled step is keyed on them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import torchacc
from torchacc import metrics
from torchacc.lowering import lookup, precision

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _restore_flags():
    matmul = torch.get_float32_matmul_precision()
    # torch.testing._internal (imported by the OpInfo sweep in the same worker) freezes the cudnn
    # flags for plain assignment: set them through torch's flags() context manager instead
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, allow_tf32=cudnn.allow_tf32):
        yield
    torch.set_float32_matmul_precision(matmul)


def _hlo(fn, *shapes):
    args = [jnp.ones(s, jnp.float32) for s in shapes]
    with precision.scope():
        return jax.jit(fn).lower(*args).as_text(dialect="stablehlo")


@pytest.mark.parametrize(
    "setting,want", [("highest", "HIGHEST"), ("high", "HIGH"), ("medium", None)]
)
def test_matmul_precision_follows_torch(setting, want):
    torch.set_float32_matmul_precision(setting)
    text = _hlo(lookup(aten.mm.default).fn, (4, 4), (4, 4))
    if want is None:
        assert "precision = [" not in text or "HIGH" not in text, text
    else:
        assert f"precision = [{want}, {want}]" in text, text


@pytest.mark.parametrize("allow_tf32,want", [(False, "HIGHEST"), (True, "DEFAULT")])
def test_conv_precision_follows_cudnn_allow_tf32(allow_tf32, want):
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, allow_tf32=allow_tf32):
        rule = lookup(aten.convolution.default).fn
        text = _hlo(
            lambda x, w: rule(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
            (1, 2, 5, 5),
            (3, 2, 3, 3),
        )
        if want == "HIGHEST":
            assert "HIGHEST" in text, text
        else:
            assert "HIGHEST" not in text, text


def test_scope_sets_jax_default_matmul_precision():
    torch.set_float32_matmul_precision("highest")
    with precision.scope():
        assert jax.config.jax_default_matmul_precision == "highest"
    torch.set_float32_matmul_precision("high")
    with precision.scope():
        assert jax.config.jax_default_matmul_precision == "tensorfloat32"


def test_changing_the_flags_recompiles_and_going_back_reuses():
    dev = torchacc.device()
    a = torch.randn(8, 8, device=dev)
    step = lambda: (a @ a).sum().cpu()  # noqa: E731
    torch.set_float32_matmul_precision("highest")
    step()
    metrics.clear_counters()
    step()
    assert metrics.counter_value("CachedCompile") == 1
    torch.set_float32_matmul_precision("high")
    step()  # a different program: not the cached fp32 one
    assert metrics.counter_value("CachedCompile") == 1
    torch.set_float32_matmul_precision("highest")
    step()
    assert metrics.counter_value("CachedCompile") == 2
