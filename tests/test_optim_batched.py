"""Batched optimizer updates (Note [Batched optimizer updates] in torchacc/lowering/batching.py):
same-shaped parameters updated as one vmapped update give the same bits as member by member."""

from __future__ import annotations

import pytest
import torch

import torchacc
from torchacc import metrics
from torchacc.lowering import batching
from torchacc.program import cache
from torchacc.torch_xla.amp import syncfree

DEV = torchacc.device()


def _model():
    torch.manual_seed(0)
    # 3 weights of one shape, 3 biases of another, one odd weight; weights above the pack limit
    # (TORCHACC_PACK_MAX_NUMEL 64 below) so they are batched, the biases packed and flat
    layers = [torch.nn.Linear(12, 12) for _ in range(3)] + [torch.nn.Linear(12, 3)]
    return torch.nn.Sequential(*layers).to(DEV)


def _train(make_opt, batched, steps=3):
    batching.enabled[0] = batched
    cache.clear_memory_cache()  # the setting is baked into the lowered programs
    metrics.clear_all()
    model = _model()
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 12, generator=g).to(DEV)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
    state = [t.cpu() for t in model.parameters()]
    state += [v.cpu() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return state, metrics.counter_value("BatchedOptimizerUpdate") or 0


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True, foreach=True),
        lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
        lambda p: syncfree.AdamW(p, lr=1e-2),
    ],
    ids=["fused_adamw", "foreach_adam_amsgrad", "fused_sgd_momentum", "syncfree_adamw"],
)
def test_batched_update_is_bit_identical(make_opt, monkeypatch):
    monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", "64")
    before = batching.enabled[0]  # off by default: later tests on this worker must see it so
    try:
        ref, none = _train(make_opt, batched=False)
        got, groups = _train(make_opt, batched=True)
    finally:
        batching.enabled[0] = before
        cache.clear_memory_cache()
    assert none == 0 and groups > 0
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
