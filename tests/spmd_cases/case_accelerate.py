"""ta.accelerate's dist.fsdp / dist.tp on the lazy backend: the SPMD engine on 4 CPU devices
(run by tests/test_spmd.py with CPU_NUM_DEVICES=4)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc as ta  # noqa: E402
from torchacc.distributed import sharding  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _model():
    return torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4))


def _train(model, batches, device=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches:
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device is not None:
            ta.sync()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("fsdp,tp", [(4, 1), (2, 2)])
def test_fsdp_and_tp_on_the_lazy_backend_match_eager(fsdp, tp):
    torch.manual_seed(0)
    ref, model = _model(), _model()
    model.load_state_dict(ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(5)
    ]
    config = ta.Config()
    config.dist.fsdp.size = fsdp
    config.dist.tp.size = tp
    model = ta.accelerate(model, config=config)
    losses, opt = _train(model, batches, model.device)
    ref_losses, _ = _train(ref, batches)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.detach().cpu() - q.detach()).abs().max().item() <= 1e-5
    w = model[0].fc1.weight
    per_device = sharding.per_device_bytes([w])
    assert set(per_device.values()) == {w.numel() * 4 // 4}  # split four ways
    state = sharding.per_device_bytes([opt.state[w]["exp_avg"]])
    assert set(state.values()) == {w.numel() * 4 // 4}


def test_sizes_must_multiply_to_the_device_count():
    config = ta.Config()
    config.dist.fsdp.size = 3
    with pytest.raises(ValueError, match="world size 4"):
        ta.accelerate(_model(), config=config)
