"""An FSDP training job (compiler path) of P processes x D devices that checkpoints every 2 steps
and resumes itself from the newest complete checkpoint: the job tools/resume_faults.py kills with
SIGKILL and resumes on the same and on another layout.

    [torchrun --nproc_per_node P] resume_fault_worker.py CKPT LOG --steps S [--async_save]
    (CPU_NUM_DEVICES=D)

An MLP wrapped in FSDPv2 on a 1-D ``fsdp`` mesh of every device of the job, AdamW. Each process
takes its share of a global batch of 8 from a ``StatefulDistributedSampler`` (P replicas) and
feeds it as its local batch (``sharding.data.global_batch``). ``CheckpointManager`` saves the
model, the optimizer and the sampler every 2 steps (``save`` or ``save_async``; DCP, each process
its own shards). On start it restores the newest complete checkpoint in CKPT, if any, and prints
``resumed from step N``. The log protocol is tests/resume_worker.py's: every step appends a JSON
line to ``LOG.<rank>`` (fsync'ed: a ``kill -9`` loses nothing written) with the step, the global
loss and this rank's sample ids; ``step-begin``/``save-begin``/``save-end`` markers and a ``pid``
line let the tool kill it at a chosen moment; at the end rank 0 writes the full weights to
``LOG.weights.pt``.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before the first device use: this process joins with all its devices

import torch.distributed as dist  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
from torchacc.distributed.checkpoint import prime_optimizer  # noqa: E402
from torchacc.distributed.checkpoint_manager import CheckpointManager  # noqa: E402
from torchacc.distributed.data_state import StatefulDistributedSampler  # noqa: E402
from torchacc.sharding import data  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

p = argparse.ArgumentParser()
p.add_argument("ckpt")
p.add_argument("log")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--async_save", action="store_true")
args = p.parse_args()

WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
GLOBAL_BATCH = 8
log = open(f"{args.log}.{RANK}", "a", buffering=1)


def emit(**kw):
    log.write(json.dumps(kw) + "\n")
    log.flush()
    os.fsync(log.fileno())


emit(pid=os.getpid())
if WORLD > 1:
    dist.init_process_group("gloo")  # DCP coordinates the processes through it
DEV = torchacc.device()
N = xr.global_runtime_device_count()
MESH = xs.Mesh(np.arange(N), (N,), ("fsdp",))


def features(ids):
    g = torch.tensor(ids, dtype=torch.float64)
    return torch.stack([torch.sin(g * (k + 1) * 0.29) for k in range(16)], 1).float()


def layout(t):
    return MESH.named_sharding(("fsdp",) + (None,) * (t.dim() - 1), tuple(t.shape))


torch.manual_seed(0)
mlp = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
    torch.nn.Linear(64, 4),
)  # fmt: skip
model = FSDPv2(mlp.to(DEV), MESH)
opt = prime_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
dataset = torch.utils.data.TensorDataset(torch.arange(256))
sampler = StatefulDistributedSampler(dataset, num_replicas=WORLD, rank=RANK, seed=4)
mgr = CheckpointManager(args.ckpt, save_interval=2, max_to_keep=3)


def state():
    return {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler}


start = 0
latest = mgr.latest_step()
if latest is not None:
    sd = state()
    mgr.restore(latest, sd)
    opt.load_state_dict(sd["optim"])
    start = latest
    msg = f"resumed from step {latest} (rank {RANK} of {WORLD})"
    if mgr.incomplete:
        msg += f"; skipped incomplete {mgr.incomplete}"
    print(msg, flush=True)
    emit(resumed=latest, incomplete=mgr.incomplete)

order = iter(sampler)
for step in range(start + 1, args.steps + 1):
    emit(event="step-begin", step=step)
    ids = [next(order) for _ in range(GLOBAL_BATCH // WORLD)]  # this process's share
    x = features(ids)
    x, y = data.global_batch((x, x[:, :4].cos()), layout)
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    torchacc.sync()
    emit(step=step, loss=loss.item(), ids=ids)
    if mgr.should_save(step):
        emit(event="save-begin", step=step)
        (mgr.save_async if args.async_save else mgr.save)(step, state())
        emit(event="save-end", step=step)
mgr.join()
weights = {k: v.detach().cpu().clone() for k, v in mlp.state_dict().items()}  # every rank gathers
if RANK == 0:
    torch.save(weights, f"{args.log}.weights.pt")
emit(event="done")
log.close()
if WORLD > 1:
    dist.barrier()
    dist.destroy_process_group()
