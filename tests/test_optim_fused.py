"""Fused optimizer steps: ``torch.optim.*(fused=True)`` and the syncfree optimizers record one node
per parameter group (torchacc/lowering/optim.py, Note [Fused optimizer steps]) and match eager
PyTorch's fused CPU kernels."""

from __future__ import annotations

import io

import pytest
import torch

import torchacc
from torchacc import metrics
from torchacc.torch_xla.amp import syncfree

DEV = torchacc.device()


def _count(name):
    return metrics.counter_value(name) or 0


def _new_graphs():
    return _count("UncachedCompile") + _count("PersistentCacheHit")


def _model(seed=0, n_layers=3):
    torch.manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        layers += [torch.nn.Linear(6, 6), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(6, 2))


def _train_pair(make_opt, steps=20, schedule=True):
    """The same model trained eagerly on CPU and on torchacc; returns both and the compile count
    after step 2."""
    eager, device = _model(), _model().to(DEV)
    eopt, dopt = make_opt(eager.parameters()), make_opt(device.parameters())
    scheds = [
        torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) if schedule else None
        for o in (eopt, dopt)
    ]
    g = torch.Generator().manual_seed(1)
    new_after_warmup = None
    for step in range(steps):
        x, y = torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)
        for model, opt, sched, xx, yy in (
            (eager, eopt, scheds[0], x, y),
            (device, dopt, scheds[1], x.to(DEV), y.to(DEV)),
        ):
            loss = ((model(xx) - yy) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        torchacc.sync()
        if step == 1:
            new_after_warmup = _new_graphs()
    return eager, device, _new_graphs() - new_after_warmup


def _max_diff(a, b):
    pairs = zip(a.parameters(), b.parameters())
    return max((p.cpu() - q.cpu()).abs().max().item() for p, q in pairs)


FUSED = [
    ("adamw", lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True)),
    ("adam-l2-amsgrad", lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True,
                                                   fused=True)),
    ("adamw-maximize", lambda p: torch.optim.AdamW(p, lr=1e-2, maximize=True, fused=True)),
    ("sgd-nesterov", lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True,
                                               weight_decay=0.01, fused=True)),
    ("sgd-plain", lambda p: torch.optim.SGD(p, lr=1e-2, fused=True)),
]  # fmt: skip


@pytest.mark.parametrize("name,make", FUSED, ids=[n for n, _ in FUSED])
def test_fused_torch_optim_matches_eager_fused_kernels(name, make):
    before = metrics.executed_fallback_ops()
    eager, device, recompiles = _train_pair(make)
    # 20 steps of fp32 updates: the kernels round differently only in the last bits
    assert _max_diff(eager, device) <= 1e-6
    assert recompiles == 0  # the LR schedule is a runtime scalar
    assert metrics.executed_fallback_ops() == before  # lowered, not run on the CPU


def test_tensor_learning_rate_uses_the_tensor_lr_overload():
    make = lambda p: torch.optim.Adam(p, lr=torch.tensor(1e-2), fused=True)  # noqa: E731
    eager, device, _ = _train_pair(make, steps=5, schedule=False)
    assert _max_diff(eager, device) <= 1e-6


def _adam_lists(n, device):
    g = torch.Generator().manual_seed(3)
    make = lambda: [torch.randn(4, generator=g) for _ in range(n)]  # noqa: E731
    lists = [make(), make(), make(), [t.abs() for t in make()], []]
    steps = [torch.tensor(3.0) for _ in range(n)]
    return [[t.to(device) for t in lst] for lst in lists] + [[s.to(device) for s in steps]]


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
def test_grad_scale_and_found_inf_follow_the_eager_kernel(found_inf):
    kw = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False,
              maximize=False)  # fmt: skip
    eager = _adam_lists(3, "cpu")
    device = _adam_lists(3, DEV)
    for lists, dev in ((eager, "cpu"), (device, DEV)):
        scale = torch.tensor(4.0, device=dev)
        inf = torch.tensor(found_inf, device=dev)
        torch._fused_adamw_(*lists, **kw, grad_scale=scale, found_inf=inf)
    torchacc.sync()
    # params, grads (unscaled in place, unless skipped), moments: all as eager's kernel leaves them
    for e_list, d_list in zip(eager[:4], device[:4]):
        for e, d in zip(e_list, d_list):
            torch.testing.assert_close(d.cpu(), e, rtol=1e-6, atol=1e-7)


def test_one_recorded_node_per_group():
    """The update of a 40-parameter group is one fused node (plus the step-count add)."""
    torch.manual_seed(0)
    params = [torch.randn(3, requires_grad=True, device=DEV) for _ in range(40)]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    for p in params:
        p.grad = torch.ones(3, device=DEV)
    torchacc.sync()
    for _ in range(2):  # the first step also creates the state
        before = _count("RecordedOps")
        opt.step()
        torchacc.sync()
    assert _count("RecordedOps") - before <= 3


@pytest.mark.parametrize("cls", [syncfree.AdamW, syncfree.Adam, syncfree.SGD])
def test_syncfree_optimizers_take_the_fused_path(cls):
    torch.manual_seed(0)
    params = [torch.randn(3, requires_grad=True, device=DEV) for _ in range(40)]
    kw = {"momentum": 0.9} if cls is syncfree.SGD else {}
    opt = cls(params, lr=1e-3, **kw)
    found_inf = torch.zeros((), device=DEV)
    for p in params:
        p.grad = torch.ones(3, device=DEV)
    torchacc.sync()
    for _ in range(2):
        before = _count("RecordedOps")
        opt.step(found_inf=found_inf)
        torchacc.sync()
    # fused node + step counts (comparison, cast, batched add); O(1), not O(parameters)
    assert _count("RecordedOps") - before <= 5


def test_syncfree_state_dict_round_trip_continues_exactly():
    """Save the optimizer mid-run, load it into a fresh one: the next steps are the same."""
    model = _model().to(DEV)
    opt = syncfree.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]

    def step(m, o, b):
        loss = ((m(b[0].to(DEV)) - b[1].to(DEV)) ** 2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        torchacc.sync()

    for b in batches[:3]:
        step(model, opt, b)
    buffer = io.BytesIO()  # as a checkpoint: torch.save writes CPU tensors
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved_opt = torch.load(buffer)
    clone = _model().to(DEV)
    clone.load_state_dict(model.state_dict())
    clone_opt = syncfree.AdamW(clone.parameters(), lr=1e-2)
    clone_opt.load_state_dict(saved_opt)
    for b in batches[3:]:
        step(model, opt, b)
        step(clone, clone_opt, b)
    assert _max_diff(model, clone) == 0.0


# --- Note [Flat optimizer updates] -----------------------------------------------------------

_BIG = (130, 128)  # 16,640 elements: above the pack limit (16,384), so updated on its own
_SHAPES = [(4,), (), (3, 5), _BIG, (2, 2, 2), (7,), (1,)]


def _mixed_lists(device, n_lists, seed=5):
    """Lists of members with mixed shapes (one large) and per-member step counts that differ."""
    g = torch.Generator().manual_seed(seed)
    lists = [[torch.randn(s, generator=g) for s in _SHAPES] for _ in range(n_lists)]
    return [[t.to(device) for t in lst] for lst in lists]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("found_inf", [None, 0.0, 1.0])
def test_flat_adam_update_of_mixed_members_matches_eager_kernel(amsgrad, found_inf):
    kw = dict(lr=0.05, beta1=0.8, beta2=0.95, weight_decay=0.01, eps=1e-6, amsgrad=amsgrad,
              maximize=False)  # fmt: skip
    results = []
    for dev in ("cpu", DEV):
        p, gr, m, v, vmax = _mixed_lists(dev, 5)
        v = [t.abs() for t in v]
        vmax = [t.abs() + 1 for t in vmax] if amsgrad else []
        # every member its own count, all different (no shared scalar to fall back on)
        steps = [torch.tensor(float(k + 1), device=dev) for k in range(len(p))]
        extra = {}
        if found_inf is not None:
            extra = dict(grad_scale=torch.tensor(2.0, device=dev),
                         found_inf=torch.tensor(found_inf, device=dev))  # fmt: skip
        torch._fused_adamw_(p, gr, m, v, vmax, steps, **kw, **extra)
        torchacc.sync()
        results.append([[t.cpu() for t in lst] for lst in (p, gr, m, v, vmax)])
    for e_list, d_list in zip(*results):
        for e, d in zip(e_list, d_list):
            torch.testing.assert_close(d, e, rtol=1e-6, atol=1e-7)
    if found_inf == 1.0:  # skipped: nothing changed, bit for bit
        untouched = _mixed_lists("cpu", 5)
        for lst, before in zip(results[1][:3], untouched[:3]):
            for d, b in zip(lst, before):
                assert torch.equal(d, b)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_flat_sgd_update_of_mixed_members_matches_eager_kernel(momentum, nesterov):
    results = []
    for dev in ("cpu", DEV):
        p, gr, buf = _mixed_lists(dev, 3)
        for first in (True, False):
            torch._fused_sgd_(p, gr, buf if momentum else [], weight_decay=0.01,
                              momentum=momentum, lr=0.1, dampening=0.1, nesterov=nesterov,
                              maximize=False, is_first_step=first)  # fmt: skip
        torchacc.sync()
        results.append([t.cpu() for t in p + (buf if momentum else [])])
    # values of magnitude ~1 after two steps: the kernels may round the last bit of a sum apart
    # (fused multiply-add or not), a few 1e-7 absolute where momentum and gradient nearly cancel
    for e, d in zip(*results):
        torch.testing.assert_close(d, e, rtol=1e-6, atol=1e-6)


def _compiled_fusions(n_small, flat):
    """XLA kernels of a packed-state step's fused AdamW over ``n_small`` members, as a step
    program has it (Note [Packed state]): each list's members are pieces of one pack, the results
    go into one pack; ``flat=False`` updates member by member (the rule before the flat update,
    and the rule outside a packed program)."""
    import jax
    import jax.numpy as jnp

    from torchacc.lowering import optim
    from torchacc.program import pack

    shape, n = (5,), n_small
    size = 5

    def rule(state, *gs):  # state: params | exp_avgs | exp_avg_sqs; gradients: loose
        lists = [[pack.piece(state, (j * n + i) * size, shape) for i in range(n)] for j in range(3)]
        step = jnp.float32(3.0)  # the shared count of Note [One step count per group]
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                  maximize=False)  # fmt: skip
        if flat:
            with optim.packed_members(pack.DEFAULT_MAX_NUMEL):  # as program/build.py says
                p, _, m, v, _ = optim.fused_adamw(lists[0], gs, *lists[1:], [], [step] * n, **kw)
        else:
            outs = [optim.fused_adamw([a], [g], [b], [c], [], [step], **kw)
                    for a, g, b, c in zip(*lists[:1], gs, *lists[1:])]  # fmt: skip
            p, m, v = ([o[k][0] for o in outs] for k in (0, 2, 3))
        return pack.concat(p + m + v)

    args = (jnp.ones(3 * n * size, jnp.float32), *[jnp.ones(shape, jnp.float32)] * n)
    text = jax.jit(rule).lower(*args).compile().as_text()
    return text[text.index("ENTRY") :].count(" fusion(")


def test_small_members_of_a_pack_update_as_one_flat_array():
    """Under packed state, the kernels of a group's update do not grow with its small members:
    member by member each took kernels of its own, distinct programs for XLA to compile."""
    few, many = _compiled_fusions(4, flat=True), _compiled_fusions(40, flat=True)
    assert many == few
    assert _compiled_fusions(40, flat=False) > many + 40


@pytest.mark.parametrize("pack_limit", ["", "0"])
def test_a_packed_step_updates_its_small_parameters_flat(monkeypatch, pack_limit):
    """The program stage tells the rule which programs read packs: a packed step updates a
    group's small parameters as one flat array (one count per compile); with packing off (or in
    torchacc.dynamo's programs) each keeps its own update. The results agree either way."""
    monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", pack_limit)
    torchacc.sync()
    metrics.clear_all()
    eager, device, recompiles = _train_pair(FUSED[0][1], steps=4)
    assert _max_diff(eager, device) <= 1e-6
    flat = _count("FlatOptimizerUpdate")
    assert flat == (0 if pack_limit == "0" else _new_graphs())
