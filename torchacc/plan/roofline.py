"""The planner's numbers for one layout: depth extrapolation, collective totals per mesh axis,
the roofline step time and MFU (Note [What the plan measures and what it estimates] in
torchacc/plan/__init__.py), and the human-readable table."""

from __future__ import annotations

import math

GiB = 2**30
AXES = ("dp", "fsdp", "tp", "pp", "cp")


def _extrapolate(raws, depths, target):
    """One measurement dict at depth ``target`` from measurements at ``depths`` (linear)."""
    if len(raws) == 1:
        return raws[0]
    a, b = raws
    k = target - depths[0]
    span = depths[1] - depths[0]
    out = {}
    for key, va in a.items():
        vb = b[key]
        if isinstance(va, (int, float)) and not isinstance(va, bool) and key != "job":
            v = va + (vb - va) * k / span
            out[key] = int(round(v)) if isinstance(va, int) else v
        else:
            out[key] = vb
    ca, cb = _coll_totals(a["collectives"]), _coll_totals(b["collectives"])
    coll = {}
    for key in set(ca) | set(cb):
        xa, xb = ca.get(key, (0, 0)), cb.get(key, (0, 0))
        coll[key] = tuple(x + (y - x) * k / span for x, y in zip(xa, xb))
    out["collectives"] = [(op, nb, list(axes), n, cnt) for (op, axes, n), (nb, cnt) in coll.items()]
    out["compile_s"] = a["compile_s"] + b["compile_s"]
    out["trace_s"] = a["trace_s"] + b["trace_s"]
    return out


def _coll_totals(colls):
    tot = {}
    for c in colls:
        op, nb, axes, n = c[:4]
        cnt = c[4] if len(c) > 4 else 1
        key = (op, tuple(axes), n)
        b0, c0 = tot.get(key, (0, 0))
        tot[key] = (b0 + nb, c0 + cnt)
    return tot


_RING = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def _axis_bandwidth(axes, mesh, acc, gpus_per_node):
    """Bandwidth of a collective over ``axes``: the link when the group lies in one node."""
    # row-major device numbering, tp innermost; pp after the data axes (TorchAcc's topology,
    # the mesh ta.dist.PipelineParallel builds)
    order = ("dp", "fsdp", "pp", "cp", "tp")
    span = 1
    for a in axes:
        inner = math.prod(mesh[b] for b in order[order.index(a) + 1 :])
        span = max(span, inner * mesh[a])
    return acc.link_bw if span <= gpus_per_node else acc.network_bw


def assemble(spec, req, mesh, micro, raws, depths, acc, gpus_per_node, limit, n_devices, device):
    # the compiled program is one optimizer step: with pp, ta.dist.PipelineParallel's whole
    # pipelined step (every micro-batch, the schedule's bubble ticks and its sends included:
    # Note [What the planner compiles under pp] and Note [FLOPs of the pipelined step] in
    # pipeline.py; its depths count the whole model's layers), else the one-program step
    r = _extrapolate(raws, depths, spec.n_layer) if len(raws) > 1 else raws[0]
    coll_bytes, coll_time = {}, {}
    for (op, axes, n), (nb, _cnt) in _coll_totals(r["collectives"]).items():
        key = "+".join(axes)
        coll_bytes[key] = coll_bytes.get(key, 0) + nb
        bw = _axis_bandwidth(axes, mesh, acc, gpus_per_node)
        coll_time[key] = coll_time.get(key, 0.0) + nb * _RING[op](n) / bw
    flops = r["flops"]
    bytes_accessed = r["bytes_accessed"]
    act = r["activations"]
    temp = r["temp"]
    total = r["argument"] + r["output"] - r["alias"] + r["temp"]
    peak = acc.peak("bfloat16" if req["precision"] == "bf16" else "float32")
    t_compute = flops / peak
    t_mem = bytes_accessed / acc.hbm_bw
    step = max(t_compute, t_mem) + sum(coll_time.values())
    tokens = req["batch_size"] * (req["seq_len"] if spec.kind == "lm" else 1)
    n_params = raws[0]["full_params"]  # the whole model (a pp stage holds L/pp layers)
    if spec.kind == "lm" and spec.n_layer and spec.d_model:
        n_flop_params = n_params - raws[0]["full_embed_params"]
        model_flops = 6 * n_flop_params + 12 * spec.n_layer * spec.d_model * req["seq_len"]
        model_flops *= tokens
    else:
        model_flops = flops * n_devices
    mfu = model_flops / (n_devices * peak * step) if step > 0 else 0.0
    from torchacc.plan import Plan

    return Plan(
        model=spec.name, devices=n_devices, mesh=dict(mesh), batch_size=req["batch_size"],
        seq_len=req["seq_len"], precision=req["precision"], optimizer=req["optimizer"],
        gc=req["gc"], scan_layers=req["scan_layers"], device=device,
        gpus_per_node=gpus_per_node, n_params=int(n_params), parameters=r["params"],
        gradients=r["grads"], optimizer_state=r["optimizer"], activations=int(act),
        xla_temp=int(temp), batch_bytes=r["batch"], total=int(total),
        collective_bytes={k: int(v) for k, v in sorted(coll_bytes.items())},
        collective_time=dict(sorted(coll_time.items())), flops=flops, model_flops=model_flops,
        bytes_accessed=bytes_accessed, compute_time=t_compute, memory_time=t_mem,
        step_time=step, mfu=mfu, tokens_per_s_per_device=tokens / step / n_devices,
        fits=None if limit is None else total <= limit, memory_limit=limit,
        extrapolated_from=list(depths) if len(raws) > 1 else None, microbatches=micro,
        compile_s=r["compile_s"] + r["trace_s"],
        host_peak_bytes=max(x.get("peak_rss", 0) for x in raws),
    )  # fmt: skip


def _fmt_bytes(n):
    if n is None:
        return "-"
    for unit, s in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= s:
            return f"{n / s:.2f} {unit}"
    return f"{int(n)} B"


def format_table(plans):
    """Human-readable table of plans (one column per plan)."""
    rows = [
        ("mesh", lambda p: ",".join(f"{a}={p.mesh[a]}" for a in AXES if p.mesh[a] > 1) or "1"),
        ("parameters", lambda p: _fmt_bytes(p.parameters)),
        ("gradients", lambda p: _fmt_bytes(p.gradients)),
        ("optimizer state", lambda p: _fmt_bytes(p.optimizer_state)),
        ("activations (est.)", lambda p: _fmt_bytes(p.activations)),
        ("XLA temp", lambda p: _fmt_bytes(p.xla_temp)),
        ("total / device", lambda p: _fmt_bytes(p.total)),
        ("fits", lambda p: "-" if p.fits is None else ("yes" if p.fits else "NO")),
        ("collectives / step", lambda p: ", ".join(
            f"{k} {_fmt_bytes(v)}" for k, v in p.collective_bytes.items()) or "none"),
        ("FLOPs / device (XLA)", lambda p: f"{p.flops:.3e}"),
        ("model FLOPs / step", lambda p: f"{p.model_flops:.3e}"),
        ("compute / HBM time", lambda p: f"{p.compute_time * 1e3:.1f} / "
                                          f"{p.memory_time * 1e3:.1f} ms"),
        ("comm time", lambda p: f"{sum(p.collective_time.values()) * 1e3:.1f} ms"),
        ("est. step time", lambda p: f"{p.step_time * 1e3:.1f} ms"),
        ("est. MFU", lambda p: f"{100 * p.mfu:.1f}%"),
    ]  # fmt: skip
    first = plans[0]
    # (a vision model's "tokens" are images: its plan has no sequence, seq_len 0)
    unit = "tokens" if first.seq_len else "images"
    rows.append((f"{unit}/s/device", lambda p: f"{p.tokens_per_s_per_device:,.0f}"))
    head = (
        f"{first.model}: {first.n_params / 1e6:,.1f}M params, global batch {first.batch_size}"
        + (f" x seq {first.seq_len}" if first.seq_len else "")
        + f", {first.precision}, {first.optimizer}"
        f"{', gc' if first.gc else ''}{', scan_layers' if first.scan_layers else ''}; "
        f"{first.devices} x {first.device} ({first.gpus_per_node} per node)"
    )
    if first.extrapolated_from:
        head += f"; depth extrapolated from {first.extrapolated_from} layers"
    cells = [[name] + [fn(p) for p in plans] for name, fn in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [head]
    for r in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return "\n".join(lines)
