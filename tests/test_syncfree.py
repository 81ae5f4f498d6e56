"""Syncfree SGD/Adam/AdamW: step-for-step equal to their torch.optim twins (eager CPU) and exact
skips, on the device, of the steps where ``found_inf`` is set."""

import copy

import pytest
import torch

import torchacc
from torchacc import metrics
from torchacc.amp import syncfree

SHAPES = [(3, 4), (3,), (2, 2, 2)]
STEPS = 6
INF_STEPS = {0, 2, 3}  # steps (0-based) whose found_inf is 1.0: skipped (first, consecutive)

CASES = [
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.05)),
    (syncfree.SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    (syncfree.Adam, torch.optim.Adam, dict(lr=0.05)),
    (
        syncfree.Adam,
        torch.optim.Adam,
        dict(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1, amsgrad=True),
    ),
    (
        syncfree.Adam,
        torch.optim.Adam,
        dict(lr=0.05, maximize=True, eps=1e-6, decoupled_weight_decay=True, weight_decay=0.1),
    ),
    (syncfree.AdamW, torch.optim.AdamW, dict(lr=0.05)),
    (
        syncfree.AdamW,
        torch.optim.AdamW,
        dict(lr=0.05, weight_decay=0.3, amsgrad=True, maximize=True),
    ),
]


def _ids(case):
    cls, _, kw = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kw.items())


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) for s in SHAPES]


def _state_tensors(opt, params):
    out = []
    for p in params:
        st = opt.state.get(p, {})
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor):
                out.append((k, v.detach().cpu().float()))
    return out


def _assert_close_state(ours, ref, params, ref_params):
    got = {k: v for k, v in _state_tensors(ours, params)}
    want = {k: v for k, v in _state_tensors(ref, ref_params)}
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"state {k}")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_torch_and_skips_inf_steps(case):
    cls, ref_cls, kw = case
    dev = torchacc.device()
    torch.manual_seed(0)
    init = [torch.randn(s) for s in SHAPES]
    ref_params = [torch.nn.Parameter(t.clone()) for t in init]
    params = [torch.nn.Parameter(t.clone().to(dev)) for t in init]
    ref = ref_cls(ref_params, foreach=False, **kw)
    opt = cls(params, **kw)
    found_inf = torch.zeros((), device=dev)
    applied = 0
    for step in range(STEPS):
        grads = _grads(step)
        skip = step in INF_STEPS
        before = [p.detach().cpu().clone() for p in params]
        state_before = _state_tensors(opt, params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(dev)
        found_inf.fill_(1.0 if skip else 0.0)
        opt.step(found_inf=found_inf)
        torchacc.sync()
        if skip:
            for p, b in zip(params, before, strict=True):
                assert torch.equal(p.detach().cpu(), b), "a skipped step changed a parameter"
            after = _state_tensors(opt, params)
            if not state_before:  # state made by a skipped first step: still all initial zeros
                assert all(not a.any() for _, a in after), "a skipped first step left state"
            else:
                assert [k for k, _ in after] == [k for k, _ in state_before]
                for (k, a), (_, b) in zip(after, state_before, strict=True):
                    assert torch.equal(a, b), f"a skipped step changed state {k}"
            continue
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g.clone()
        ref.step()
        applied += 1
        for p, r in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p.detach().cpu(), r.detach(), rtol=1e-5, atol=1e-6)
        _assert_close_state(opt, ref, params, ref_params)
        for p in params:
            if "step" in opt.state[p]:
                assert opt.state[p]["step"].device.type == "torchacc"
                assert float(opt.state[p]["step"].cpu()) == applied


def test_step_without_found_inf_and_closure():
    dev = torchacc.device()
    p = torch.nn.Parameter(torch.ones(3).to(dev))
    ref = torch.nn.Parameter(torch.ones(3))
    opt = syncfree.Adam([p], lr=0.1)
    ref_opt = torch.optim.Adam([ref], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    p.grad = torch.full((3,), 0.5).to(dev)
    ref.grad = torch.full((3,), 0.5)
    opt.step()
    ref_opt.step()
    torchacc.sync()
    torch.testing.assert_close(p.detach().cpu(), ref.detach())
    loss = opt.step(closure)
    assert loss is not None
    # a Python truth value for found_inf works too (the host already knows)
    before = p.detach().cpu().clone()
    opt.step(found_inf=1.0)
    torchacc.sync()
    assert torch.equal(p.detach().cpu(), before)


def test_skip_needs_no_host_read():
    dev = torchacc.device()
    params = [torch.nn.Parameter(torch.randn(4).to(dev)) for _ in range(2)]
    opt = syncfree.AdamW(params, lr=0.1, amsgrad=True)
    found_inf = torch.zeros((), device=dev)
    for step in range(4):
        for p in params:
            p.grad = torch.ones(4, device=dev)
        opt.step(found_inf=found_inf)
        torchacc.sync()
        if step == 1:
            start = metrics.counter_value("TransferFromDevice") or 0
    assert (metrics.counter_value("TransferFromDevice") or 0) == start


def test_state_dict_round_trip_keeps_step_on_device():
    dev = torchacc.device()
    p = torch.nn.Parameter(torch.randn(3).to(dev))
    opt = syncfree.Adam([p], lr=0.1)
    p.grad = torch.ones(3, device=dev)
    opt.step()
    torchacc.sync()
    sd = opt.state_dict()
    opt2 = syncfree.Adam([p], lr=0.1)
    opt2.load_state_dict(sd)
    assert opt2.state[p]["step"].device.type == "torchacc"
    assert float(opt2.state[p]["step"].cpu()) == 1.0
    # torch.optim.SGD state (momentum buffer without step) loads into syncfree.SGD
    ref = torch.nn.Parameter(torch.randn(3))
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    ref.grad = torch.ones(3)
    ref_opt.step()
    q = torch.nn.Parameter(ref.detach().clone().to(dev))
    sgd = syncfree.SGD([q], lr=0.1, momentum=0.9)
    # a private copy: an upload may alias host memory on the CPU platform (see report)
    sgd.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    q.grad = torch.ones(3, device=dev)
    ref.grad = torch.ones(3)
    sgd.step()
    ref_opt.step()
    torch.testing.assert_close(q.detach().cpu(), ref.detach())


def test_options_are_validated():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError):
        syncfree.SGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError):
        syncfree.Adam(p, betas=(1.5, 0.9))
    with pytest.raises(ValueError):
        syncfree.AdamW(p, fused=True)
    assert syncfree.AdamW(p).defaults["weight_decay"] == 1e-2


@pytest.mark.parametrize("cls", [syncfree.SGD, syncfree.Adam, syncfree.AdamW])
def test_host_found_inf_zero_steps_and_one_skips(cls):
    """found_inf as a Python number (the host already knows): 0.0 updates, 1.0 does not."""
    dev = torchacc.device()
    p = torch.nn.Parameter(torch.ones(3).to(dev))
    opt = cls([p], lr=0.1)
    p.grad = torch.full((3,), 0.5).to(dev)
    opt.step(found_inf=0.0)
    torchacc.sync()
    stepped = p.detach().cpu().clone()
    assert (stepped < 1.0).all(), stepped
    opt.step(found_inf=1.0)
    torchacc.sync()
    assert torch.equal(p.detach().cpu(), stepped)


# dampening with momentum keeps SGD off the fused path (Note [Fused optimizer steps])
@pytest.mark.parametrize("kw", [dict(momentum=0.5), dict(momentum=0.5, dampening=0.1)])
def test_tensor_learning_rate_matches_torch(kw):
    """A 1-element tensor lr on the device (an LR scheduler's state kept on the device) gives
    torch's update, fused or not; a multi-element one is refused as torch refuses it."""
    cls, ref_cls = syncfree.SGD, torch.optim.SGD
    dev = torchacc.device()
    p = torch.nn.Parameter(torch.ones(3).to(dev))
    ref = torch.nn.Parameter(torch.ones(3))
    opt = cls([p], lr=torch.tensor(0.25).to(dev), **kw)
    ref_opt = ref_cls([ref], lr=torch.tensor(0.25), **kw)
    for step in range(3):
        g = torch.tensor([0.5, -1.0, 2.0]) * (step + 1)
        p.grad, ref.grad = g.to(dev), g.clone()
        opt.step()
        ref_opt.step()
    torchacc.sync()
    torch.testing.assert_close(p.detach().cpu(), ref.detach())
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        cls([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor([0.1, 0.2]))


@pytest.mark.parametrize("cls", [syncfree.SGD, syncfree.Adam, syncfree.AdamW])
def test_learning_rate_zero_is_valid_and_negative_is_not(cls):
    """The boundary torch draws: lr=0 is allowed (warm-up schedules start there), lr<0 is not."""
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert cls(p, lr=0.0).defaults["lr"] == 0.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        cls(p, lr=-1e-3)


@pytest.mark.parametrize(
    "cls, ref_cls, missing",
    [
        (syncfree.AdamW, torch.optim.AdamW, ("decoupled_weight_decay", "maximize", "amsgrad")),
        (syncfree.SGD, torch.optim.SGD, ("maximize", "nesterov", "foreach", "fused")),
    ],
    ids=["AdamW", "SGD"],
)
def test_loads_a_state_dict_from_an_older_optimizer(cls, ref_cls, missing):
    """A checkpoint whose param groups predate some options (torch_xla's syncfree optimizers,
    older torch) loads, and the optimizer then keeps its own defaults for them: AdamW still
    decouples weight decay, SGD does not maximize."""
    dev = torchacc.device()
    kw = dict(lr=0.1, weight_decay=0.2)
    p = torch.nn.Parameter(torch.ones(3).to(dev))
    ref = torch.nn.Parameter(torch.ones(3))
    old = cls([torch.nn.Parameter(torch.ones(3))], **kw).state_dict()
    for group in old["param_groups"]:
        for key in missing:
            group.pop(key)
    opt = cls([p], **kw)
    opt.load_state_dict(old)
    ref_opt = ref_cls([ref], **kw)
    for step in range(2):
        g = torch.tensor([0.5, -1.0, 2.0]) * (step + 1)
        p.grad, ref.grad = g.to(dev), g.clone()
        opt.step()
        ref_opt.step()
    torchacc.sync()
    torch.testing.assert_close(p.detach().cpu(), ref.detach())
