"""Collective bytes per transformer block of the compiled forward program, for tensor parallel
and context parallel on one mesh (``ta.accelerate`` with ``dist.tp`` / ``dist.sp``), against
the formulas (Megatron: 2 all-reduces of b*s*h per block; Ulysses: 4 all-to-alls of q, k, v
and the output; the causal ring: cp - 1 hops of the K/V block and its positions, and the
zig-zag reorder of q, k, v and the output, one permute each way).

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU PYTHONPATH=. python benchmarks/axes_collectives.py

Each configuration is a fresh forward of a gallery LLaMA-tiny with 4 key/value heads (h 64,
MLP 176, 2 blocks) on a batch of 4 x 32 tokens in fp32; the counts come from the HLO text of
the partitioned program (deterministic: no timing, no repeats). Prints a markdown table.
"""

from __future__ import annotations

import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc as ta  # noqa: E402
from gallery.llama.model import Llama, LlamaConfig  # noqa: E402
from torchacc.program import cache  # noqa: E402

B, T, H, LAYERS, HEADS, KV = 4, 32, 64, 2, 4, 4
COLLECTIVE = re.compile(
    r"= (\(?[^=]*?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
SIZES = {"f32": 4, "s32": 4, "pred": 1, "bf16": 2}


def _model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        block_size=64,
        n_layer=LAYERS,
        n_head=HEADS,
        n_kv_head=KV,
        n_embd=H,
        intermediate=176,
    )
    return Llama(cfg)


def _collectives():
    text = next(reversed(cache._cache.values())).as_text()
    out = []
    for m in COLLECTIVE.finditer(text):  # a result is an array or a tuple of arrays
        op = m.group(2)
        for dtype, dims in ARRAY.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            out.append((op, f"{dtype}[{dims}]", n * SIZES.get(dtype, 4)))
    return out


def _formula(tp, sp, algorithm):
    """Bytes per block per device of the forward's collectives (fp32)."""
    dp = 4 // (tp * sp)
    b, s, d = B // dp, T // sp, H // HEADS
    megatron = 2 * b * s * H * 4 if tp > 1 else 0
    if sp == 1:
        cp = 0
    elif algorithm == "ulysses":  # q, k, v in and the output back, each of this device's heads
        cp = (
            b * s * (HEADS // tp) * d + 2 * b * s * (KV // tp) * d + b * s * (HEADS // tp) * d
        ) * 4
    else:  # each hop passes k, v (this device's kv heads) and the block's int32 positions;
        # causal: the zig-zag reorder moves q, k, v in and the output back once
        cp = (sp - 1) * (2 * b * s * (KV // tp) * d * 4 + s * 4)
        cp += b * s * d * (2 * HEADS // tp + 2 * KV // tp) * 4
    return megatron, cp


def run(tp, sp, algorithm):
    config = ta.Config()
    config.dist.tp.size, config.dist.sp.size = tp, sp
    config.dist.sp.algorithm = algorithm
    model = ta.accelerate(_model(), config=config)
    ids = torch.randint(0, 512, (B, T)).to(model.device)
    cache.clear_memory_cache()
    with torch.no_grad():
        out = model(ids)
    ta.sync()
    del out
    found = _collectives()
    per_block = sum(n for _, _, n in found) / LAYERS
    megatron, cp = _formula(tp, sp, algorithm)
    kinds = {}
    for op, shape, _ in found:
        kinds[(op, shape)] = kinds.get((op, shape), 0) + 1
    listed = ", ".join(
        f"{c // LAYERS if c % LAYERS == 0 else f'{c}/{LAYERS}'} {op} {shape}"
        for (op, shape), c in sorted(kinds.items())
    )
    dp = 4 // (tp * sp)
    print(
        f"| {dp} x {tp} x {sp} | {algorithm if sp > 1 else '-'} | {listed} | {per_block:,.0f} | "
        f"{megatron + cp:,} (Megatron {megatron:,} + cp {cp:,}) |",
        flush=True,
    )


def main():
    print(
        "| dp x tp x sp | cp region | collectives per block (forward HLO, per device) | "
        "bytes per block | formula |"
    )
    print("|---|---|---|---|---|")
    for tp, sp, algorithm in (
        (4, 1, "auto"),
        (2, 2, "ulysses"),
        (2, 2, "ring"),
        (1, 4, "ulysses"),
        (1, 4, "ring"),
        (1, 2, "ring"),
    ):
        run(tp, sp, algorithm)


if __name__ == "__main__":
    main()
