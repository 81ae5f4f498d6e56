"""A training step's kernels do not grow with its depth (issue 32: GPT-2's cold AdamW step).

XLA compiles identical kernels once, so what a cold step costs grows with its *distinct* kernels.
Three things made same-shaped layers' kernels distinct: foreach Adam's per-parameter bias
corrections recorded one runtime scalar each (Note [Shared foreach scalars] in
torchacc/lazy/foreach.py), foreach ops on pieces of a pack run member by member (Note [Flat
optimizer updates]), and pieces read at static offsets (Note [Pieces read at offset arguments] in
torchacc/program/build.py). These tests count the distinct kernels of a step program and check
that the results are the bits the member-by-member program gives.
"""

from __future__ import annotations

import re

import pytest
import torch

import torchacc
from torchacc.amp import syncfree
from torchacc.lazy import foreach
from torchacc.lowering import batching
from torchacc.program import build, cache

DEV = torchacc.device()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


def _model(depth):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(depth)], torch.nn.Linear(8, 1))


def _train(depth, make_opt, steps=3):
    """Parameters after ``steps`` steps on the device, and the last step program's optimized HLO."""
    model = _model(depth).to(DEV)
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=g).to(DEV)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
    exe = next(reversed(cache._cache.values()))
    return [p.detach().cpu() for p in model.parameters()], exe.as_text()


def _kernels(hlo):
    """(distinct, all) fused computations of an optimized HLO module: names, metadata and
    parameter numbers left out, so two kernels XLA compiles once count once."""
    bodies = re.findall(r"^%fused_computation[\w.]* \(.*?\n}", hlo, re.S | re.M)
    distinct = set()
    for body in bodies:
        body = body.split("\n", 1)[1]
        body = re.sub(r"metadata=\{[^}]*\}|, backend_config=.*", "", body)
        distinct.add(re.sub(r"%?[A-Za-z_][\w\-]*(\.\d+)+|param_\d+", "X", body))
    return len(distinct), len(bodies)


OPTIMIZERS = [
    ("adamw-foreach", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("adamw-syncfree", lambda ps: syncfree.AdamW(ps, lr=1e-2)),
    ("adamw-fused", lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)),
]
# torch's fused AdamW keeps a step count per parameter: each small member's bias corrections are
# still kernels of its own (Note [Flat optimizer updates]), so its kernels grow with depth
SHARED_KERNELS = OPTIMIZERS[:2]


@pytest.mark.parametrize("name,make_opt", SHARED_KERNELS, ids=[o[0] for o in SHARED_KERNELS])
def test_distinct_kernels_of_a_step_do_not_grow_with_depth(name, make_opt):
    # depth 4 already has the three kinds of layer: the first, the middle ones and the last
    shallow_distinct, shallow_all = _kernels(_train(4, make_opt)[1])
    deep_distinct, deep_all = _kernels(_train(10, make_opt)[1])
    assert deep_all > shallow_all + 6 * 3  # the deep program has more kernels: it has more layers
    assert deep_distinct == shallow_distinct


def _member_by_member(monkeypatch):
    """The program stage as before these changes: per-element scalars, foreach ops member by
    member, pieces read by static slices."""
    monkeypatch.setattr(foreach, "_same_numbers", lambda col: False)
    monkeypatch.setattr(foreach, "apply_flat", lambda fn, calls, limit: batching.apply_batched(
        fn, calls))  # fmt: skip
    monkeypatch.setattr(cache, "piece_offsets", lambda graph: [])
    monkeypatch.setattr(cache, "program_of", lambda graph, offsets=False: build.program_of(graph))


@pytest.mark.parametrize("name,make_opt", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_same_bits_as_member_by_member(name, make_opt, monkeypatch):
    shared, hlo = _train(4, make_opt)
    cache.clear_memory_cache()
    with monkeypatch.context() as m:
        _member_by_member(m)
        separate, old_hlo = _train(4, make_opt)
    cache.clear_memory_cache()
    assert _kernels(hlo)[0] < _kernels(old_hlo)[0]  # the switch-off above did switch it off
    for a, b in zip(shared, separate):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_only_equal_numbers_share_a_scalar():
    same = foreach._same_numbers
    assert same([0.5, 0.5, 0.5]) and same([3, 3])
    assert not same([0.5, 0.25]) and not same([0.5]) and not same((0.5, 0.5))
    assert not same([0.0, -0.0])  # equal, but a different sign of zero
    assert not same([1, 1.0]) and not same([True, True]) and not same([float("nan")] * 2)
