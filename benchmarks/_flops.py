"""Model FLOPs of one training step of a gallery model, by its arithmetic (not what a compiler
emitted): the numerator of MFU for every side alike (eager, torch.compile, torchacc).

- GPT / LLaMA: 6·N + 12·L·d·T per token (PaLM's appendix B, as torchtitan and MaxText count it),
  N the parameters that take part in matmuls (the position and input-embedding lookups left out;
  GPT-2's tied ``wte`` is the LM head, so it counts), L layers, d the width, T the sequence length.
- ResNet: forward + backward of one image as counted by ``torch.utils.flop_counter`` on the meta
  device (convolutions and matmuls; ~24.3 GFLOPs for ResNet-50 at 224²), times the batch.

Used by benchmarks/gpu_check.py and benchmarks/run.py; the compiled step's own count is XLA's
cost analysis (Note [Step FLOPs] in torchacc/metrics.py).
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_flops_per_step(
    model: str, batch: int, seq_len: int | None = None, image_size: int | None = None
) -> tuple[float | None, str]:
    """(FLOPs of one training step on ``batch`` samples, how they were counted); (None, why)
    when the model is not a gallery GPT, LLaMA or ResNet."""
    try:
        import torch

        if ROOT not in sys.path:
            sys.path.insert(0, ROOT)
        if model.startswith("resnet"):
            from torch.utils.flop_counter import FlopCounterMode

            from gallery.resnet50.model import build

            size = image_size or 224
            with torch.device("meta"):
                net = build(model)
                x = torch.randn(2, 3, size, size)  # BatchNorm in training needs 2 samples
            with FlopCounterMode(display=False) as fc:
                net(x).sum().backward()
            return fc.get_total_flops() / 2 * batch, "FlopCounterMode fwd+bwd"
        if model.startswith("llama"):
            from gallery.llama.model import CONFIGS
            from gallery.llama.model import build_llama as build

            skip = ("embed.weight",)
        else:
            from gallery.gpt.model import CONFIGS
            from gallery.gpt.model import build_gpt as build

            skip = ("wpe.weight",)  # wte is the tied lm_head: a matmul
        if model not in CONFIGS:
            return None, f"n/a (no model FLOPs for {model!r})"
        cfg = CONFIGS[model]
        seq = seq_len or cfg.block_size
        with torch.device("meta"):
            net = build(model)
        n = sum(p.numel() for name, p in net.named_parameters() if name not in skip)
        per_token = 6 * n + 12 * cfg.n_layer * cfg.n_embd * seq
        return float(per_token * batch * seq), "6N+12LdT"
    except Exception as e:  # noqa: BLE001 - a missing number, not a failed benchmark
        return None, f"n/a ({type(e).__name__}: {e})"


def from_launcher_flags(flags: list[str]) -> tuple[float | None, str]:
    """``model_flops_per_step`` for a launcher command line (``--model``, ``--batch_size``,
    ``--seq_len``, ``--image_size``; the launcher's defaults where absent)."""

    def get(name, default=None):
        return flags[flags.index(name) + 1] if name in flags[:-1] else default

    seq, size = get("--seq_len"), get("--image_size")
    return model_flops_per_step(
        get("--model", "resnet50"),
        int(get("--batch_size", 128)),
        seq_len=int(seq) if seq else None,
        image_size=int(size) if size else None,
    )
