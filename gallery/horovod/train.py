"""The AIACC-Training PyTorch example with ``torchacc.horovod``: MNIST-shaped data, Horovod's API.

    torchaccrun -np 2 python -m gallery.horovod.train                   # eager (gloo / NCCL)
    torchaccrun -np 2 python -m gallery.horovod.train --compiler-opt    # the step compiled by XLA
    mpirun -np 2 python -m gallery.horovod.train --compiler-opt         # the same under mpirun
    python -m gallery.horovod.train                                     # one process

The script is the seed's recipe as written: ``hvd.init()``, the device of ``hvd.local_rank()``, the
learning rate times ``hvd.size()``, ``DistributedOptimizer`` over the model's named parameters,
``broadcast_parameters`` + ``broadcast_optimizer_state`` from rank 0 (after a rank-0-only
``torch.load`` when resuming), a ``DistributedSampler`` with ``num_replicas=hvd.size(),
rank=hvd.rank()``, and checkpoints and TensorBoard logs written by rank 0 only. ``--ddp`` trains
the same model with ``torch.nn.parallel.DistributedDataParallel`` instead (the benchmark's
baseline; eager only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchacc.horovod as hvd


class Net(nn.Module):
    """Horovod's MNIST example network (without dropout: runs are comparable across world sizes)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n, seed=0):
    """``n`` 1x28x28 images whose labels a fixed random teacher assigns (so loss can fall)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=g)
    labels = (images.flatten(1) @ teacher).argmax(1)
    return TensorDataset(images, labels)


class _JsonlWriter:
    """Stand-in for ``SummaryWriter`` when tensorboard is not installed: one JSON line a scalar."""

    def __init__(self, log_dir):
        os.makedirs(log_dir, exist_ok=True)
        self._f = open(os.path.join(log_dir, "scalars.jsonl"), "a")

    def add_scalar(self, tag, value, step):
        self._f.write(json.dumps({"tag": tag, "value": value, "step": step}) + "\n")

    def close(self):
        self._f.close()


def log_writer(log_dir):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return _JsonlWriter(log_dir)
    return SummaryWriter(log_dir)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--samples", type=int, default=2048, help="size of the synthetic dataset")
    p.add_argument("--lr", type=float, default=0.01, help="per rank (times hvd.size())")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compiler-opt", action="store_true", help="train on the torchacc device")
    p.add_argument("--ddp", action="store_true", help="torch DDP instead of hvd (the baseline)")
    p.add_argument("--fp16-allreduce", action="store_true", help="hvd.Compression.fp16")
    p.add_argument("--backward-passes-per-step", type=int, default=1)
    p.add_argument("--checkpoint", default=None, help="rank 0 saves here; resumes when present")
    p.add_argument("--log-dir", default=None, help="rank 0's TensorBoard logs")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--output", default=None, help="rank 0 writes results (JSON) here")
    args = p.parse_args(argv)
    if args.ddp and (args.compiler_opt or args.fp16_allreduce):
        p.error("--ddp is the eager baseline: not with --compiler-opt or --fp16-allreduce")
    return args


def main(argv=None):
    args = parse_args(argv)
    hvd.init()
    if args.compiler_opt:
        import torchacc

        device = torchacc.device()  # this process's device (local rank) in the job
    elif torch.cuda.is_available():
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
    else:
        device = torch.device("cpu")

    dataset = synthetic_mnist(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(args.seed + hvd.rank())  # ranks start different: the broadcast fixes that
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    if hvd.rank() == 0 and args.checkpoint and os.path.exists(args.checkpoint):
        checkpoint = torch.load(args.checkpoint)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if args.ddp:
        if hvd.size() > 1:
            model = nn.parallel.DistributedDataParallel(model)
    else:
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=compression,
            backward_passes_per_step=args.backward_passes_per_step,
        )
    start_params = [p.detach().cpu().clone() for p in model.parameters()]
    writer = log_writer(args.log_dir) if hvd.rank() == 0 and args.log_dir else None

    step, times = 0, []
    model.train()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for data, target in loader:
            start = time.perf_counter()
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if args.compiler_opt:
                import torchacc

                torchacc.sync()  # the step (collectives included) as one program
            step += 1
            if step % args.log_interval == 0 or step == args.max_steps:
                if writer is not None:  # rank 0 reads its loss (a sync on the compiler path)
                    writer.add_scalar("train/loss", float(loss.detach().cpu()), step)
            times.append(time.perf_counter() - start)
            if args.max_steps and step >= args.max_steps:
                break
        if hvd.rank() == 0 and args.checkpoint:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, args.checkpoint)
        if args.max_steps and step >= args.max_steps:
            break
    # the loss averaged over ranks, as Horovod's example's metric_average
    final = hvd.allreduce(torch.tensor(float(loss.detach().cpu())), name="avg_loss").item()
    if writer is not None:
        writer.close()
    if hvd.rank() == 0:
        result = {
            "size": hvd.size(),
            "steps": step,
            "loss": final,
            "median_step_s": statistics.median(times[len(times) // 2 :]) if times else None,
            "params": [p.detach().cpu().flatten().tolist() for p in model.parameters()],
            "update_size": max(
                float((p.detach().cpu() - p0).abs().max())
                for p, p0 in zip(model.parameters(), start_params, strict=True)
            ),
        }
        print(f"[hvd] {hvd.size()} rank(s), {step} steps, loss {final:.4f}", flush=True)
        if args.output:
            with open(args.output, "w") as f:
                json.dump(result, f)
    hvd.shutdown()


if __name__ == "__main__":
    main()
