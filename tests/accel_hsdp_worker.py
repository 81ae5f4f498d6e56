"""One rank of the 4-process ``accelerate(backend='eager')`` dp x fsdp check
(tests/test_accel_hsdp.py): HSDP, FSDP2 over a 2-D (dp 2, fsdp 2) device mesh on gloo. Each rank
trains on its quarter of every batch and writes its losses, its parameters' placements and local
shard sizes, and the full parameters at the end."""

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import accel_dp_worker as dp_worker  # noqa: E402

import torchacc as ta  # noqa: E402


def main(out):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(rank)  # different initial weights: sync_module_states broadcasts rank 0's
    model = dp_worker.Net()
    shard = [{k: v[rank::world] for k, v in b.items()} for b in dp_worker.batches()]
    config = ta.Config(backend="eager")
    config.dist.dp.size = 2
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"Linear"}
    config.dist.fsdp.sync_module_states = True
    m, loader = ta.accelerate(copy.deepcopy(model), shard, config)
    w = m.fc1.weight
    layout = {
        "placements": [type(p).__name__ for p in w.placements],
        "mesh": w.device_mesh.mesh.tolist(),
        "local_rows": w.to_local().shape[0],
    }
    losses = dp_worker.train(m, loader)
    params = [p.full_tensor().detach().flatten().tolist() for p in m.parameters()]
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"losses": losses, "params": params, "layout": layout}, f)


if __name__ == "__main__":
    main(sys.argv[1])
