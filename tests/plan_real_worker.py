"""A real torchacc SPMD training step on 4 CPU devices, measured the way the planner reports it
(run by tests/test_plan.py in a fresh process with CPU_NUM_DEVICES=4).

Argument: a JSON list of {model, batch_size, seq_len, mesh: {dp, fsdp, cp, tp}, optimizer}. Each
model is laid out with the planner's partition specs (``torchacc.plan.compile.param_spec``)
through torch_xla's ``mark_sharding`` and trained 3 steps with ``torch.optim`` on the torchacc
device; one JSON line per case: per-device bytes of parameters / gradients / optimizer state
(``distributed.sharding.memory_report``), the steady step program's memory analysis, and its
collectives (parsed from its HLO with the planner's parser).
"""

import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torchacc  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc.distributed import sharding as engine  # noqa: E402
from torchacc.plan import compile as pc  # noqa: E402
from torchacc.plan import pipeline as plan_pipeline  # noqa: E402
from torchacc.plan.models import resolve  # noqa: E402
from torchacc.program import cache  # noqa: E402


def main():
    reqs = json.loads(sys.argv[1])
    xr.use_spmd()
    for req in reqs if isinstance(reqs, list) else [reqs]:
        run(req)


def run(req):
    if req["mesh"].get("pp", 1) > 1:
        return run_pipeline(req)
    if req["mesh"].get("cp", 1) > 1:
        return run_context_parallel(req)
    dev = torchacc.device()
    spec = resolve(req["model"])
    torch.manual_seed(0)
    model = spec.build(None, False)
    model.train()
    model.to(dev)
    mesh_shape = {a: req["mesh"].get(a, 1) for a in pc.AXES}
    n = int(np.prod(list(mesh_shape.values())))
    mesh = xs.Mesh(np.arange(n), tuple(mesh_shape[a] for a in pc.AXES), pc.AXES)
    for name, p in model.named_parameters():
        s = pc.param_spec(name, tuple(p.shape), mesh_shape)
        if any(e is not None for e in s):
            xs.mark_sharding(p, mesh, s)
    data_axes = tuple(a for a in pc.DATA_AXES if mesh_shape[a] > 1)
    batch_entry = None if not data_axes else (data_axes[0] if len(data_axes) == 1 else data_axes)
    if req["optimizer"] == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    b, t, v = req["batch_size"], req["seq_len"], spec.vocab
    gen = torch.Generator().manual_seed(1)
    before = set()
    for i in range(3):
        if i == 1:
            before = set(cache._cache)  # the steady step's program compiles at step 2
        ids = torch.randint(0, v, (b, t), generator=gen).to(dev)
        labels = torch.randint(0, v, (b, t), generator=gen).to(dev)
        if batch_entry is not None:
            xs.mark_sharding(ids, mesh, (batch_entry, None))
            xs.mark_sharding(labels, mesh, (batch_entry, None))
        opt.zero_grad(set_to_none=False)
        logits = model(ids).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))
        del logits  # (a live tensor at the sync would be one more output of the step)
        loss.backward()
        opt.step()  # gradients and moments take their parameter's layout (Note [State keeps
        torchacc.sync(wait=True)  # its parameter's layout] in tests/test_plan.py)
    report = engine.memory_report(model, opt)
    ids = np.arange(n).reshape([mesh_shape[a] for a in pc.AXES])
    measure(report, before, ids, pc.AXES, loss)


def measure(report, before, ids, axis_names, loss):
    exes = [e for k, e in cache._cache.items() if k not in before]
    exe = max(exes, key=lambda e: len(e.as_text()))  # the steady training step's program
    mem = exe.memory_analysis()
    if os.environ.get("TORCHACC_PLAN_DUMP_HLO"):
        with open(os.environ["TORCHACC_PLAN_DUMP_HLO"] + ".real.hlo.txt", "w") as f:
            f.write(exe.as_text())
    colls = pc.collectives(exe.as_text(), ids, axis_names)
    out = {
        "parameters": report["parameters"].get(0, 0),
        "gradients": report["gradients"].get(0, 0),
        "optimizer_state": report["optimizer_state"].get(0, 0),
        "argument": int(mem.argument_size_in_bytes),
        "output": int(mem.output_size_in_bytes),
        "alias": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
        "collectives": colls,
        "loss": float(loss.item()),
    }
    print("PLAN_REAL " + json.dumps(out), flush=True)


def run_context_parallel(req):
    """ta.accelerate with Config.dist.sp (the sequence over the mesh's sp axis, attention the
    ring / Ulysses region), dp and fsdp; torch AdamW; gradients and moments laid out like their
    parameters (Note [State keeps its parameter's layout])."""
    spec = resolve(req["model"])
    torch.manual_seed(0)
    model = spec.build(None, False)
    model.train()
    m = {a: req["mesh"].get(a, 1) for a in pc.AXES}
    config = torchacc.Config()
    config.dist.sp.size, config.dist.fsdp.size = m["cp"], m["fsdp"]
    config.dist.dp.size, config.dist.tp.size = m["dp"], m["tp"]
    model = torchacc.accelerate(model, config=config)
    n = int(np.prod(list(m.values())))
    names = ("dp", "fsdp", "sp", "tp")  # accelerate's (dp, fsdp, sp, tp) mesh
    mesh = xs.Mesh(np.arange(n), tuple(m[a] for a in pc.AXES), names)
    data = tuple(a for a in pc.DATA_AXES if m[a] > 1)
    label_spec = ((data[0] if len(data) == 1 else data) if data else None, "sp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    b, t, v = req["batch_size"], req["seq_len"], spec.vocab
    gen = torch.Generator().manual_seed(1)
    dev = torchacc.device()
    before = set()
    for i in range(2):  # the steady step's program compiles at step 2
        if i == 1:
            before = set(cache._cache)
        ids = torch.randint(0, v, (b, t), generator=gen).to(dev)
        labels = torch.randint(0, v, (b, t), generator=gen).to(dev)
        xs.mark_sharding(labels, mesh, label_spec)
        opt.zero_grad(set_to_none=False)
        logits = model(ids).float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))
        del logits
        loss.backward()
        opt.step()  # gradients and moments keep their parameter's layout (sharding/layout.py)
        torchacc.sync(wait=True)
    report = engine.memory_report(model, opt)
    measure(report, before, np.arange(n).reshape([m[a] for a in pc.AXES]), pc.AXES, loss)


def run_pipeline(req):
    """ta.dist.PipelineParallel of the model (Config.dist: dp, fsdp, pp, micro-batches, 1F1B),
    split where the planner splits it, AdamW over its parameters (the packed rows)."""
    spec = resolve(req["model"])
    torch.manual_seed(0)
    model = plan_pipeline.TokensOnly(spec.build(None, False))  # the planner's stage cut
    mesh = req["mesh"]
    config = torchacc.Config()
    config.dist.pp.size = mesh["pp"]
    config.dist.pp.num_micro_batches = req["microbatches"]
    config.dist.pp.split_points = plan_pipeline.split_points(spec, spec.n_layer, mesh["pp"])
    config.dist.dp.size = mesh.get("dp", 1)
    config.dist.fsdp.size = mesh.get("fsdp", 1)
    pm = torchacc.dist.PipelineParallel(model, config)
    pm.to(torchacc.device())
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    b, t, v = req["batch_size"], req["seq_len"], spec.vocab
    gen = torch.Generator().manual_seed(1)
    before = set()
    for i in range(2):  # the steady step's program compiles at step 2
        if i == 1:
            before = set(cache._cache)
        ids = torch.randint(0, v, (b, t), generator=gen).to(torchacc.device())
        labels = torch.randint(0, v, (b, t), generator=gen).to(torchacc.device())
        opt.zero_grad(set_to_none=False)
        loss = pm.forward_backward(ids, labels=labels, output_fn=plan_pipeline.lm_loss)
        opt.step()
        torchacc.sync(wait=True)
    report = engine.memory_report(pm, opt)
    grid = np.vectorize(lambda d: d.id)(pm.mesh().devices)
    measure(report, before, grid, tuple(pm.mesh().axis_names), loss)


if __name__ == "__main__":
    main()
