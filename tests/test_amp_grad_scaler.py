"""GradScaler on the torchacc device: torch.amp.GradScaler's growth/backoff exactly, a sync-free
AMP step (zero host transfers), and the seed's recipe as written."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from compile_counts import new_graphs

import torchacc
from torchacc import metrics
from torchacc.amp import GradScaler, autocast, syncfree
from torchacc.lowering.amp_twins import non_finite_check_and_unscale_, update_scale_

INF_STEPS = {2, 3, 7}


def _grads(step, shapes, scale):
    g = torch.Generator().manual_seed(step)
    grads = [torch.randn(s, generator=g) * scale for s in shapes]
    if step in INF_STEPS:
        grads[step % len(grads)].view(-1)[0] = float("inf") if step != 3 else float("nan")
    return grads


@pytest.mark.parametrize(
    "settings",
    [
        dict(init_scale=2.0**10, growth_interval=2),
        dict(init_scale=1000.0, growth_factor=1.7, backoff_factor=0.3, growth_interval=3),
    ],
    ids=["default-factors", "odd-factors"],
)
def test_growth_and_backoff_match_torch(settings):
    dev = torchacc.device()
    shapes = [(4, 3), (3,)]
    init = [torch.randn(s) for s in shapes]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    params = [nn.Parameter(t.clone().to(dev)) for t in init]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1, momentum=0.9)
    opt = syncfree.SGD(params, lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    scaler = GradScaler(**settings)
    ones = torch.ones((), device=dev)
    ref_ones = torch.ones(())
    for step in range(10):
        # "backward" of loss * scale: grads are the scaled true gradients
        ref_scale, scale = ref_scaler.scale(ref_ones), scaler.scale(ones)
        grads = _grads(step, shapes, float(ref_scale))
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dev)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        scaler.step(opt)
        scaler.update()
        torchacc.sync()
        assert float(scale.cpu()) == float(ref_scale)
        assert scaler._scale.cpu().item() == ref_scaler._scale.item(), f"scale at step {step}"
        assert scaler._growth_tracker.cpu().item() == ref_scaler._growth_tracker.item()
        assert scaler._growth_tracker.dtype == torch.int32
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.state_dict() == ref_scaler.state_dict()


def test_device_kernels_match_torch_kernels():
    dev = torchacc.device()
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([[float("inf"), 3.0]])]
    found, inv = torch.zeros(()), torch.tensor(0.25)
    ref = [g.clone() for g in grads]
    torch._amp_foreach_non_finite_check_and_unscale_(ref, found, inv)
    dgrads = [g.to(dev) for g in grads]
    dfound = torch.zeros((), device=dev)
    non_finite_check_and_unscale_(dgrads, dfound, inv.to(dev))
    for g, r in zip(dgrads, ref, strict=True):
        torch.testing.assert_close(g.cpu(), r)
    assert dfound.cpu().item() == found.item() == 1.0
    for found_inf, tracker in [(0.0, 0), (0.0, 1), (1.0, 1), (0.0, 2)]:
        s, t = torch.tensor(8.0), torch.tensor(tracker, dtype=torch.int32)
        torch._amp_update_scale_(s, t, torch.tensor(found_inf), 2.0, 0.5, 2)
        ds, dt = torch.tensor(8.0).to(dev), torch.tensor(tracker, dtype=torch.int32).to(dev)
        update_scale_(ds, dt, torch.tensor(found_inf).to(dev), 2.0, 0.5, 2)
        assert (ds.cpu().item(), dt.cpu().item()) == (s.item(), t.item())
    # the scale never grows past float32's range
    ds, dt = torch.tensor(3e38).to(dev), torch.tensor(0, dtype=torch.int32).to(dev)
    update_scale_(ds, dt, torch.zeros(()).to(dev), 2.0, 0.5, 1)
    assert ds.cpu().item() == pytest.approx(3e38) and dt.cpu().item() == 0


def test_constructor_forms():
    assert GradScaler()._device == "torchacc"
    assert GradScaler("xla")._device == "torchacc"
    s = GradScaler(128.0, 3.0, 0.25, 10)  # torch_xla's positional form
    assert (s._init_scale, s._growth_factor, s._backoff_factor, s._growth_interval) == (
        128.0,
        3.0,
        0.25,
        10,
    )
    assert GradScaler(device=torchacc.device(), init_scale=4.0)._init_scale == 4.0
    assert not GradScaler(enabled=False).is_enabled()
    # torch's positional form: the device first, then the same settings as torch's GradScaler
    ours = GradScaler("torchacc", 256.0, 4.0, 0.125, 5)
    ref = torch.amp.GradScaler("cpu", 256.0, 4.0, 0.125, 5)
    assert ours._device == "torchacc"
    for get in ("get_scale", "get_growth_factor", "get_backoff_factor", "get_growth_interval"):
        assert getattr(ours, get)() == getattr(ref, get)(), get
    with pytest.raises(TypeError, match="at most 5 positional"):
        GradScaler("torchacc", 1.0, 2.0, 0.5, 10, True, 7)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def test_fp16_amp_step_has_no_host_transfers():
    dev = torchacc.device()
    torch.manual_seed(0)
    model = _Net().to(dev)
    opt = syncfree.AdamW(model.parameters(), lr=1e-2)
    scaler = GradScaler(init_scale=2.0**8, growth_interval=2)
    batches = [tuple(t.to(dev) for t in _batch(s)) for s in range(3)]
    torchacc.sync()
    losses = []
    for step in range(6):
        if step == 2:  # after warm-up (first compiles, optimizer state creation)
            start = metrics.counter_value("TransferFromDevice") or 0
            fallbacks = metrics.executed_fallback_ops()
            graphs = new_graphs()
        x, y = batches[step % 3]
        with autocast(dtype=torch.float16):
            out = model(x)
            loss = F.cross_entropy(out, y)
        assert out.dtype == torch.float16 and loss.dtype == torch.float32
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        torchacc.sync()
        losses.append(loss)
    assert (metrics.counter_value("TransferFromDevice") or 0) == start
    assert metrics.executed_fallback_ops() == fallbacks
    assert new_graphs() == graphs  # a changing loss scale is data: no new program
    assert float(scaler.get_scale()) == 2.0**11  # 6 steps, growth_interval 2, no overflow
    assert all(torch.isfinite(v.cpu()) for v in losses)


def test_non_syncfree_optimizer_falls_back_to_a_host_read():
    dev = torchacc.device()
    p = nn.Parameter(torch.ones(3).to(dev))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = GradScaler(init_scale=4.0)
    for grad, changes in [
        (torch.full((3,), 4.0), True),
        (torch.tensor([float("inf"), 0, 0]), False),
    ]:
        before = p.detach().cpu().clone()
        scaler.scale(torch.ones((), device=dev))
        p.grad = grad.to(dev)
        n = metrics.counter_value("TransferFromDevice") or 0
        scaler.step(opt)
        assert (metrics.counter_value("TransferFromDevice") or 0) == n + 1  # torch's .item()
        scaler.update()
        torchacc.sync()
        assert (not torch.equal(p.detach().cpu(), before)) == changes
    assert scaler.get_scale() == 2.0


def test_use_zero_grad_option():
    dev = torchacc.device()
    p = nn.Parameter(torch.ones(3).to(dev))
    opt = torch.optim.SGD([p], lr=0.5)
    scaler = GradScaler(init_scale=4.0, use_zero_grad=True)
    scaler.scale(torch.ones((), device=dev))
    p.grad = torch.tensor([float("inf"), 1.0, 1.0]).to(dev)
    n = metrics.counter_value("TransferFromDevice") or 0
    scaler.step(opt)
    scaler.update()
    torchacc.sync()
    assert (metrics.counter_value("TransferFromDevice") or 0) == n
    assert torch.equal(p.detach().cpu(), torch.ones(3))


def test_seed_recipe_as_written(monkeypatch):
    # ../shared/seeds/002: the TorchAcc ResNet-50 recipe's AMP branch, verbatim but for the model
    import torch.distributed as dist

    import torchacc.torch_xla.core.xla_model as xm
    from torchacc.torch_xla.amp import GradScaler, autocast, syncfree

    monkeypatch.setattr(dist, "get_rank", xm.get_ordinal)
    monkeypatch.setattr(dist, "get_world_size", xm.xrt_world_size)
    device = xm.xla_device()
    xm.set_replication(device, [device])
    torch.manual_seed(0)
    ref = _Net()
    model = copy.deepcopy(ref)
    model.to(device)
    xm.mark_step()
    optimizer = syncfree.AdamW(model.parameters(), 1e-2, weight_decay=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), 1e-2, weight_decay=1e-4)
    scaler = GradScaler()
    criterion = nn.CrossEntropyLoss()
    for step in range(4):
        if step == 2:  # warmed up: the rest of the recipe makes no host transfer
            transfers = metrics.counter_value("TransferFromDevice") or 0
        images, target = _batch(step)
        with autocast():
            output = model(images.to(device))
            loss = criterion(output, target.to(device))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        gradients = xm._fetch_gradients(optimizer)
        xm.all_reduce("sum", gradients, scale=1.0 / dist.get_world_size())
        scaler.step(optimizer)
        scaler.update()
        xm.mark_step()
        # fp32 eager reference: bf16 autocast changes the numbers a little
        ref_opt.zero_grad()
        criterion(ref(images), target).backward()
        ref_opt.step()
    assert (metrics.counter_value("TransferFromDevice") or 0) == transfers
    assert len(gradients) == 4
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=0.05, atol=0.02)
    assert scaler.get_scale() == 2.0**16


@pytest.mark.parametrize("kind", ["syncfree", "torch.optim"])
def test_one_scaler_several_optimizers_matches_torch(kind):
    """torch.amp.GradScaler's contract for several optimizers: each optimizer skips its step when
    *its own* gradients overflowed, and update() backs off when *any* of them did."""
    dev = torchacc.device()
    shapes = {"a": [(3, 2), (2,)], "b": [(4,)]}
    overflow = {1: "b", 2: "a", 4: "b"}  # step -> the optimizer whose gradients hold an inf/nan
    make = {
        "syncfree": lambda ps: syncfree.SGD(ps, lr=0.1, momentum=0.5),
        "torch.optim": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5),
    }[kind]
    init = {k: [torch.randn(s) for s in v] for k, v in shapes.items()}
    ref = {k: [nn.Parameter(t.clone()) for t in v] for k, v in init.items()}
    got = {k: [nn.Parameter(t.clone().to(dev)) for t in v] for k, v in init.items()}
    ref_opts = {k: torch.optim.SGD(v, lr=0.1, momentum=0.5) for k, v in ref.items()}
    opts = {k: make(v) for k, v in got.items()}
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2)
    scaler = GradScaler(init_scale=2.0**4, growth_interval=2)
    for step in range(6):
        scale = float(ref_scaler.scale(torch.ones(())))  # "backward" of loss * scale
        scaler.scale(torch.ones((), device=dev))
        for i, k in enumerate(shapes):
            grads = _grads(10 * step + 10 + i, shapes[k], scale)  # never an INF_STEPS seed
            if overflow.get(step) == k:
                grads[-1].view(-1)[0] = float("nan") if k == "a" else float("inf")
            for p, q, g in zip(ref[k], got[k], grads, strict=True):
                p.grad, q.grad = g.clone(), g.to(dev)
        for k in shapes:
            ref_scaler.step(ref_opts[k])
            scaler.step(opts[k])
        ref_scaler.update()
        scaler.update()
        torchacc.sync()
        assert scaler.get_scale() == ref_scaler.get_scale(), f"scale after step {step}"
        for k in shapes:
            for p, q in zip(ref[k], got[k], strict=True):
                torch.testing.assert_close(
                    q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6, msg=f"{k} step {step}"
                )
    assert scaler.state_dict() == ref_scaler.state_dict()


def test_torch_grad_scaler_itself_runs_its_kernels_on_the_device():
    """Plain ``torch.amp.GradScaler("torchacc")`` (not torchacc's subclass) calls the raw
    ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``: both are recorded
    (no CPU fallback), and scale, growth tracker, unscaled gradients and parameters follow the
    CPU scaler step for step through inf and NaN steps. Its ``step`` reads found_inf on the host
    (torch's behaviour, one transfer); ``unscale_`` and ``update`` read nothing."""
    dev = torchacc.device()
    shapes = [(4, 3), (3,)]
    init = [torch.randn(s) for s in shapes]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    params = [nn.Parameter(t.clone().to(dev)) for t in init]
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    opt = torch.optim.SGD(params, lr=0.1)
    settings = dict(init_scale=2.0**10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", **settings)
    scaler = torch.amp.GradScaler("torchacc", **settings)
    assert type(scaler) is torch.amp.GradScaler
    fallbacks = metrics.executed_fallback_ops()
    for step in range(6):
        ref_scale = ref_scaler.scale(torch.ones(()))
        scaler.scale(torch.ones((), device=dev))
        grads = _grads(step, shapes, float(ref_scale))
        for p, r, g in zip(params, ref_params, grads, strict=True):
            r.grad, p.grad = g.clone(), g.to(dev)
        torchacc.sync()
        n = metrics.counter_value("TransferFromDevice") or 0
        ref_scaler.unscale_(ref_opt)
        scaler.unscale_(opt)
        torchacc.sync()
        assert (metrics.counter_value("TransferFromDevice") or 0) == n
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=0, atol=0, equal_nan=True)
        ref_scaler.step(ref_opt)
        scaler.step(opt)
        ref_scaler.update()
        n = metrics.counter_value("TransferFromDevice") or 0
        scaler.update()
        torchacc.sync()
        assert (metrics.counter_value("TransferFromDevice") or 0) == n
        assert scaler._scale.cpu().item() == ref_scaler._scale.item(), f"scale at step {step}"
        assert scaler._growth_tracker.cpu().item() == ref_scaler._growth_tracker.item()
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-6, atol=1e-7)
    assert metrics.executed_fallback_ops() == fallbacks
