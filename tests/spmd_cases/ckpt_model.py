"""The model, batches and step of the parallel checkpoint tests (shared by the 4-device case, the
2-device reload and the 1-device load in tests/test_parallel.py)."""

import torch


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 256)
        self.fc2 = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def plan(model, par):
    par.shard(model.fc1, None, parameter_plan={"weight": (2, 1), "bias": (2,)})
    par.shard(model.fc2, None, parameter_plan={"weight": (1, 2)})


def batch(step):
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(16, 64, generator=gen), torch.randn(16, 64, generator=gen)


def step(model, opt, i, device=None, sync=None):
    x, y = batch(i)
    if device is not None:
        x, y = x.to(device), y.to(device)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sync is not None:
        sync()
    return loss.item()


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)
