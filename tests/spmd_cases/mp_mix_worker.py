"""One rank of a 2-process x 2-device job mixing per-process code with sharding in one step
(tests/test_sharding_regions.py starts it with torchrun).

Each process trains its replica of a linear model on its own batch, the weight sharded over
its 2 local devices (FSDP inside the process, XLA's partitioner), and averages the gradients
across the 2 processes with ``xm.all_reduce`` (a manual region over the process axis of the
job-wide mesh), in one program per step. Checked against eager on the global batch. Then
blocking ``dist.send``/``recv`` on the ``xla`` process group between the two processes (Note
[Send and receive in SPMD mode] in torchacc/sharding/point_to_point.py): a replicated tensor,
one split over the local devices, and a receive buffer of another layout (a ValueError on both).
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.core.xla_model as xm  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402

rank = int(os.environ["RANK"])
dev = torchacc.device()
mesh = xs.Mesh([0, 1, 2, 3], (2, 2), ("dp", "fsdp"))  # a row per process
torch.manual_seed(0)
ref = torch.nn.Linear(4, 6)
model = torch.nn.Linear(4, 6)
model.load_state_dict(ref.state_dict())
model = model.to(dev)
xs.mark_sharding(model.weight, mesh, ("fsdp", None))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(1)
graphs, errs = [], []
for _ in range(4):
    xg, yg = torch.randn(8, 4, generator=gen), torch.randn(8, 6, generator=gen)
    x, y = xg[rank * 4 : rank * 4 + 4], yg[rank * 4 : rank * 4 + 4]  # this process's half
    before = new_graphs()
    loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
    loss.backward()
    xm.all_reduce(xm.REDUCE_SUM, [p.grad for p in model.parameters()], scale=0.5)
    opt.step()
    opt.zero_grad()
    xm.mark_step()
    graphs.append(new_graphs() - before)
    torch.nn.functional.mse_loss(ref(xg), yg).backward()
    ropt.step()
    ropt.zero_grad()
    errs.append(
        max(
            (p.detach().cpu() - q.detach()).abs().max().item()
            for p, q in zip(model.parameters(), ref.parameters())
        )
    )
spec = xs.sharding_of(model.weight) if hasattr(xs, "sharding_of") else None

import torch.distributed as dist  # noqa: E402

import torchacc.distributed.xla_backend  # noqa: E402, F401

dist.init_process_group(backend="xla", init_method="env://")
p2p = []
peer = 1 - rank
mine = (torch.arange(8.0).reshape(4, 2) + 100 * rank).to(dev)  # each process's own value
got = torch.zeros(4, 2).to(dev)
(dist.send if rank == 0 else dist.recv)(mine if rank == 0 else got, peer)
(dist.recv if rank == 0 else dist.send)(got if rank == 0 else mine * 2, peer)
base = torch.arange(8.0).reshape(4, 2)
want = (base + 100) * 2 if rank == 0 else base  # rank 1's doubled value back, rank 0's value
p2p.append(("replicated", torch.equal(got.cpu(), want)))
split, into = mine + 1, torch.zeros(4, 2).to(dev)
xs.mark_sharding(split, mesh, ("fsdp", None))
xs.mark_sharding(into, mesh, ("fsdp", None))
(dist.send if rank == 1 else dist.recv)(split if rank == 1 else into, peer)
if rank == 0:
    p2p.append(("split", torch.equal(into.cpu(), torch.arange(8.0).reshape(4, 2) + 101)))
    p2p.append(("layout", str(xs.sharding_of(into).spec) if hasattr(xs, "sharding_of") else ""))
try:
    (dist.send if rank == 1 else dist.recv)(split if rank == 1 else torch.zeros(4, 2).to(dev), peer)
    p2p.append(("other layout", "no error"))
except ValueError as e:
    p2p.append(("other layout", "same shape, dtype and layout" in str(e)))
out = sys.argv[1]
with open(f"{out}.{rank}.json", "w") as f:
    json.dump({"graphs": graphs, "errs": errs, "spec": str(spec), "p2p": p2p}, f)
