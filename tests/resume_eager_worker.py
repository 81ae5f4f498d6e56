"""The eager fallback's FSDP2 training (``ta.accelerate(backend='eager')``) that checkpoints and
resumes on another number of processes (tests/test_resume_layouts.py, tools/resume_layouts.py
--eager).

    [torchrun --nproc_per_node W] resume_eager_worker.py DIR ROLE

W processes on CPU gloo: 4 are HSDP (``dist.dp`` 2 x ``dist.fsdp`` 2: FSDP2 over a 2-D device
mesh), 2 are FSDP2 over 2, 1 is the plain model. An MLP (with dropout in the ``dropout`` runs),
AdamW; each process takes its share of a global batch of 8 samples from a
``StatefulDistributedSampler`` (W replicas). ``CheckpointManager`` (torch DCP) saves torch's
``get_state_dict`` of the model and the optimizer (DTensors: each process writes its shards), the
sampler and the CPU RNG streams (``RNGState(device=False)``) every 2 steps; a restore loads them
resharded to this run's layout and hands them back with ``set_state_dict``. The roles and the
output are tests/spmd_cases/resume_mp_worker.py's (``DIR/<ROLE>.<W>x1.<rank>.json``); the loss
of a step is the mean over the processes (the global batch's).
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc as ta  # noqa: E402
from torchacc.distributed.checkpoint_manager import CheckpointManager, RNGState  # noqa: E402
from torchacc.distributed.data_state import StatefulDistributedSampler  # noqa: E402

workdir, role = sys.argv[1], sys.argv[2]
WORLD, RANK = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
GLOBAL_BATCH, STEPS, SAVE_AT = 8, 6, 2


class Net(torch.nn.Module):
    def __init__(self, dropout):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.drop = torch.nn.Dropout(0.25 if dropout else 0.0)
        self.fc2 = torch.nn.Linear(64, 64)
        self.fc3 = torch.nn.Linear(64, 4)

    def forward(self, x):
        x = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        return self.fc3(torch.nn.functional.gelu(self.fc2(x)))


def features(ids):
    g = torch.tensor(ids, dtype=torch.float64)
    return torch.stack([torch.sin(g * (k + 1) * 0.29) for k in range(16)], 1).float()


def build(dropout):
    torch.manual_seed(0)
    config = ta.Config(backend="eager")
    config.dist.dp.size = 2 if WORLD == 4 else 1
    config.dist.fsdp.size = WORLD // config.dist.dp.size
    config.dist.fsdp.wrap_layer_cls = {"Linear"}
    return ta.accelerate(copy.deepcopy(Net(dropout)), config=config)


def run(ckpt=None, resume=None, dropout=False, restore_rng=True):
    model = build(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dataset = torch.utils.data.TensorDataset(torch.arange(256))
    sampler = StatefulDistributedSampler(dataset, num_replicas=WORLD, rank=RANK, seed=4)
    torch.manual_seed(1 + RANK)  # each process's own dropout stream
    rng = RNGState(device=False)

    def state(with_rng=True):
        msd, osd = get_state_dict(model, opt)  # FQN keys; a fresh optimizer gets its state
        sd = {"model": msd, "optim": osd, "sampler": sampler}
        return {**sd, "rng": rng} if with_rng else sd

    start = 0
    if resume is not None:
        sd = state(with_rng=restore_rng)
        CheckpointManager(resume[0], save_interval=SAVE_AT).restore(resume[1], sd)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        start = resume[1]
    mgr = CheckpointManager(ckpt, save_interval=SAVE_AT) if ckpt else None
    losses, seen = {}, {}
    order = iter(sampler)
    for step in range(start + 1, STEPS + 1):
        ids = [next(order) for _ in range(GLOBAL_BATCH // WORLD)]  # this process's share
        x = features(ids)
        loss = (model(x) - x[:, :4].cos()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        if WORLD > 1:
            dist.all_reduce(mean)
        losses[step], seen[step] = mean.item() / WORLD, ids
        if mgr is not None and mgr.should_save(step):
            mgr.save(step, state())
    msd, _ = get_state_dict(model, opt)
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in msd.items()}
    weights = {k: v.detach().reshape(-1).tolist() for k, v in full.items()}
    return {"losses": losses, "seen": seen, "weights": weights if RANK == 0 else None}


runs = {}
ck, ckd = os.path.join(workdir, "ck"), os.path.join(workdir, "ckd")
if role == "source":
    runs["ref"] = run(ckpt=ck)
    runs["same"] = run(resume=(ck, SAVE_AT))
    runs["ref_dropout"] = run(ckpt=ckd, dropout=True)
    runs["same_dropout"] = run(resume=(ckd, SAVE_AT), dropout=True)
elif role == "target":
    runs["alone"] = run()
    runs["resumed"] = run(resume=(ck, SAVE_AT), restore_rng=False)
else:
    raise SystemExit(f"resume_eager_worker.py: unknown role {role!r} (source or target)")
with open(os.path.join(workdir, f"{role}.{WORLD}x1.{RANK}.json"), "w") as f:
    json.dump({"world": WORLD, "local": 1, "runs": runs}, f)
if WORLD > 1:
    dist.barrier()
    dist.destroy_process_group()
