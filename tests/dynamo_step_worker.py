"""One rank of a torchrun job training the same model two ways side by side: eager PyTorch DDP
(gloo) and ``torchacc.compile_step`` with the gradient all-reduce inside the compiled step.

``python -m torch.distributed.run --nproc_per_node=2 tests/dynamo_step_worker.py OUT``
trains once per way of writing the reduction (APIS): ``xm.optimizer_step``,
``xm.reduce_gradients`` + ``opt.step()``, and ``xm.all_reduce`` on ``xm._fetch_gradients`` (the
TorchAcc recipe). Writes ``OUT/rank<r>.json``: per API both runs' losses, the final parameters,
the largest parameter difference and the compile counters; tests/test_dynamo_step_distributed.py
asserts on them.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

STEPS = 5
APIS = ("optimizer_step", "reduce_gradients", "all_reduce")


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def make_step(model, opt, api, xm):
    def step(x, y):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if api == "optimizer_step":
            xm.optimizer_step(opt)
        elif api == "reduce_gradients":
            xm.reduce_gradients(opt)
            opt.step()
        elif api == "all_reduce":
            grads = xm._fetch_gradients(opt)
            xm.all_reduce("sum", grads, scale=1.0 / xm.xrt_world_size())
            opt.step()
        else:  # eager DDP: reduced during backward
            opt.step()
        return loss.detach()

    return step


def train(api, rank, xm, metrics):
    """Both runs of one API for STEPS steps; what the test checks."""
    import torchacc.dynamo

    metrics.clear_all()
    torch.manual_seed(0)  # same initial weights on every rank
    model = models.MLP()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for m in (model, ref)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)) for o in opts]
    compiled = torchacc.dynamo.compile_step(make_step(model, opts[0], api, xm))
    eager = make_step(ref, opts[1], "ddp", None)
    losses = {"compiled": [], "eager": []}
    for s in range(STEPS):
        x, y = batch(rank, s)
        losses["compiled"].append(compiled(x, y).item())
        losses["eager"].append(eager(x, y).item())
        for sched in scheds:
            sched.step()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(model.parameters(), ref.module.parameters())
    )
    (prog,) = compiled._programs.values()
    return {
        "losses": losses,
        "max_param_diff": diff,
        "params": [p.tolist() for p in model.parameters()],
        "flat": prog.flat is not None,
        "collective": prog.lowered.pieces[0].collective,
        "counters": {
            n: metrics.counter_value(n) or 0
            for n in ("StepTrace", "StepRecompile", "StepExecute", "DynamoCompile")
        },
    }


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import torchacc.torch_xla.core.xla_model as xm
    from torchacc import metrics

    assert xm.xrt_world_size() == world and xm.get_ordinal() == rank
    payload = {api: train(api, rank, xm, metrics) for api in APIS}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(payload, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
