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
    # parameters and optimizer state keep their layouts: a marked parameter its mark (one never
    # marked reads torch_xla's '' for an upload, then whatever the frontend's program left)
    assert all(a == b for a, b in zip(_specs(model), specs) if b), (_specs(model), specs)
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


# --- torch.compile(model, backend="torchacc") over sharded tensors --------------------------
# (Note [torch.compile over torchacc tensors] in torchacc/dynamo/device_tensors.py)


def _fit(model, batches, forward=None, device=DEV, mesh=None):
    """AdamW training of ``model`` on ``batches``: losses, programs built per step, params."""
    forward = model if forward is None else forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, graphs = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        if mesh is not None:
            xs.mark_sharding(x, mesh, ("fsdp", None))
        before = new_graphs() + (metrics.counter_value("DynamoCompile") or 0)
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device != "cpu":
            torchacc.sync()
        losses.append(loss.item())
        graphs.append(new_graphs() + (metrics.counter_value("DynamoCompile") or 0) - before)
    return losses, graphs, [p.detach().cpu() for p in model.parameters()]


def test_torch_compile_fsdp_matches_lazy_and_eager_and_compiles_once():
    mesh = xs.Mesh(np.arange(4), (4, 1), ("fsdp", "model"))
    batches = _batches(5)
    eager = _fit(_mlp(), batches, device="cpu")
    lazy = _fit(FSDPv2(_mlp().to(DEV), mesh), batches, mesh=mesh)
    metrics.clear_all()
    model = FSDPv2(_mlp().to(DEV), mesh)
    specs = _specs(model)
    compiled = _fit(model, batches, torch.compile(model, backend="torchacc"), mesh=mesh)
    for other in (eager, lazy):
        assert max(abs(a - b) for a, b in zip(compiled[0], other[0])) <= 1e-5, (compiled, other)
        for p, q in zip(compiled[2], other[2]):
            assert (p - q).abs().max().item() <= 1e-5
    # one dynamo graph (FSDPv2's output constraint inside it), a forward and a backward program,
    # nothing new after step 2; the model never ran on the lazy frontend
    assert metrics.counter_value("DynamoGraph") == 1
    assert not metrics.counter_value("DynamoRecompile")
    assert metrics.counter_value("DynamoCompile") == 2
    assert compiled[1][2:] == [0, 0, 0], compiled[1]
    assert not metrics.counter_value("DynamoLazyFallback")
    assert not metrics.counter_value("xla::linear") and not metrics.counter_value("xla::gelu")
    assert _specs(model) == specs  # parameters (updated on the lazy frontend) keep their layouts
    # the backward program's gradients come out laid out as their parameters (XLA's propagation)
    x = batches[0][0].to(DEV)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    torch.compile(model, backend="torchacc")(x).sum().backward()
    assert [_XLAC._get_xla_sharding_spec(p.grad) for p in model.parameters()] == specs


def test_torch_compile_mark_sharding_inside_is_a_constraint():
    from torchacc.dynamo import aot
    from torchacc.sharding.rules import shard_op

    mesh = xs.Mesh(np.arange(4), (2, 2), ("data", "model"))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp().to(DEV)
            _mark_2d(self.net, mesh)

        def forward(self, x):
            h = self.net[0](x)
            xs.mark_sharding(h, mesh, ("data", "model"))
            return self.net[2](self.net[1](h))

    batches = _batches(4)
    lazy = _fit(Block(), batches)
    aot._lowered.clear()
    metrics.clear_all()
    model = Block()
    out = _fit(model, batches, torch.compile(model, backend="torchacc"))
    assert max(abs(a - b) for a, b in zip(out[0], lazy[0])) <= 1e-5, (out[0], lazy[0])
    assert metrics.counter_value("DynamoGraph") == 1 and out[1][2:] == [0, 0]
    (forward,) = [low for low in aot._lowered.values() if low.name == "forward"]
    assert sum(n.target is shard_op for n in forward.gm.graph.nodes) == 1


def test_openxla_backend_and_dynamo_mark_sharding_through_the_alias():
    import torchacc.alias  # noqa: F401  (torch's "openxla" backend imports torch_xla's bridge)

    mesh = xs.Mesh(np.arange(4), (1, 4))
    ids, shape = mesh.device_ids.tolist(), list(mesh.mesh_shape)
    x = torch.randn(8, 16).to(DEV)

    def fn(t):
        h = t * 2 + 1
        torch.ops.xla.dynamo_mark_sharding(h, ids, shape, str(mesh.axis_names), "(1, 0)")
        return h.sum(0)

    metrics.clear_all()
    got = torch.compile(fn, backend="openxla")(x)
    assert torch.allclose(got.cpu(), fn(x).cpu())
    assert metrics.counter_value("DynamoExtractCompiledGraph") == 1
    assert metrics.counter_value("DynamoCompile") == 1
    # eagerly, the op marks its input as xs.mark_sharding does
    w = torch.randn(16, 8).to(DEV)
    torch.ops.xla.dynamo_mark_sharding(w, ids, shape, str(mesh.axis_names), "(1, 0)")
    assert _XLAC._get_xla_sharding_spec(w) == "{devices=[4,1]0,1,2,3}"
