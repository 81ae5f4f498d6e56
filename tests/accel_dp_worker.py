"""One rank of the 2-process ``accelerate()`` data-parallel check (tests/test_accel_dp.py).

Each rank trains on its half of every batch through ``accelerate()``: the lazy backend, then the
eager one (torch DDP over gloo), then eager FSDP2 (``fully_shard``); it writes its losses and final
parameters.
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
    for run in ("lazy", "eager", "eager-fsdp"):
        backend = run.split("-")[0]
        config = ta.Config(backend=backend)
        if run == "eager-fsdp":
            config.dist.fsdp.size = 2
            config.dist.fsdp.wrap_layer_cls = {"Linear"}
            config.dist.fsdp.sync_module_states = True
        # lazy: accelerate() broadcasts rank 0's weights; eager: DDP does at construction
        m, loader = ta.accelerate(copy.deepcopy(model), shard, config)
        losses = train(m, loader)
        inner = m.module if run == "eager" else m
        params = [getattr(p, "full_tensor", p.detach)() for p in inner.parameters()]
        result[run] = {
            "losses": losses,
            "params": [p.detach().cpu().flatten().tolist() for p in params],
        }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
