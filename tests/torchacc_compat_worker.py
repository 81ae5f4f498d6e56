"""A training script in the shape of AlibabaPAI/torchacc's tests/standalone/mnist_dp.py, run
unchanged in its ta.* calls under torchrun by tests/test_torchacc_compat.py: the "lazy" backend,
ta.lazy_device, ta.AsyncLoader, torch.cuda.amp.autocast, ta.fetch_gradients + all_reduce,
ta.amp.GradScaler, ta.dist ranks, f"{loss:E}". Each rank writes $COMPAT_OUT/rank<r>.json."""

import json
import os

import torch
import torch.distributed as dist

import torchacc as ta


def main():
    dist.init_process_group(backend="lazy")
    assert (dist.get_rank(), dist.get_world_size()) == (ta.dist.rank(), ta.dist.world_size())
    device = ta.lazy_device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ta.amp.GradScaler(init_scale=2.0**8)
    g = torch.Generator().manual_seed(100 + ta.dist.rank())  # each rank its own batches
    data = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))] * 2
    lines = []
    for x, y in ta.AsyncLoader(data, device):
        optimizer.zero_grad()
        with torch.cuda.amp.autocast(dtype=torch.bfloat16):
            hidden = model[0](x)
            low = hidden.dtype
            loss = torch.nn.functional.cross_entropy(model[2](model[1](hidden)), y)
        scaler.scale(loss).backward()
        for grad in ta.fetch_gradients(optimizer):
            dist.all_reduce(grad)
            grad.mul_(1.0 / dist.get_world_size())
        scaler.step(optimizer)
        scaler.update()
        ta.sync()
        lines.append(f"loss: {loss:E}")
    out = os.path.join(os.environ["COMPAT_OUT"], f"rank{ta.dist.rank()}.json")
    with open(out, "w") as f:
        f.write(
            json.dumps(
                {
                    "rank": ta.dist.rank(),
                    "local_rank": ta.dist.local_rank(),
                    "world": ta.dist.world_size(),
                    "backend": str(dist.get_backend()),
                    "low": str(low),
                    "lines": lines,
                    "weight": model[0].weight.detach().cpu().flatten()[:4].tolist(),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
