"""An unchanged torch_xla script: init_process_group("xla", init_method="xla://"), one
all_reduce, an ``xm.rendezvous`` with payloads, and an ``xm.save`` by the master. Run by
tests/test_compat_torch_xla_api.py (1 process and torchrun with 2)."""

import json
import sys

import torch
import torch.distributed as dist
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.xla_backend  # noqa: F401
import torch_xla.runtime as xr

dist.init_process_group("xla", init_method="xla://")
t = torch.full((2,), float(xr.global_ordinal() + 1), device=torch_xla.device())
dist.all_reduce(t)
torch_xla.sync()
payloads = xm.rendezvous("payloads", f"from {xr.process_index()}".encode())
xm.save({"t": t}, f"{sys.argv[1]}.saved.pt")  # the master writes, every rank waits for it
out = {
    "rank": dist.get_rank(),
    "world": dist.get_world_size(),
    "sum": t.cpu().tolist(),
    "process": [xr.process_index(), xr.process_count()],
    "payloads": [p.decode() for p in payloads],
    "saved": torch.load(f"{sys.argv[1]}.saved.pt")["t"].tolist(),
}
dist.destroy_process_group()
with open(f"{sys.argv[1]}.{out['rank']}.json", "w") as f:
    json.dump(out, f)
