"""One rank of a 2-process x 2-device job mixing per-process code with sharding in one step,
fed by per-process loaders (tests/test_spmd_data.py starts it with torchrun).

Each process reads its share of the data (``DistributedSampler``) through ``MpDeviceLoader`` with
``input_sharding`` over its local ``fsdp`` axis only, so its batch stays its own (Note
[Per-process batches] in torchacc/sharding/data.py); the weights are sharded over the 2 local
devices (FSDP inside the process) and ``hvd.DistributedOptimizer`` averages the gradients across
the 2 processes (a manual region over the process axis). Checked against eager PyTorch on the
global batch, with the programs built per step and the bytes each process uploads.
"""

import json
import os
import sys

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

from compile_counts import new_graphs  # noqa: E402

import torchacc as ta  # noqa: E402
import torchacc.horovod as hvd  # noqa: E402
import torchacc.torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
from torchacc import metrics  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
STEPS, LOCAL_BATCH = 4, 4
hvd.init()


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


torch.manual_seed(0)
ref, model = mlp(), mlp()
model.load_state_dict(ref.state_dict())
model = model.to(ta.device())
mesh = xs.Mesh([0, 1, 2, 3], (2, 2), ("dp", "fsdp"))  # a row per process
for layer in (model[0], model[2]):
    xs.mark_sharding(layer.weight, mesh, ("fsdp", None))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)

gen = torch.Generator().manual_seed(1)
data = TensorDataset(
    torch.randn(WORLD * LOCAL_BATCH * STEPS, 8, generator=gen),
    torch.randn(WORLD * LOCAL_BATCH * STEPS, 4, generator=gen),
)
hosts = [
    DataLoader(
        data,
        batch_size=LOCAL_BATCH,
        sampler=DistributedSampler(data, WORLD, r, shuffle=False),
        drop_last=True,
    )
    for r in range(WORLD)
]
loader = pl.MpDeviceLoader(
    hosts[RANK], ta.device(), input_sharding=xs.ShardingSpec(mesh, ("fsdp", None))
)
stamps, shapes, losses = [], [], []
metrics.clear_all()
for x, y in loader:
    stamps.append((new_graphs(), metrics.counter_value("TransferToDeviceBytes") or 0))
    shapes.append(list(x.shape))
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss)
stamps.append((new_graphs(), stamps[-1][1]))
graphs = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]
sent = [stamps[0][1]] + [b[1] - a[1] for a, b in zip(stamps, stamps[1:-1])]
losses = [loss.item() for loss in losses]  # this process's loss on its own batch

ref_losses, own_losses = [], []
for parts in zip(*hosts):
    xg, yg = (torch.cat(ts) for ts in zip(*parts))
    with torch.no_grad():
        x0, y0 = parts[RANK]
        own_losses.append(torch.nn.functional.mse_loss(ref(x0), y0).item())
    rloss = torch.nn.functional.mse_loss(ref(xg), yg)
    rloss.backward()
    ropt.step()
    ropt.zero_grad()
    ref_losses.append(rloss.item())
err = max(
    (p.detach().cpu() - q.detach()).abs().max().item()
    for p, q in zip(model.parameters(), ref.parameters())
)
local_bytes = [sum(t.numel() * t.element_size() for t in b) for b in hosts[RANK]]
with open(f"{sys.argv[1]}.{RANK}.json", "w") as f:
    json.dump(
        {
            "graphs": graphs,
            "param_err": err,
            "losses": losses,
            "own_losses": own_losses,
            "ref_losses": ref_losses,
            "shapes": shapes,
            "sent_bytes": sent,
            "local_bytes": local_bytes,
        },
        f,
    )
