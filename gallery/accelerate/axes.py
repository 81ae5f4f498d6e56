"""The parallel axes side by side on one mesh: data parallel, FSDP, Megatron tensor parallel and
context parallel through ``ta.accelerate`` (``Config.dist``), each against the same eager model.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m gallery.accelerate.axes

A GPT-2-shaped tiny model (the gallery's ``gpt-tiny`` with 4 heads) takes one SGD step per
configuration on the same batch; the table has each configuration's mesh, its parameter bytes
per device, the loss and the largest parameter difference to the eager step after it, and the
collectives of its compiled step. Each configuration needs the process's device count to be
the product of its sizes (4 here). Pipeline parallel (``dist.pp``) is not in the table yet.
"""

from __future__ import annotations

import argparse
import re

import torch

CONFIGS = (  # (name, {dist section: size})
    ("dp 2 x fsdp 2", {"dp": 2, "fsdp": 2}),
    ("fsdp 4", {"fsdp": 4}),
    ("tp 4", {"tp": 4}),
    ("cp 4 (sp)", {"sp": 4}),
    ("fsdp 2 x cp 2", {"fsdp": 2, "sp": 2}),
    ("tp 2 x cp 2", {"tp": 2, "sp": 2}),
)
OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def _step(model, ids, device=None, train=True):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if device is not None:
        ids = ids.to(device)
    with torch.set_grad_enabled(train):
        logits = model(ids[:, :-1])
        vocab = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
    if train:
        loss.backward()
        opt.step()
    return loss


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16, help="tokens per row")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument(
        "--forward-only", action="store_true", help="the loss only, no step (compiles faster)"
    )
    p.add_argument("--only", default=None, help="comma-separated names of the table's rows")
    args = p.parse_args(argv)
    train = not args.forward_only
    wanted = None if args.only is None else set(args.only.split(","))

    import torchacc as ta
    from gallery.gpt.model import build_gpt
    from torchacc.program import cache
    from torchacc.sharding import api as engine

    torch.manual_seed(0)
    ref = build_gpt("gpt-tiny", n_head=4, n_layer=1)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ids = torch.randint(0, 512, (args.batch, args.seq + 1), generator=torch.Generator())
    ref_loss = _step(ref, ids, train=train).item()
    rows = []
    for name, sizes in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        model = build_gpt("gpt-tiny", n_head=4, n_layer=1)
        model.load_state_dict(init)
        config = ta.Config()
        for section, size in sizes.items():
            getattr(config.dist, section).size = size
        model = ta.accelerate(model, config=config)
        cache.clear_memory_cache()
        loss = _step(model, ids, model.device, train)
        ta.sync()
        text = next(reversed(cache._cache.values())).as_text()
        ops = {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in OPS}
        per_device = engine.per_device_bytes(list(model.parameters()))
        err = abs(loss.item() - ref_loss)  # forward: the loss; a step: the parameters after it
        if train:
            err = max(
                (a.detach().cpu() - b.detach()).abs().max().item()
                for a, b in zip(model.parameters(), ref.parameters())
            )
        rows.append(
            (
                name,
                max(per_device.values()) if per_device else 0,
                loss.item(),
                err,
                ", ".join(f"{n} {op}" for op, n in ops.items() if n) or "none",
            )
        )
    whole = sum(p.numel() * p.element_size() for p in ref.parameters())
    print(f"eager: loss {ref_loss:.6f}, parameters {whole:,} bytes")
    what = "step" if train else "forward"
    diff = "max param diff vs eager" if train else "loss diff vs eager"
    print(f"| axes | param bytes / device | loss | {diff} | {what} collectives |")
    print("|---|---|---|---|---|")
    for name, nbytes, loss, err, ops in rows:
        print(f"| {name} | {nbytes:,} | {loss:.6f} | {err:.1e} | {ops} |")
    return rows


if __name__ == "__main__":
    main()
