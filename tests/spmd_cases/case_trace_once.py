"""SPMD on the trace-once frontend, 1 process x 4 CPU devices (run by tests/test_spmd_trace_once.py
with CPU_NUM_DEVICES=4): ``torchacc.compile(step)`` over sharded parameters and inputs gives the
lazy frontend's results, keeps every sharding and compiles once (Note [Device tensors in a
trace-once program] in torchacc/engine/handoff.py)."""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from compile_counts import new_graphs  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla._XLAC as _XLAC  # noqa: E402
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402
import torchacc.torch_xla.runtime as xr  # noqa: E402
from torchacc import metrics  # noqa: E402
from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)

xr.use_spmd()
DEV = torchacc.device()
F = torch.nn.functional


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)) for _ in range(n)]


def _mark_2d(model, mesh):
    xs.mark_sharding(model[0].weight, mesh, ("model", None))
    xs.mark_sharding(model[0].bias, mesh, ("model",))
    xs.mark_sharding(model[2].weight, mesh, (None, "model"))


def _train(model, step, batches, mesh, spec):
    losses, graphs = [], []
    for x, y in batches:
        xd, yd = x.to(DEV), y.to(DEV)
        xs.mark_sharding(xd, mesh, spec)
        before = new_graphs()
        loss = step(xd, yd)
        torchacc.sync()
        graphs.append(new_graphs() - before)
        losses.append(loss.item())
    return losses, graphs


def _specs(model):
    return [_XLAC._get_xla_sharding_spec(p) for p in model.parameters()]


def _two_runs(build, spec, mesh, constrain=None, steps=5):
    """The same sharded training on the lazy frontend and through torchacc.compile."""
    runs = []
    for compiled in (False, True):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y, model=model, opt=opt):
            h = model[0](x)
            if constrain is not None:
                xs.mark_sharding(h, mesh, constrain)
            loss = F.mse_loss(model[2](model[1](h)), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        metrics.clear_all()
        fn = torchacc.compile(step) if compiled else step
        specs = _specs(model)
        losses, graphs = _train(model, fn, _batches(steps), mesh, spec)
        runs.append((model, opt, losses, graphs, specs))
    runs.append(fn)
    return runs


def _check(runs):
    (lazy, _, lazy_losses, _, _), (model, opt, losses, graphs, specs) = runs[:2]
    assert max(abs(a - b) for a, b in zip(losses, lazy_losses)) <= 1e-5, (losses, lazy_losses)
    for p, q in zip(model.parameters(), lazy.parameters()):
        assert (p.detach().cpu() - q.detach().cpu()).abs().max().item() <= 1e-5
    # one trace, one XLA compile; the steps after the eager first one build no lazy program
    assert metrics.counter_value("StepTrace") == 1
    assert metrics.counter_value("DynamoCompile") == 1
    assert not metrics.counter_value("StepRecompile")
    assert graphs[2:] == [0] * (len(graphs) - 2), graphs
    # parameters and optimizer state keep their layouts
    assert _specs(model) == specs
    for p in model.parameters():
        for v in opt.state[p].values():
            if v.dim():
                assert _XLAC._get_xla_sharding_spec(v) == _XLAC._get_xla_sharding_spec(p)
    return model


def test_compile_step_2d_sharding_matches_lazy_and_compiles_once():
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))

    def build():
        model = _mlp().to(DEV)
        _mark_2d(model, mesh)
        return model

    model = _check(_two_runs(build, ("data", None), mesh))
    assert _specs(model)[0] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"


def test_compile_step_constraint_inside_the_step():
    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))

    def build():
        model = _mlp().to(DEV)
        _mark_2d(model, mesh)
        return model

    from torchacc.sharding.rules import shard_op

    runs = _two_runs(build, ("data", None), mesh, constrain=("data", "model"))
    _check(runs)
    # the mark inside the step is a constraint node of the traced graph
    (prog,) = runs[2]._programs.values()
    assert sum(n.target is shard_op for n in prog.lowered.gm.graph.nodes) == 1


def test_compile_step_fsdpv2_matches_lazy():
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))

    def build():
        return FSDPv2(_mlp().to(DEV), mesh)

    runs = []
    for compiled in (False, True):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x, y, model=model, opt=opt):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        metrics.clear_all()
        fn = torchacc.compile(step) if compiled else step
        specs = _specs(model)
        losses, graphs = _train(model, fn, _batches(5), mesh, ("fsdp", None))
        runs.append((model, opt, losses, graphs, specs))
    _check(runs)
