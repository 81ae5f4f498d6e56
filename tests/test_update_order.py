"""A training step's optimizer update overwrites its parameters in place, without copying them.

XLA writes a donated parameter's new value into its old buffer only where it can prove that every
other read of the old value comes first; a linear layer's backward reads its weight for the
input's gradient, which nothing in the weight's own update depends on, so XLA copied every such
weight at the start of each step (Note [The update runs after every read of what it overwrites]
in torchacc/program/build.py). These tests count the parameter copies in the compiled step and
its bytes accessed, with the ordering and without, and check the results are the same bits.
"""

from __future__ import annotations

import re

import pytest
import torch

import torchacc
from torchacc.amp import syncfree
from torchacc.program import build, cache

DEV = torchacc.device()
WIDTH = 160  # 25,600 elements per weight: above the packing limit, so each is its own buffer


def _train(make_opt, steps=3):
    """Parameters after ``steps`` steps, and the last (steady) step's executable."""
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1)).to(DEV)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, WIDTH, generator=g).to(DEV)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
    exe = next(reversed(cache._cache.values()))
    cache.clear_memory_cache()
    return [p.detach().cpu() for p in model.parameters()], exe


def _weight_copies(exe):
    """Copies of a (WIDTH, WIDTH) program argument in the compiled step's entry computation."""
    entry = re.search(r"^ENTRY .*?^}", exe.as_text(), re.S | re.M).group(0)
    args = set(re.findall(rf"%(\S+) = f32\[{WIDTH},{WIDTH}\]\S* parameter\(", entry))
    copies = re.findall(r" copy\(%([^)]+)\)", entry)
    return sum(c in args for c in copies)


def _bytes_accessed(exe):
    analysis = exe.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["bytes accessed"]


OPTIMIZERS = [
    ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("adamw-fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
    ("adamw-syncfree", lambda ps: syncfree.AdamW(ps, lr=1e-2)),
]


@pytest.mark.parametrize("name,make_opt", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_update_overwrites_weights_without_copies(name, make_opt, monkeypatch):
    ordered, exe = _train(make_opt)
    with monkeypatch.context() as m:
        m.setattr(build, "_UPDATE_ORDER", False)
        unordered, old_exe = _train(make_opt)
    # without the ordering XLA copies the weights whose input gradient the backward computes
    # (the first layer's is not computed: its input needs none), so the check can fail
    copies = _weight_copies(old_exe)
    assert copies >= 2
    assert _weight_copies(exe) == 0
    copied = copies * 2 * WIDTH * WIDTH * 4  # each copy reads and writes one weight
    # less traffic by the copies' bytes, less the few the `ready` flag reads (~1%)
    assert _bytes_accessed(old_exe) - _bytes_accessed(exe) >= 0.95 * copied
    for a, b in zip(ordered, unordered):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_ready_is_true_for_every_bit_pattern():
    # `ready` counts the ones of each source's first element; any value (NaN, inf, -0.0,
    # integers, booleans) must leave it true, or the update would read zeros
    import jax.numpy as jnp

    values = [
        jnp.array([float("nan"), 1.0], jnp.float32),
        jnp.array([-float("inf")], jnp.float32),
        jnp.array([-0.0], jnp.bfloat16),
        jnp.array([-1], jnp.int32),
        jnp.array([True]),
        jnp.array([2**62 - 1], jnp.int64) if jnp.zeros(1, jnp.int64).dtype == jnp.int64 else None,
        jnp.zeros((0,), jnp.float32),
        jnp.array([1 + 2j], jnp.complex64),
    ]
    assert bool(build._all_ready([v for v in values if v is not None]))
    assert bool(build._all_ready([]))
