"""FSDP training on one process with CPU_NUM_DEVICES devices that checkpoints and resumes
(tests/test_resume_layouts.py): its losses must not depend on where it was saved.

    CPU_NUM_DEVICES=D PJRT_DEVICE=CPU python resume_layout_worker.py CKPT OUT.json \
        --steps 6 [--from_step 2] [--dropout]

An MLP wrapped in FSDPv2 on a 1-D mesh of the D devices ("fsdp"), AdamW; each step takes a
global batch of 8 samples from ``torchacc.parallel.DistributedSampler(num_shards=D)``
(``global_batches``), the batch split over the devices. ``CheckpointManager`` saves the model,
the optimizer, the sampler and the RNG state every 2 steps. ``--from_step N`` restores step N
first and trains from there. OUT.json: the losses by step, the sample ids by step, the final
weights (flat lists).
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torchacc  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.distributed.checkpoint import prime_optimizer  # noqa: E402
from torchacc.distributed.checkpoint_manager import CheckpointManager  # noqa: E402
from torchacc.parallel.sampler import DistributedSampler  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

p = argparse.ArgumentParser()
p.add_argument("ckpt")
p.add_argument("out")
p.add_argument("--steps", type=int, default=6)
p.add_argument("--from_step", type=int, default=0)
args = p.parse_args()

xr.use_spmd()
dev = torchacc.device()
n = xr.global_runtime_device_count()
mesh = xs.Mesh(list(range(n)), (n,), ("fsdp",))
torch.manual_seed(0)
mlp = torch.nn.Sequential(
    torch.nn.Linear(16, 64),
    torch.nn.GELU(),
    torch.nn.Linear(64, 64),
    torch.nn.GELU(),
    torch.nn.Linear(64, 4),
)
model = FSDPv2(mlp.to(dev), mesh)
opt = prime_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
data = torch.utils.data.TensorDataset(torch.arange(256))
sampler = DistributedSampler(data, num_shards=n, shard_id=0, seed=4)
mgr = CheckpointManager(args.ckpt, save_interval=2)


def state():
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler}


start = 0
if args.from_step:
    sd = state()
    mgr.restore(args.from_step, sd)
    opt.load_state_dict(sd["optim"])
    start = args.from_step


def features(ids):
    g = torch.tensor(ids, dtype=torch.float64)
    return torch.stack([torch.sin(g * (k + 1) * 0.29) for k in range(16)], 1).float()


losses, seen = {}, {}
batches = sampler.global_batches(8)
for step in range(start + 1, args.steps + 1):
    ids = next(batches)
    x = features(ids).to(dev)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    y = x[:, :4].cos()
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torchacc.sync()
    losses[step], seen[step] = loss.item(), sorted(ids)
    if mgr.should_save(step):
        mgr.save(step, state())
weights = {k: v.detach().cpu().reshape(-1).tolist() for k, v in mlp.state_dict().items()}
with open(args.out, "w") as f:
    json.dump({"devices": n, "losses": losses, "seen": seen, "weights": weights}, f)
