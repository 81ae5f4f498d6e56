"""LLaMA-style language model training on mock tokens, eager baseline or torchacc.

    python launch_single_task.py --model llama-1b --amp_level=O1 --batch_size=4 --seq_len 2048
    python launch_single_task.py --model llama-1b --amp_level=O1 --batch_size=4 --seq_len 2048 \\
        --compiler-opt --kernel-opt

``--model`` picks the configuration (``llama-1b``: TinyLlama-1.1B's shape, ``llama-tiny``);
``--kernel-opt`` builds the model on ``torchacc_ops`` (fused attention, RMSNorm, rotary, SwiGLU)
and takes the loss with ``torchacc_ops.cross_entropy``. ``--packing`` trains on padding-free
packed rows (:class:`gallery.gpt.data.PackedMockTokens`: sequences of 4..``seq_len / 2`` tokens
laid end to end, the model given their position ids). The loop is
:func:`gallery.common.trainer.train`, shared with GPT-2 and ResNet-50.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before torch loads (Note [Worker lifetime], launch_checks.py)
    from gallery.common.launchlib import torchacc_launch

    torchacc_launch().checks.guard_worker()

import argparse  # noqa: E402
import sys  # noqa: E402

from gallery.common.logger import enable_torchacc_kernel  # noqa: E402
from gallery.common.trainer import Task, run  # noqa: E402
from gallery.gpt.data import MockTokens, PackedMockTokens  # noqa: E402
from gallery.gpt.main import lm_loss_fn  # noqa: E402
from gallery.llama.model import CONFIGS, build_llama  # noqa: E402


def make_task(args: argparse.Namespace) -> Task:
    cfg = CONFIGS[args.model]
    seq_len = args.seq_len or cfg.block_size
    if seq_len > cfg.block_size:
        raise SystemExit(
            f"error: --seq_len {seq_len} is longer than {args.model}'s block size {cfg.block_size}"
        )
    kernels = enable_torchacc_kernel()
    samples = args.mock_samples or (1 << 20)
    packing = bool(getattr(args, "packing", False))
    if packing:
        dataset = PackedMockTokens(
            cfg.vocab_size,
            seq_len,
            min_len=min(4, seq_len),
            max_len=max(seq_len // 2, 1),
            num_samples=samples,
            seed=args.seed,
        )
    else:
        dataset = MockTokens(cfg.vocab_size, seq_len, num_samples=samples, seed=args.seed)
    return Task(
        name=args.model,
        build_model=lambda a: build_llama(
            args.model, kernels=kernels, scan_layers=_scan_layers(args)
        ),
        build_dataset=lambda a: dataset,
        loss_fn=lm_loss_fn(kernels),
        default_lr=3e-4,
        default_weight_decay=0.1,
        tokens_per_sample=seq_len,
        describe=lambda m: (
            f"{args.model}: {cfg.n_layer} layers, {cfg.n_head} heads ({cfg.n_kv_head} kv), "
            f"d={cfg.n_embd}, ffn {cfg.intermediate}, vocab {cfg.vocab_size}, seq_len {seq_len}, "
            f"kernels {'torchacc_ops' if kernels else 'plain PyTorch'}, mock tokens "
            f"({len(dataset):,} {'packed rows' if packing else 'samples'})"
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
