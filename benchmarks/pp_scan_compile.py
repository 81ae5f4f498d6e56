"""Cold compile of a pipelined step vs depth: the stages as ``lax.switch`` branches of unrolled
blocks (the default) against uniform stages (``pipeline_parallel(..., scan_layers=True)``: each
stage's blocks one ``lax.scan``; Note [Uniform pipeline stages] in torchacc/pipeline/uniform.py).

    PYTHONPATH=. python benchmarks/pp_scan_compile.py [--layers 2,4,8] [--repeat 3]

Each (depth, mode) runs in a fresh process (TORCHACC_CACHE_DIR=off: no persistent compilation
cache) on 2 CPU devices (pp=2, 1F1B, 2 micro-batches, a GPT-2-shaped model of gallery/gpt
Blocks: n_embd 64, 4 heads); it prints the medians of the first forward_backward's wall time
and process CPU time (trace + lower + compile + run) over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def one(layers, scan):
    import torch

    import torchacc as ta
    from gallery.gpt.model import Block, GPTConfig
    from torchacc.pipeline import pipeline_parallel
    from torchacc.sharding import api

    V, T, B = 128, 16, 4
    cfg = GPTConfig(vocab_size=V, block_size=T, n_layer=layers, n_head=4, n_embd=64)

    class GPT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(V, cfg.n_embd)
            self.wpe = torch.nn.Embedding(T, cfg.n_embd)
            self.h = torch.nn.ModuleList(Block(cfg) for _ in range(layers))
            self.ln_f = torch.nn.LayerNorm(cfg.n_embd)
            self.lm_head = torch.nn.Linear(cfg.n_embd, V, bias=False)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.h:
                x = b(x)
            return self.lm_head(self.ln_f(x))

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))

    torch.manual_seed(0)
    api.use_spmd()
    mesh = api.jax_mesh(range(2), [2], ["pp"])
    pm = pipeline_parallel(GPT(), mesh, [f"h.{layers // 2}"], 2, "1F1B", scan_layers=scan)
    pm.to(ta.device())
    x = torch.randint(0, V, (B, T)).to(ta.device())
    t0, c0 = time.perf_counter(), time.process_time()
    loss = pm.forward_backward(x, labels=x, output_fn=loss_fn)
    ta.sync()
    float(loss)
    return [time.perf_counter() - t0, time.process_time() - c0]  # wall, CPU (all threads)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="2,4,8", help="total blocks (pp=2: half per stage)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--modes", default="switch,scan", help="switch (unrolled) and/or scan")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        layers, scan = a.one.split(":")
        print(json.dumps(one(int(layers), scan == "1")))
        return
    # cold: no persistent compilation cache (each process compiles from scratch)
    env = dict(os.environ, CPU_NUM_DEVICES="2", JAX_PLATFORMS="cpu", TORCHACC_CACHE_DIR="off")
    for layers in [int(v) for v in a.layers.split(",")]:
        for scan in [{"switch": 0, "scan": 1}[m] for m in a.modes.split(",")]:
            cold, cpu = [], []
            for _ in range(a.repeat):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", f"{layers}:{scan}"],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                wall, secs = json.loads(out.stdout.strip().splitlines()[-1])
                cold.append(wall)
                cpu.append(secs)
            mode = "scan_layers (uniform)" if scan else "switch, unrolled"
            print(
                f"layers={layers:3d} per stage={layers // 2:3d} {mode:22s} cold step median "
                f"{statistics.median(cold):.2f} s wall, {statistics.median(cpu):.2f} CPU-s "
                f"(wall {[round(c, 1) for c in cold]}, CPU {[round(c, 1) for c in cpu]})",
                flush=True,
            )


if __name__ == "__main__":
    main()
