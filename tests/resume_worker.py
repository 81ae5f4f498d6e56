"""A tiny data-parallel training job that checkpoints and resumes itself (issue 42's fault tests:
tests/test_resume_faults.py, tools/resume_faults.py).

    [torchrun --nproc_per_node W [--max-restarts N]] tests/resume_worker.py CKPT LOG \
        --steps S [--global_batch 8] [--async_save]

Each process trains an MLP on the torchacc device on its share of a global batch
(``StatefulDistributedSampler`` + ``ta.AsyncLoader``), averaging gradients with ``xm.all_reduce``
when there are several processes; ``CheckpointManager`` saves the model, the optimizer and the
loader every 2 steps (DCP, one shard file per process). On start it restores the newest complete
checkpoint in CKPT, if any, and prints ``resumed from step N``. Every step appends one JSON line
to ``LOG.<rank>`` (flushed: a ``kill -9`` loses nothing written): the step, the global loss, this
rank's sample ids. Markers ``save-begin``/``save-end``/``step-begin`` let a test kill it at a
chosen moment; ``pid`` lines give the processes' ids. At the end rank 0 writes the weights to
``LOG.weights.pt``. ``RESUME_FAULT=rank:step`` makes that rank kill itself with SIGKILL at that
step, in the first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): a job under
``--max-restarts`` must then come back by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import torchacc as ta
import torchacc.torch_xla.core.xla_model as xm
from torchacc.distributed.checkpoint import prime_optimizer
from torchacc.distributed.checkpoint_manager import CheckpointManager
from torchacc.distributed.data_state import StatefulDistributedSampler

p = argparse.ArgumentParser()
p.add_argument("ckpt")
p.add_argument("log")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--global_batch", type=int, default=8)
p.add_argument("--async_save", action="store_true")
p.add_argument("--width", type=int, default=64)
args = p.parse_args()

world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
log = open(f"{args.log}.{rank}", "a", buffering=1)


def emit(**kw):
    log.write(json.dumps(kw) + "\n")
    log.flush()
    os.fsync(log.fileno())


emit(pid=os.getpid(), attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
if world > 1:
    # a restarted attempt may find the previous attempt's keys in torchrun's store (its gloo
    # addresses: connecting to them hangs): each attempt's keys under a prefix of their own
    base, _, _ = next(dist.rendezvous("env://", rank, world))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"resume_worker/attempt{attempt}", base)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
emit(event="process-group")
dev = ta.device()
emit(event="device")
fault = os.environ.get("RESUME_FAULT")
fault_rank, fault_step = map(int, fault.split(":")) if fault else (-1, -1)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

torch.manual_seed(0)
w = args.width
model = nn.Sequential(nn.Linear(8, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(), nn.Linear(w, 1))
model.to(dev)
opt = prime_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
data = TensorDataset(torch.arange(400))
sampler = StatefulDistributedSampler(data, num_replicas=world, rank=rank, seed=11, drop_last=True)
loader = ta.AsyncLoader(
    DataLoader(data, batch_size=args.global_batch // world, sampler=sampler), dev
)
mgr = CheckpointManager(args.ckpt, save_interval=2, max_to_keep=3)


def state():
    return {"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader}


start = 0
latest = mgr.latest_step()
if latest is not None:
    sd = state()
    mgr.restore(latest, sd)
    opt.load_state_dict(sd["optim"])
    start = latest
    msg = f"resumed from step {latest} (rank {rank} of {world})"
    if mgr.incomplete:
        msg += f"; skipped incomplete {mgr.incomplete}"
    print(msg, flush=True)
    emit(resumed=latest, incomplete=mgr.incomplete)


def features(ids):
    g = ids.to(torch.float64)
    cols = [torch.sin(g * (k + 1) * 0.37) for k in range(8)]
    return torch.stack(cols, 1).to(torch.float32)


it = iter(loader)
for step in range(start + 1, args.steps + 1):
    emit(event="step-begin", step=step)
    if first_attempt and rank == fault_rank and step == fault_step:
        os.kill(os.getpid(), signal.SIGKILL)
    (ids,) = next(it)
    host_ids = ids.cpu()
    x = features(host_ids).to(dev)
    y = x.sum(1, keepdim=True).tanh()
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if world > 1:
        grads = [q.grad for q in model.parameters()]
        xm.all_reduce("sum", grads, scale=1.0 / world)
        loss = xm.all_reduce("sum", loss.detach(), scale=1.0 / world)
    opt.step()
    ta.sync()
    emit(step=step, loss=loss.item(), ids=host_ids.tolist())
    if mgr.should_save(step):
        emit(event="save-begin", step=step)
        if args.async_save:
            mgr.save_async(step, state())
        else:
            mgr.save(step, state())
        emit(event="save-end", step=step)
mgr.join()
if rank == 0:
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, f"{args.log}.weights.pt")
emit(event="done")
log.close()
sys.stdout.flush()
if world > 1:
    dist.barrier()
time.sleep(0)
