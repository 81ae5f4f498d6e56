"""One rank of a 2-process x 2-device SPMD job (tests/test_spmd.py starts it with torchrun).

Every rank trains the same MLP with 2-D data x model sharding over the global mesh of 4
devices and the same model under FSDPv2 on a HybridMesh (devices x processes), compares both
with eager PyTorch, and writes what it saw to ``<out>.<rank>.json``.
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before the first device use: this process joins with both its devices

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla._XLAC as _XLAC  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def train(mesh, prepare, data_spec, steps=5):
    torch.manual_seed(0)
    ref, model = mlp(), mlp()
    model.load_state_dict(ref.state_dict())
    model = prepare(model.to(torchacc.device()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses, graphs = [], []
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
        xd, yd = x.to(torchacc.device()), y.to(torchacc.device())
        xs.mark_sharding(xd, mesh, data_spec)
        before = new_graphs()
        loss = torch.nn.functional.mse_loss(model(xd), yd)
        loss.backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
        graphs.append(new_graphs() - before)
        rloss = torch.nn.functional.mse_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        losses.append([loss.item(), rloss.item()])
    err = max(
        (p.cpu() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    return model, {"losses": losses, "graphs": graphs, "param_err": err}


def two_d(model):
    xs.mark_sharding(model[0].weight, MESH, ("model", None))
    xs.mark_sharding(model[2].weight, MESH, (None, "model"))
    return model


out, rank = sys.argv[1], int(os.environ["RANK"])
result = {
    "devices": xr.global_runtime_device_count(),
    "local": xr.addressable_runtime_device_count(),
    "process_count": xr.process_count(),
}
MESH = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))
model, result["two_d"] = train(MESH, two_d, ("data", None))
result["two_d"]["spec"] = _XLAC._get_xla_sharding_spec(model[0].weight)
hybrid = xs.HybridMesh(ici_mesh_shape=(1, 2), dcn_mesh_shape=(2, 1), axis_names=("data", "fsdp"))
result["hybrid_ids"] = hybrid.device_ids.tolist()
model, result["fsdp"] = train(
    hybrid, lambda m: FSDPv2(m, hybrid, extra_data_axis="data"), (("data", "fsdp"), None)
)
result["fsdp"]["spec"] = _XLAC._get_xla_sharding_spec(model.module[0].weight)
with open(f"{out}.{rank}.json", "w") as f:
    json.dump(result, f)
