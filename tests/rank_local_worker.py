"""One rank of tests/test_distributed_rank_local.py (run under torchrun, 2 processes).

``log``: DDP-style steps (xm.reduce_gradients) with rank-0-only reads: ``ta.sync()`` then
``.item()`` on rank 0 only, and a read of a value only rank 0 computes; both ranks finish.
``skip``: rank 0 records an all_reduce that rank 1 skips; rank 0 must fail naming rank 1.
"""

import os
import sys

import torch

import torchacc as ta
import torchacc.torch_xla.core.xla_model as xm

rank = int(os.environ["RANK"])
mode = sys.argv[1]
dev = ta.device()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2).to(dev)
xm.broadcast_master_param(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if mode == "log":
    for step in range(4):
        x = torch.randn(8, 4).to(dev)
        loss = model(x).pow(2).mean()
        loss.backward()
        xm.reduce_gradients(opt)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ta.sync()
            print("step", step, loss.item(), flush=True)
            print("rank-0 only value", (model.weight * 3).sum().item(), flush=True)
        xm.mark_step()
    w = xm.all_reduce(xm.REDUCE_SUM, model.weight.detach().clone())
    same = torch.equal(w.cpu(), model.weight.detach().cpu() * 2)
    print(f"done {rank} same={same}", flush=True)
    sys.exit(0 if same else 3)
else:
    x = torch.ones(3).to(dev)
    xm.mark_step()
    if rank == 0:
        y = xm.all_reduce(xm.REDUCE_SUM, x)
        xm.mark_step()
        print("SKIP-NOT-DETECTED", y.cpu(), flush=True)
    else:
        xm.mark_step()
        import time

        time.sleep(60)  # alive, in host code: it never reaches the collective
