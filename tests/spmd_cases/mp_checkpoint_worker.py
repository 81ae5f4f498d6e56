"""One rank of a 2-process x 2-device job saving and loading a distributed checkpoint
(tests/test_spmd_checkpoint.py starts it with torchrun and checks what it wrote).

Both ranks train the tensor-parallel MLP and the FSDPv2 MLP of ckpt_models on the global 2x2
mesh (rows = processes), save through CheckpointManager (DCP over a gloo group), and restore
into fresh models with other layouts. Each rank writes ``<out>.<rank>.json``: the blocks it
planned to write and whether the restores were bit-identical.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

import torchacc.torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()  # before the first device use: this process joins with both its devices

from ckpt_models import build, host_copy, mesh, prime, state, step  # noqa: E402
from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: E402

import torchacc  # noqa: E402
from torchacc.distributed import checkpoint as engine  # noqa: E402
from torchacc.torch_xla.experimental.distributed_checkpoint import (  # noqa: E402
    CheckpointManager,
    prime_optimizer,
)

out, ckpt = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
DEV = torchacc.device()
TP_MESH = mesh(range(4), (2, 2), ("data", "model"))  # data = the processes
FSDP_MESH = mesh(range(4), (4, 1), ("fsdp", "model"))


def equal(sd, ref):
    flat, _ = flatten_state_dict(sd)
    bad = [
        k
        for k, v in flat.items()
        if isinstance(v, torch.Tensor) and not torch.equal(v.detach().cpu(), ref[k])
    ]
    return bad


tp, fsdp, opts = build(DEV, TP_MESH, FSDP_MESH, seed=0)
step(tp, fsdp, opts, DEV, seed=1)
sd = state(tp, fsdp, opts)
ref = host_copy(sd)
flat, _ = flatten_state_dict(sd)
written = {
    k: sorted(engine.unique_shards(v).pieces)
    for k, v in flat.items()
    if isinstance(v, torch.Tensor) and v.device.type == "torchacc"
}
mgr = CheckpointManager(ckpt, save_interval=1)
mgr.save(1, sd)

# the same layout
tp2, fsdp2, opts2 = build(DEV, TP_MESH, FSDP_MESH, seed=3)
prime(opts2, prime_optimizer)
target = state(tp2, fsdp2, opts2)
mgr.restore(1, target)
same = equal(target, ref)

# another layout: the tensor-parallel weight split on its columns, and the optimizer state of
# the FSDPv2 model replicated
tp3, fsdp3, opts3 = build(DEV, TP_MESH, FSDP_MESH, seed=4, tp_dim0=None)
prime(opts3, prime_optimizer)
target = state(tp3, fsdp3, opts3)
for v in target["opt_fsdp"]["state"].values():
    for name in ("exp_avg", "exp_avg_sq"):
        v[name] = torch.zeros(v[name].shape).to(DEV)
mgr.restore(1, target)
other = equal(target, ref)

with open(f"{out}.{rank}.json", "w") as f:
    json.dump(
        {
            "written": {k: [list(o) for o in offs] for k, offs in written.items()},
            "same_layout_mismatches": same,
            "other_layout_mismatches": other,
            "steps": mgr.all_steps(),
        },
        f,
    )
dist.destroy_process_group()
