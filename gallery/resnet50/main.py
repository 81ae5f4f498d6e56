"""ResNet-50 training, eager DDP + AMP baseline or torchacc (``--compiler-opt``).

Normally started by the launcher::

    python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --batch_size=128
    python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --compiler-opt --batch_size=128

and also runnable alone (one process) or under ``torchrun``/``mpirun`` with the same flags::

    python -m gallery.resnet50.main --batch_size 32 --max_steps 20

The training loop, with the recipe's ``enable_torchacc_compiler()`` branches (xla process group,
``xm.set_replication``, ``syncfree.AdamW`` under AMP, ``xm._fetch_gradients`` +
``xm.all_reduce``, ``xm.mark_step``; DDP otherwise), is :func:`gallery.common.trainer.train`,
shared with the GPT gallery model.
"""

from __future__ import annotations

if __name__ == "__main__":  # first, before torch loads (Note [Worker lifetime], launch_checks.py)
    from gallery.common.launchlib import torchacc_launch

    torchacc_launch().checks.guard_worker()

import argparse  # noqa: E402
import sys  # noqa: E402

import torch.nn.functional as F

from gallery.common.trainer import Task, run
from gallery.resnet50.data import IMAGENET_TRAIN_SIZE, ImageFolder, MockImageNet, normalize
from gallery.resnet50.model import CONFIGS, build

_TITLES = {
    "resnet50": "ResNet-50",
    "resnet-tiny": "resnet-tiny (ResNet-50's blocks, 2-1-1-1, width 16)",
}


def make_task(args: argparse.Namespace) -> Task:
    if args.model not in CONFIGS:
        raise SystemExit(f"--model {args.model!r}: this worker trains {', '.join(CONFIGS)}")
    if args.data == "mock":
        dataset = MockImageNet(
            image_size=args.image_size,
            num_samples=args.mock_samples or IMAGENET_TRAIN_SIZE,
            num_classes=1000,
            seed=args.seed,
        )
        num_classes = 1000
    else:
        dataset = ImageFolder(args.data, image_size=args.image_size, seed=args.seed)
        num_classes = dataset.num_classes

    return Task(
        name=args.model,
        build_model=lambda a: build(args.model, num_classes=num_classes),
        build_dataset=lambda a: dataset,
        loss_fn=F.cross_entropy,
        default_lr=1e-3,
        default_weight_decay=1e-4,
        preprocess=normalize,
        channels_last=True,
        describe=lambda m: (
            f"{_TITLES.get(args.model, args.model)} ({num_classes} classes), "
            f"{args.image_size}x{args.image_size} input, "
            f"data: {'mock ImageNet (in memory)' if args.data == 'mock' else args.data}"
            f" ({len(dataset):,} samples)"
        ),
    )


def main(argv: list[str] | None = None) -> dict:
    return run(make_task, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
