"""Switching to SPMD mode after device tensors exist (run by tests/test_sharding_regions.py with
CPU_NUM_DEVICES=4): ``xr.use_spmd()`` lays existing tensors out replicated over the mesh, and
``ta.accelerate`` called twice with another ``dist`` config works. The process starts with SPMD
mode off (each case file runs in a fresh process)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc as ta  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.sharding import api  # noqa: E402


def _step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_use_spmd_after_tensors_exist_then_accelerate_again():
    assert not xr.is_spmd()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    model.load_state_dict(ref.state_dict())
    config = ta.Config()  # first: plain data parallel on one device
    model = ta.accelerate(model, config=config)
    dev = ta.device()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(6)
    ]
    losses = []
    for x, y in batches[:2]:
        losses.append(_step(model, opt, x.to(dev), y.to(dev)))  # pending: use_spmd computes it
    xr.use_spmd()  # tensors (parameters, momenta, a pending step) move onto the mesh
    assert xr.is_spmd()
    mesh = xs.Mesh(list(range(4)), (4,), ("x",))
    xs.mark_sharding(model[0].weight, mesh, ("x", None))
    for x, y in batches[2:4]:
        losses.append(_step(model, opt, x.to(dev), y.to(dev)))
        ta.sync()
    # a second ta.accelerate with another dist config, in the same process: fsdp over 4
    config = ta.Config()
    config.dist.fsdp.size = 4
    model = ta.accelerate(model, config=config)
    for x, y in batches[4:]:
        losses.append(_step(model, opt, x.to(dev), y.to(dev)))
        ta.sync()
    ref_losses = [_step(ref, ropt, x, y).item() for x, y in batches]
    for a, b in zip(losses, ref_losses):
        assert abs(a.item() - b) <= 1e-5, (losses, ref_losses)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() <= 1e-5
    assert any(e is not None for e in api.sharding_of(model[2].weight).spec)  # fsdp-sharded
