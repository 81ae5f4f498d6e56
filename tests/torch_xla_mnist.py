"""A torch_xla MNIST-style training script written against the *upstream* torch_xla API.

Nothing here mentions torchacc: run it with ``python -m torchacc.run_torch_xla
tests/torch_xla_mnist.py``. Fake data comes from ``xu.SampleGenerator`` as in torch_xla's
test_train_mp_mnist.py. ``--amp`` trains with fp16 autocast + GradScaler + a syncfree optimizer and
the explicit gradient all-reduce of TorchAcc recipes; otherwise ``xm.optimizer_step``.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.debug.metrics as met
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
import torch_xla.utils.utils as xu
from torch_xla.amp import GradScaler, autocast, syncfree


class MNIST(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, kernel_size=5, stride=2)
        self.conv2 = nn.Conv2d(4, 8, kernel_size=5, stride=2)
        self.fc1 = nn.Linear(8 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


def train_mnist(flags):
    torch.manual_seed(1)
    g = torch.Generator().manual_seed(0)
    train_loader = xu.SampleGenerator(
        data=(
            torch.randn(flags.batch_size, 1, 28, 28, generator=g),
            torch.randint(0, 10, (flags.batch_size,), generator=g),
        ),
        sample_count=flags.steps,
    )
    device = torch_xla.device()
    assert device == xm.xla_device()
    model = MNIST().to(device)
    if flags.amp:
        optimizer = syncfree.SGD(model.parameters(), lr=flags.lr, momentum=0.5)
        scaler = GradScaler()
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=flags.lr, momentum=0.5)
    loss_fn = nn.NLLLoss()
    losses = []

    def log_step(step, loss):
        losses.append(loss.item())
        xm.master_print(f"[xla:{xr.global_ordinal()}] step {step} loss {losses[-1]:.4f}")

    model.train()
    for step, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        if flags.amp:
            with autocast(device, dtype=torch.float16):
                output = model(data)
                loss = loss_fn(output, target)
            scaler.scale(loss).backward()
            gradients = xm._fetch_gradients(optimizer)
            xm.all_reduce(xm.REDUCE_SUM, gradients, scale=1.0 / xr.world_size())
            scaler.step(optimizer)
            scaler.update()
        else:
            output = model(data)
            loss = loss_fn(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
        xm.add_step_closure(log_step, args=(step, loss))
        torch_xla.sync()
    xm.wait_device_ops()
    return losses


def _mp_fn(index, flags):
    results = {}
    for amp in [False, True] if flags.both else [flags.amp]:
        flags.amp = amp
        results["amp" if amp else "fp32"] = train_mnist(flags)
    results["counters"] = {name: met.counter_value(name) for name in met.counter_names()}
    results["device_hw"] = xm.xla_device_hw(xm.xla_device())
    if flags.out:
        with open(flags.out, "w") as f:
            json.dump(results, f)
    print(met.short_metrics_report())


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--both", action="store_true", help="fp32 run, then the --amp run")
    parser.add_argument("--out", default="")
    FLAGS = parser.parse_args()
    xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=None)
