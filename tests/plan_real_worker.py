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
from torchacc.plan.models import resolve  # noqa: E402
from torchacc.program import cache  # noqa: E402


def main():
    reqs = json.loads(sys.argv[1])
    xr.use_spmd()
    for req in reqs if isinstance(reqs, list) else [reqs]:
        run(req)


def run(req):
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
    exes = [e for k, e in cache._cache.items() if k not in before]
    exe = max(exes, key=lambda e: len(e.as_text()))  # the steady training step's program
    mem = exe.memory_analysis()
    if os.environ.get("TORCHACC_PLAN_DUMP_HLO"):
        with open(os.environ["TORCHACC_PLAN_DUMP_HLO"] + ".real.hlo.txt", "w") as f:
            f.write(exe.as_text())
    ids = np.arange(n).reshape([mesh_shape[a] for a in pc.AXES])
    colls = pc.collectives(exe.as_text(), ids, pc.AXES)
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


if __name__ == "__main__":
    main()
