"""FSDP training (compiler path) of P processes x D devices that checkpoints and resumes on
another layout (tests/test_resume_layouts.py, tools/resume_layouts.py).

    [torchrun --nproc_per_node P] resume_mp_worker.py DIR ROLE   (CPU_NUM_DEVICES=D)

An MLP (with a dropout layer in the ``dropout`` runs) wrapped in FSDPv2 on a 1-D ``fsdp`` mesh of
every device of the job, AdamW. Each process takes its share of a global batch of 8 samples from a
``StatefulDistributedSampler`` (P replicas) and feeds it as its local batch
(``sharding.data.global_batch``: the processes' shares make one global array). A
``CheckpointManager`` over the job saves the model, the optimizer, the sampler and the RNG streams
every 2 steps. One process set does several runs (the programs compile once):

- ROLE ``source`` (the saving layout): ``ref`` (6 steps, saves into DIR/ck), ``same`` (resumes
  DIR/ck's step 2 on this layout), ``ref_dropout`` (6 steps with dropout, saves into DIR/ckd) and
  ``same_dropout`` (resumes DIR/ckd's step 2 with its RNG streams);
- ROLE ``target`` (another layout): ``alone`` (6 uninterrupted steps, no saves) and ``resumed``
  (resumes DIR/ck's step 2; the RNG streams are not restored: they belong to the saving layout).

Each rank writes ``DIR/<ROLE>.<P>x<D>.<rank>.json``: per run the losses by step, this rank's
sample ids by step and (rank 0) the final weights as flat lists.
"""

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
from torchacc.distributed.checkpoint_manager import CheckpointManager, RNGState  # noqa: E402
from torchacc.distributed.data_state import StatefulDistributedSampler  # noqa: E402
from torchacc.sharding import data  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

workdir, role = sys.argv[1], sys.argv[2]
WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
if WORLD > 1:
    dist.init_process_group("gloo")  # DCP coordinates the processes through it
DEV = torchacc.device()
N = xr.global_runtime_device_count()
LOCAL = N // WORLD
MESH = xs.Mesh(np.arange(N), (N,), ("fsdp",))
GLOBAL_BATCH, STEPS, SAVE_AT = 8, 6, 2


def features(ids):
    g = torch.tensor(ids, dtype=torch.float64)
    return torch.stack([torch.sin(g * (k + 1) * 0.29) for k in range(16)], 1).float()


def layout(t):
    return MESH.named_sharding(("fsdp",) + (None,) * (t.dim() - 1), tuple(t.shape))


def run(name, ckpt=None, resume=None, dropout=False, restore_rng=True):
    """One training run from a fresh model; ``resume``: (directory, step) to restore first."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 64), torch.nn.GELU()]
    if dropout:
        layers.append(torch.nn.Dropout(0.25))
    layers += [torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)]
    mlp = torch.nn.Sequential(*layers)
    model = FSDPv2(mlp.to(DEV), MESH)
    opt = prime_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    dataset = torch.utils.data.TensorDataset(torch.arange(256))
    sampler = StatefulDistributedSampler(dataset, num_replicas=WORLD, rank=RANK, seed=4)
    torch.manual_seed(1)  # the streams the steps draw from (dropout)
    rng = RNGState()

    def state(with_rng=True):
        sd = {"model": model.state_dict(), "optim": opt.state_dict(), "sampler": sampler}
        return {**sd, "rng": rng} if with_rng else sd

    start = 0
    if resume is not None:
        sd = state(with_rng=restore_rng)
        CheckpointManager(resume[0], save_interval=SAVE_AT).restore(resume[1], sd)
        opt.load_state_dict(sd["optim"])
        start = resume[1]
    mgr = CheckpointManager(ckpt, save_interval=SAVE_AT) if ckpt else None
    losses, seen = {}, {}
    order = iter(sampler)
    for step in range(start + 1, STEPS + 1):
        ids = [next(order) for _ in range(GLOBAL_BATCH // WORLD)]  # this process's share
        x = features(ids)
        x, y = data.global_batch((x, x[:, :4].cos()), layout)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        torchacc.sync()
        losses[step], seen[step] = loss.item(), ids
        if mgr is not None and mgr.should_save(step):
            mgr.save(step, state())
    weights = {k: v.detach().cpu().reshape(-1).tolist() for k, v in mlp.state_dict().items()}
    return {"losses": losses, "seen": seen, "weights": weights if RANK == 0 else None}


runs = {}
ck, ckd = os.path.join(workdir, "ck"), os.path.join(workdir, "ckd")
if role == "source":
    runs["ref"] = run("ref", ckpt=ck)
    runs["same"] = run("same", resume=(ck, SAVE_AT))
    runs["ref_dropout"] = run("ref_dropout", ckpt=ckd, dropout=True)
    runs["same_dropout"] = run("same_dropout", resume=(ckd, SAVE_AT), dropout=True)
elif role == "target":
    runs["alone"] = run("alone")
    runs["resumed"] = run("resumed", resume=(ck, SAVE_AT), restore_rng=False)
else:
    raise SystemExit(f"resume_mp_worker.py: unknown role {role!r} (source or target)")
with open(os.path.join(workdir, f"{role}.{WORLD}x{LOCAL}.{RANK}.json"), "w") as f:
    json.dump({"world": WORLD, "local": LOCAL, "runs": runs}, f)
if WORLD > 1:
    dist.barrier()
    dist.destroy_process_group()
