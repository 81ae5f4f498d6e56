"""Compile cost of an optimizer step against the number of same-shaped parameters.

``n`` parameters of shape (256, 768) with gradients on the torchacc device; two AdamW steps
(fused or foreach), each ``sync``ed and waited for; prints the process CPU seconds of the second
step (its program is new: the state exists now) and XLA's total compile wall time. Run it with
``TORCHACC_BATCHED_UPDATES=1`` and ``0`` to compare the batched update (Note [Batched optimizer
updates] in torchacc/lowering/batching.py) with member by member, and
``TORCHACC_CACHE_DIR=off`` so nothing comes from the persistent cache.

Usage: TORCHACC_CACHE_DIR=off python benchmarks/optim_compile.py 48 fused
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import torchacc  # noqa: E402
from torchacc import metrics  # noqa: E402


def main():
    n, kind = int(sys.argv[1]), sys.argv[2]
    dev = torch.device("torchacc")
    params = [torch.nn.Parameter(torch.randn(256, 768).to(dev)) for _ in range(n)]
    for p in params:
        p.grad = torch.randn(256, 768).to(dev)
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if kind == "fused" else {}))
    torchacc.sync()
    for _ in range(2):
        opt.step()
        start = time.process_time()
        torchacc.sync()
        params[0].cpu()
    compile_s = metrics.metric_data("CompileTime")[1]
    print(
        f"n={n} {kind}: second step {time.process_time() - start:.2f} CPU s, "
        f"compiles {compile_s:.1f} s wall in all"
    )


if __name__ == "__main__":
    main()
