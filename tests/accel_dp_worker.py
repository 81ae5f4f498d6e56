"""One rank of the 2-process ``accelerate()`` data-parallel check (tests/test_accel_dp.py).

Each rank trains on its half of every batch, through ``accelerate()`` with the lazy backend and
then with the eager one (torch DDP over gloo), and writes its losses and final parameters.
"""

import copy
import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchacc as ta


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.tanh(self.fc1(x))), y)


def batches(steps=4, batch=8):
    g = torch.Generator().manual_seed(1)
    return [
        {"x": torch.randn(batch, 6, generator=g), "y": torch.randint(0, 3, (batch,), generator=g)}
        for _ in range(steps)
    ]


def train(model, loader):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in loader:
        loss = model(**batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return [float(t) for t in losses]


def main(out):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)  # different initial weights: accelerate() must broadcast rank 0's
    model = Net()
    shard = [{k: v[rank::world] for k, v in b.items()} for b in batches()]
    result = {}
    for backend in ("lazy", "eager"):
        config = ta.Config(backend=backend)
        # lazy: accelerate() broadcasts rank 0's weights; eager: DDP does at construction
        m, loader = ta.accelerate(copy.deepcopy(model), shard, config)
        losses = train(m, loader)
        inner = m.module if backend == "eager" else m
        result[backend] = {
            "losses": losses,
            "params": [p.detach().cpu().flatten().tolist() for p in inner.parameters()],
        }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
