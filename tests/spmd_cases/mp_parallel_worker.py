"""One rank of a 2-process x 2-device torchacc.parallel job (tests/test_parallel.py starts it
with torchrun): ranks start from different weights, ``parameter_broadcast`` gives both rank 0's,
DATA_PARALLEL trains at parity with eager over the 4 devices, and the per-device checkpoint
writes one file per device, two per process. Writes what it saw to ``<out>.<rank>.json``."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc.parallel as par  # noqa: E402

par.init()  # before the first device use: this process joins with both its devices

import ckpt_model  # noqa: E402

import torchacc  # noqa: E402


def main(out):
    rank = int(os.environ["RANK"])
    par.set_auto_parallel_context(parallel_mode="data_parallel", parameter_broadcast=True)
    torch.manual_seed(rank)  # a different start on each rank
    model = ckpt_model.Wide()
    model = par.parallelize(model.to(torchacc.device()))
    torch.manual_seed(0)
    ref = ckpt_model.Wide()  # rank 0's start
    broadcast_err = max(
        (p.detach().cpu() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    losses = []
    for i in range(3):
        loss = ckpt_model.step(model, opt, i, torchacc.device(), torchacc.sync)
        x, y = ckpt_model.batch(i)  # eager: 4 slices, gradients summed (gradients_mean=False)
        parts = []
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            rl = torch.nn.functional.mse_loss(ref(xs), ys)
            rl.backward()
            parts.append(rl.item())
        ropt.step()
        ropt.zero_grad()
        losses.append((loss, sum(parts) / 4))
    param_err = max(
        (p.detach().cpu() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters())
    )
    ckpt = f"{out}.slices"
    files = par.save_checkpoint(model, ckpt, integrated_save=False)
    torchacc.sync()
    result = {
        "rank": par.get_rank(),
        "size": par.get_group_size(),
        "broadcast_err": broadcast_err,
        "param_err": param_err,
        "losses": losses,
        "files": sorted(os.path.basename(f) for f in files),
    }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
