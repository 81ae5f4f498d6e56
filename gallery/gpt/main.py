"""GPT-2-style language model training on mock tokens, eager baseline or torchacc.

    python launch_single_task.py --model gpt2 --amp_level=O1 --batch_size=8 --seq_len 1024
    python launch_single_task.py --model gpt2 --amp_level=O1 --batch_size=8 --compiler-opt

``--model`` picks the configuration (gpt2 = 124M, gpt2-medium, gpt2-large, gpt-mini, gpt-tiny);
``--kernel-opt`` takes attention and the loss from ``torchacc_ops``; the loop is
:func:`gallery.common.trainer.train`, shared with ResNet-50.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before torch loads (Note [Worker lifetime], launch_checks.py)
    from gallery.common.launchlib import torchacc_launch

    torchacc_launch().checks.guard_worker()

import argparse  # noqa: E402
import sys  # noqa: E402

import torch
import torch.nn.functional as F

import torchacc_ops
from gallery.common.logger import enable_torchacc_kernel
from gallery.common.trainer import Task, run
from gallery.gpt.data import MockTokens
from gallery.gpt.model import CONFIGS, build_gpt


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lm_loss_kernel(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``torchacc_ops.cross_entropy``: on the torchacc device the logits stay in their dtype (no
    float32 copy under autocast) and the loss is one op each way."""
    return torchacc_ops.cross_entropy(logits, targets)


def lm_loss_fn(kernels: bool):
    return lm_loss_kernel if kernels else lm_loss


def make_task(args: argparse.Namespace) -> Task:
    cfg = CONFIGS[args.model]
    seq_len = args.seq_len or cfg.block_size
    if seq_len > cfg.block_size:
        raise SystemExit(
            f"error: --seq_len {seq_len} is longer than {args.model}'s block size {cfg.block_size}"
        )
    kernels = enable_torchacc_kernel()
    dataset = MockTokens(
        cfg.vocab_size, seq_len, num_samples=args.mock_samples or (1 << 20), seed=args.seed
    )
    return Task(
        name=args.model,
        build_model=lambda a: build_gpt(
            args.model, kernels=kernels, scan_layers=_scan_layers(args)
        ),
        build_dataset=lambda a: dataset,
        loss_fn=lm_loss_fn(kernels),
        default_lr=6e-4,
        default_weight_decay=0.1,
        tokens_per_sample=seq_len,
        describe=lambda m: (
            f"{args.model}: {cfg.n_layer} layers, {cfg.n_head} heads, d={cfg.n_embd}, "
            f"vocab {cfg.vocab_size}, seq_len {seq_len}, "
            f"kernels {'torchacc_ops' if kernels else 'plain PyTorch'}, "
            f"mock tokens ({len(dataset):,} samples)"
        ),
    )


def _scan_layers(args: argparse.Namespace) -> bool:
    """``--scan-layers`` with ``--compiler-opt``; without it the blocks stay a plain loop (and the
    eager path never imports torchacc)."""
    return bool(getattr(args, "scan_layers", False) and args.compiler_opt)


def main(argv: list[str] | None = None) -> dict:
    return run(make_task, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
