"""The planner's worker process: compiles the requested steps for a mesh of virtual CPU devices
and prints one JSON line of measurements per layout (read by ``torchacc/plan/__init__.py``).

Started by :func:`torchacc.plan.plan` with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
and ``JAX_PLATFORMS=cpu`` set before JAX starts; argument: one JSON object on stdin.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time


def _progress(msg):
    print(f"[plan-progress] {msg}", file=sys.stderr, flush=True)


def compile_one(spec, req, layout, n_layer, devices):
    """Trace, lower and compile one step with ``n_layer`` layers for ``layout`` (one pipeline
    stage's mesh: dp, fsdp, cp, tp); returns the raw measurements."""
    import jax
    import numpy as np

    from torchacc.plan import compile as pc

    mesh_shape = {a: layout.get(a, 1) for a in pc.AXES}
    pp = layout.get("pp", 1)
    micro = req["microbatches"] if pp > 1 else 1
    batch = req["batch_size"] // micro
    seq = req["seq_len"]
    n_stage = math.prod(mesh_shape.values())
    grid = np.array(devices[:n_stage], dtype=object).reshape([mesh_shape[a] for a in pc.AXES])
    mesh = jax.sharding.Mesh(grid, pc.AXES)
    P = jax.sharding.PartitionSpec
    NS = jax.sharding.NamedSharding
    batch_axes = tuple(a for a in pc.DATA_AXES if mesh_shape[a] > 1)
    data_axes = batch_axes or None
    if data_axes and len(data_axes) == 1:
        data_axes = data_axes[0]
    cp = None
    if mesh_shape["cp"] > 1 and spec.kind == "lm":  # Note [Context parallel in a plan]
        cp = (mesh, batch_axes, "tp" if mesh_shape["tp"] > 1 else None)
    t0 = time.perf_counter()
    gm, roles_in, roles_out, info = pc.trace(
        spec,
        n_layer=n_layer,
        batch=batch,
        seq=seq,
        precision=req["precision"],
        optimizer=req["optimizer"],
        gc=req["gc"],
        scan_layers=req["scan_layers"],
        cp=cp,
    )
    t_trace = time.perf_counter() - t0
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    constrain = None
    # (no activation constraints under cp: Note [Context parallel in a plan] in compile.py)
    if req.get("constrain", True) and data_axes and mesh_shape["cp"] == 1 and spec.kind == "lm":
        constrain = pc.activation_constraint(mesh, data_axes, mesh_shape, batch, seq)
    run, n_in = pc.lower_to_jax(gm, constrain)

    def spec_of(role, shape):
        kind, i = role
        if kind in ("param", "m", "v", "grad"):
            return pc.param_spec(info["names"][i], info["shapes"][i], mesh_shape)
        if kind == "batch":
            s = [None] * len(shape)
            if shape:
                s[0] = data_axes
            if len(shape) >= 2 and mesh_shape["cp"] > 1 and spec.kind == "lm":
                s[1] = "cp"
            return tuple(s)
        return tuple([None] * len(shape))

    avals, in_specs, logical, donate = [], [], [], []
    for k, (ph, role) in enumerate(zip(placeholders, roles_in)):
        val = ph.meta["val"]
        shape = tuple(val.shape)
        s = spec_of(role, shape)
        pshape = pc.padded(shape, s, mesh_shape)
        dtype = jax.numpy.dtype(str(val.dtype).replace("torch.", ""))
        sh = NS(mesh, P(*s))
        avals.append(jax.ShapeDtypeStruct(pshape, dtype, sharding=sh))
        in_specs.append(sh)
        logical.append(shape if pshape != shape else None)
        if role[0] in ("param", "m", "v", "count") or (role[0] == "buffer" and role in roles_out):
            donate.append(k)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_vals = [o.meta["val"] for o in out_node.args[0]]
    out_specs, out_pad = [], []
    for o, role in zip(out_vals, roles_out):
        shape = tuple(o.shape)
        s = spec_of(role, shape)
        out_specs.append(NS(mesh, P(*s)))
        pshape = pc.padded(shape, s, mesh_shape)
        out_pad.append([(0, p - n) for n, p in zip(shape, pshape)] if pshape != shape else None)

    def step(*arrays):
        xs = [
            a if lg is None else a[tuple(slice(0, n) for n in lg)] for a, lg in zip(arrays, logical)
        ]
        outs = run(*xs)
        return [o if pd is None else jax.numpy.pad(o, pd) for o, pd in zip(outs, out_pad)]

    t1 = time.perf_counter()
    jitted = jax.jit(
        step, in_shardings=in_specs, out_shardings=out_specs, donate_argnums=tuple(donate)
    )
    lowered = jitted.lower(*avals)
    exe = lowered.compile()
    t_compile = time.perf_counter() - t1
    mem = exe.memory_analysis()
    cost = exe.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    hlo = exe.as_text()
    dump = os.environ.get("TORCHACC_PLAN_DUMP_HLO")
    if dump:
        with open(f"{dump}.{n_layer}.hlo.txt", "w") as f:
            f.write(hlo)
    ids = np.vectorize(lambda d: d.id)(grid)
    colls = pc.collectives(hlo, ids, pc.AXES)
    # per-device bytes of each role, from the input layouts (padding included)
    role_bytes = {}
    for aval, role, ph in zip(avals, roles_in, placeholders):
        s = aval.sharding.spec
        nb = pc.shard_bytes(
            tuple(ph.meta["val"].shape), tuple(s) + (None,) * (len(aval.shape) - len(s)),
            mesh_shape, aval.dtype.itemsize,
        )  # fmt: skip
        role_bytes[role[0]] = role_bytes.get(role[0], 0) + nb
    grad_bytes = role_bytes.get("param", 0) * 4 // 4
    grad_bytes = sum(
        pc.shard_bytes(info["shapes"][i], pc.param_spec(info["names"][i], info["shapes"][i],
                       mesh_shape), mesh_shape, 4)
        for i in range(len(info["names"]))
    )  # fmt: skip
    # activations kept for backward: forward values the backward reads, split over the data
    # axes (and cp) where their leading dims hold the batch (an estimate, Note [Estimates])
    saved = pc.saved_activation_nodes(gm)
    split = mesh_shape["dp"] * mesh_shape["fsdp"] * mesh_shape["cp"]
    act = 0
    for n in saved:
        v = n.meta.get("val")
        if not isinstance(v, __import__("torch").Tensor):
            continue
        nb = v.numel() * v.element_size()
        if v.dim() and v.shape[0] % batch == 0 and v.shape[0] >= batch:
            nb //= split if v.shape[0] % split == 0 else 1
        act += nb
    return dict(
        n_layer=n_layer,
        trace_s=t_trace,
        compile_s=t_compile,
        argument=int(mem.argument_size_in_bytes),
        output=int(mem.output_size_in_bytes),
        alias=int(mem.alias_size_in_bytes),
        temp=int(mem.temp_size_in_bytes),
        generated_code=int(mem.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=colls,
        params=role_bytes.get("param", 0),
        grads=grad_bytes,
        optimizer=role_bytes.get("m", 0) + role_bytes.get("v", 0),  # (the step count: host)
        buffers=role_bytes.get("buffer", 0),
        batch=role_bytes.get("batch", 0),
        activations=act,
        n_params=info["n_params"],
        embed_params=info["embed_params"],
        param_elems_padded=sum(
            math.prod(pc.padded(s, pc.param_spec(n, s, mesh_shape), mesh_shape))
            for n, s in zip(info["names"], info["shapes"])
        ),
        graph_nodes=len(gm.graph.nodes),
    )


def main():
    request = json.loads(sys.stdin.read())
    import jax

    from torchacc.plan import compile as pc
    from torchacc.plan.models import PlanError, resolve

    out = sys.stdout
    jobs = request["jobs"]
    try:
        devices = jax.devices()
        for j, req in enumerate(jobs):
            spec = resolve(req["model"])
            full_params, full_embed = pc.count_params(spec)
            layout = dict(req["layout"])
            depths = req["depths"]
            for k, depth in enumerate(depths):
                what = (
                    f"compiling {depth or spec.n_layer} layers"
                    if depth or spec.n_layer
                    else "compiling the step"
                )
                axes = ",".join(f"{a}={layout[a]}" for a in layout if layout[a] > 1) or "dp=1"
                _progress(
                    f"{req['model']} {j + 1}/{len(jobs)} {axes}: {what} ({k + 1}/{len(depths)})"
                )
                if layout.get("pp", 1) > 1:  # Note [What the planner compiles under pp]
                    from torchacc.plan.pipeline import compile_pp

                    r = compile_pp(spec, req, layout, depth, devices)
                else:
                    r = compile_one(spec, req, layout, depth, devices)
                r["job"] = j
                r["full_params"], r["full_embed_params"] = full_params, full_embed
                r["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
                out.write(json.dumps(r) + "\n")
                out.flush()
    except PlanError as e:
        out.write(json.dumps({"error": str(e)}) + "\n")
        sys.exit(3)


if __name__ == "__main__":
    main()
