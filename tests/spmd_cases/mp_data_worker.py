"""One rank of a 2-process x 2-device SPMD job where every process loads its own data
(tests/test_spmd_data.py starts it with torchrun; Note [Per-process batches] in
torchacc/sharding/data.py).

Each rank reads its share of the data through a ``DistributedSampler``; the model trained on the
global array those shares make must match eager PyTorch trained on the global batch (rank 0's
batch, then rank 1's). Cases: GPT-2 (tiny config) under FSDPv2 with ``MpDeviceLoader``
``input_sharding``, ``ta.accelerate`` with ``dist.fsdp``, and local batches that disagree across
ranks. Writes what it saw to ``<out>.<rank>.json``.
"""

import json
import os
import sys

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before the first device use: this process joins with both its devices

from compile_counts import new_graphs  # noqa: E402

import torchacc as ta  # noqa: E402
import torchacc.torch_xla.distributed.parallel_loader as pl  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
from gallery.gpt.data import MockTokens  # noqa: E402
from gallery.gpt.model import CONFIGS, GPT  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.sharding import data  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
STEPS, LOCAL_BATCH, SEQ = 4, 4, 16


def loaders(dataset, batch_size=LOCAL_BATCH):
    """Every rank's host loader (this rank's is the one it feeds)."""
    return [
        DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=DistributedSampler(dataset, num_replicas=WORLD, rank=r, shuffle=False),
            drop_last=True,
        )
        for r in range(WORLD)
    ]


def global_batches(per_rank):
    """The global batch of each step: every rank's batch in rank order."""
    out = []
    for parts in zip(*per_rank):
        out.append(tuple(torch.cat(ts) for ts in zip(*parts)))
    return out


def lm_loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def param_err(model, ref):
    return max(
        (p.detach().cpu() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )


def gpt_fsdp():
    """GPT-2 (tiny config) FSDPv2 over 4 devices, fed by MpDeviceLoader with input_sharding."""
    cfg = CONFIGS["gpt-tiny"]
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = GPT(cfg)
    model.load_state_dict(ref.state_dict())
    mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))
    model = FSDPv2(model.to(ta.device()), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    dataset = MockTokens(cfg.vocab_size, SEQ, num_samples=WORLD * LOCAL_BATCH * STEPS)
    hosts = loaders(dataset)
    spec = xs.ShardingSpec(mesh, ("fsdp", None))
    loader = pl.MpDeviceLoader(hosts[RANK], ta.device(), input_sharding=spec)
    local_bytes = [sum(t.numel() * t.element_size() for t in b) for b in hosts[RANK]]
    losses, shapes, stamps = [], [], []
    metrics.clear_all()
    for x, y in loader:  # taking a batch runs the previous step and uploads this one
        stamps.append((new_graphs(), metrics.counter_value("TransferToDeviceBytes") or 0))
        shapes.append(list(x.shape))
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)  # read after the loader's last sync
    stamps.append((new_graphs(), stamps[-1][1]))
    graphs = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])]  # programs built by step i
    sent = [stamps[0][1]] + [b[1] - a[1] for a, b in zip(stamps, stamps[1:-1])]
    losses = [loss.item() for loss in losses]
    ref_losses, globals_ = [], global_batches(hosts)
    for x, y in globals_:
        rloss = lm_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(rloss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "param_err": param_err(model, ref),
        "graphs": graphs,
        "sent_bytes": sent,
        "local_bytes": local_bytes,
        "global_bytes": [sum(t.numel() * t.element_size() for t in b) for b in globals_],
        "shapes": shapes,
    }


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32)
        self.fc2 = torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n):
        gen = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 16, generator=gen), torch.randn(n, 4, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def accelerate_fsdp(topology=None, tp=1):
    """ta.accelerate(model, per-rank loader, dist.fsdp.size=2) under torchrun: dp 2 x fsdp 2
    (``topology``: the mesh's axis order, default dp outer: fsdp within a process)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4))
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(16, 4))
    model.load_state_dict(ref.state_dict())
    dataset = Pairs(WORLD * LOCAL_BATCH * STEPS)
    hosts = loaders(dataset)
    config = ta.Config()
    config.dist.fsdp.size = 2 if tp == 1 else 1
    config.dist.tp.size = tp
    if topology is not None:
        config.dist.topology = topology
    model, loader = ta.accelerate(model, hosts[RANK], config)
    w = model[0].fc1.weight
    processes_of_shard0 = sorted(
        d.process_index
        for d, index in w._st.value.buf.sharding.devices_indices_map(tuple(w.shape)).items()
        if (index[0].start or 0) == 0
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss)
    losses = [loss.item() for loss in losses]
    ref_losses, own_half = [], []
    for (x, y), (x0, y0) in zip(global_batches(hosts), hosts[RANK]):
        with torch.no_grad():
            own_half.append(torch.nn.functional.mse_loss(ref(x0), y0).item())
        rloss = torch.nn.functional.mse_loss(ref(x), y)
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(rloss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "own_half": own_half,
        "param_err": param_err(model, ref),
        "processes_of_shard0": processes_of_shard0,
    }


def disagreeing(kind):
    """Local batches that differ across ranks: each rank must get a ValueError, not a hang."""
    if kind == "shape":  # rank 1's batches hold 3 rows, rank 0's 4
        batches = [(torch.zeros(4 - RANK, 16),) for _ in range(2)]
    elif kind == "split":  # 3 rows on every rank: not a multiple of its 2 devices
        batches = [(torch.zeros(3, 16),)]
    else:  # rank 1 has one batch more
        batches = [(torch.zeros(4, 16),) for _ in range(2 + RANK)]
    try:
        for (x,) in pl.MpDeviceLoader(batches, ta.device()):
            x.sum().item()
    except ValueError as e:
        return str(e)
    return None


out = sys.argv[1]
result = {"gpt": gpt_fsdp(), "accelerate": accelerate_fsdp()}
result["accelerate_fsdp_outer"] = accelerate_fsdp(["fsdp", "dp", "pp", "tp"])
result["accelerate_tp"] = accelerate_fsdp(tp=2)  # dp 2 x tp 2
(g,) = data.global_batch((torch.full((2, 3), float(RANK)),))  # the trainer's per-step upload
result["global_batch"] = g.cpu()[:, 0].tolist()
result["shape_error"] = disagreeing("shape")
result["count_error"] = disagreeing("count")
result["split_error"] = disagreeing("split")
with open(f"{out}.{RANK}.json", "w") as f:
    json.dump(result, f)
