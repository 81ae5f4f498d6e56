"""``python -m torchacc.plan``: size a training job on a mesh of virtual devices (see
``torchacc/plan/__init__.py`` and docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import sys

from torchacc import hardware
from torchacc.plan import AXES, PlanError, format_table, known_models, plan, search


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m torchacc.plan",
        description="Compile one training step (forward, backward, optimizer) for a mesh of "
        "virtual devices from abstract shapes only, and report per-device memory, collective "
        "bytes per mesh axis, FLOPs and an estimated step time / MFU.",
    )
    p.add_argument(
        "--model", required=True,
        help=f"a gallery model or shape-only config ({', '.join(known_models())}) or "
        "module:factory (a function returning an nn.Module: token ids (B, T) -> logits)",
    )  # fmt: skip
    p.add_argument(
        "--batch_size", type=int, required=True,
        help="the GLOBAL batch of one optimizer step (all devices together), the same meaning "
        "as the launcher's --batch_size with one process",
    )  # fmt: skip
    p.add_argument("--seq_len", type=int, default=None, help="tokens per sample (default: context)")
    p.add_argument(
        "--mesh", default=None,
        help=f"layout as axis=size over {', '.join(AXES)} (e.g. dp=2,fsdp=4,tp=8); "
        "default fsdp over --devices",
    )  # fmt: skip
    p.add_argument("--devices", type=int, default=None, help="device count (default: mesh's)")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--gc", action="store_true", help="gradient checkpointing of every block")
    p.add_argument("--scan-layers", "--scan_layers", dest="scan_layers", action="store_true")
    p.add_argument(
        "--device", default="h100-sxm",
        help=f"accelerator for the roofline: {', '.join(sorted(hardware.ACCELERATORS))}",
    )  # fmt: skip
    p.add_argument("--gpus_per_node", type=int, default=8)
    p.add_argument("--memory", default=None, help="per-device memory budget, e.g. 80GiB")
    p.add_argument("--search", action="store_true", help="rank layouts that fit --memory")
    p.add_argument("--top", type=int, default=4, help="--search: layouts compiled (default 4)")
    p.add_argument("--microbatches", type=int, default=None, help="pp micro-batches (2 x pp)")
    p.add_argument(
        "--full-depth", "--full_depth", dest="full_depth", action="store_true",
        help="compile every layer (default: models deeper than 4 layers are compiled at 1 and 2 "
        "layers and extrapolated)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="also write the plan(s) as JSON to this file")
    return p


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        if args.search:
            if args.devices is None:
                raise PlanError("--search needs --devices N")
            plans = search(
                args.model, args.devices, args.batch_size, args.seq_len,
                memory=args.memory or "80GiB", precision=args.precision,
                optimizer=args.optimizer, gc=args.gc, scan_layers=args.scan_layers,
                device=args.device, gpus_per_node=args.gpus_per_node, top=args.top,
            )  # fmt: skip
        else:
            plans = [
                plan(
                    args.model, args.batch_size, args.seq_len, args.mesh, args.precision,
                    args.optimizer, args.gc, args.scan_layers, args.device,
                    devices=args.devices, gpus_per_node=args.gpus_per_node, memory=args.memory,
                    microbatches=args.microbatches, full_depth=args.full_depth,
                )
            ]  # fmt: skip
    except PlanError as e:
        print(f"torchacc.plan: error: {e}", file=sys.stderr)
        return 2
    print(format_table(plans))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([p.to_dict() for p in plans], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
