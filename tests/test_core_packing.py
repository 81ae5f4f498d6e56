"""Packed state (Note [Packed state] in torchacc/program/pack.py): a step's small state comes back
as one array per dtype, with the same results, the same number of compiles and donation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from compile_counts import new_graphs

import torchacc
from torchacc import metrics
from torchacc import program as compiler
from torchacc.engine import execute
from torchacc.program import pack
from torchacc.program.pack import buffer_of

DEV = torchacc.device()


class Net(torch.nn.Module):
    """Conv + BatchNorm (running statistics, an int64 counter) + a linear head with a bias."""

    def __init__(self):
        super().__init__()
        # no bias before BatchNorm (as in ResNet): its gradient is rounding noise, which AdamW
        # would scale up to full steps
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).flatten(1))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 5, (4,), generator=g)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
}


def _train(device, optimizer, steps, keep_every=0, state=None):
    """Train ``steps`` steps; returns (losses, parameters, buffers, optimizer state dict)."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    if state is not None:  # resume: state dicts saved on the CPU, loaded onto ``device``
        model.load_state_dict(copy.deepcopy(state[0]))
        opt.load_state_dict(copy.deepcopy(state[1]))  # (torch's load keeps CPU tensors)
    losses, kept = [], []
    for s in range(steps):
        x, y = (t.to(device) for t in _batch(s))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if keep_every and s % keep_every == 0:
            kept.append(model.head.bias * 2)  # one more result in some steps only
        if device != "cpu":
            torchacc.sync()
        losses.append(loss.detach())
    cpu = lambda ts: [t.detach().cpu() for t in ts]  # noqa: E731
    return cpu(losses), cpu(model.parameters()), cpu(model.buffers()), opt.state_dict(), model


def _step(model, opt, s, device=DEV):
    """One training step on batch ``s`` (no sync)."""
    x, y = (t.to(device) for t in _batch(s))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _compare(got, want):
    """torchacc vs eager CPU: the step's float math differs by rounding (fused XLA kernels),
    ~1e-7 relative per step; a wrong piece (another tensor's data, an offset off by one)
    differs by O(1)."""
    for a, b in zip(got[0] + got[1] + got[2], want[0] + want[1] + want[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _counted(run):
    """``run()`` and the number of programs it built, none of them in memory before."""
    torchacc.sync()
    compiler.clear_memory_cache()
    metrics.clear_all()
    out = run()
    return out, new_graphs()


@pytest.mark.parametrize("keep_every", [0, 3], ids=["plain", "keep-every-3"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_packed_training_matches_eager_and_compiles_as_without_packing(
    monkeypatch, optimizer, keep_every
):
    """Same results as eager, and as many programs as with packing off: the first step (state
    uploaded), the step where optimizer state appears and steps that return one more tensor
    all reuse programs as they would without packing."""
    want = _train("cpu", optimizer, 7, keep_every)
    counts = {}
    for setting in ("0", ""):
        monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", setting)
        got, counts[setting] = _counted(lambda: _train(DEV, optimizer, 7, keep_every))
        _compare(got, want)
        model = got[4]
        n_buffers = {id(buffer_of(p._st.value)) for p in model.parameters()}
        assert len(n_buffers) == (5 if setting == "0" else 1)  # one float32 pack
        assert isinstance(model.bn.num_batches_tracked._st.value.buf, tuple) == (setting == "")
    assert counts["0"] == counts[""]


def test_fewer_results_per_step():
    """The point of packing: a known step's program returns one array per dtype of state plus
    what the step created (the loss, gradients set to None), not one per tensor."""
    torchacc.sync()
    model = Net().to(DEV)
    opt = torch.optim.AdamW(model.parameters())
    for s in range(3):
        x, y = (t.to(DEV) for t in _batch(s))
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        torchacc.sync()
        grads = [p.grad for p in model.parameters()]
        opt.zero_grad()
    # 5 parameters x (param, exp_avg, exp_avg_sq, step) + 2 running statistics: a float32 state
    # pack; num_batches_tracked: an int64 one; the 5 gradients and the loss (held here): a
    # float32 pack of what the step created
    assert len(execute._last_outputs) == 3, len(execute._last_outputs)
    created = {id(buffer_of(t._st.value)) for t in [loss, *grads]}
    assert len(created) == 1 and not (created & {id(a) for a in execute._last_outputs[:2]})


def test_resume_from_cpu_state_dicts_compiles_one_program(monkeypatch):
    """A resumed run uploads its state (loose arrays): its first step gathers them into the
    steady step's layout, so the whole resumed loop is one program, as without packing."""
    state = _train("cpu", "adamw", 2)
    cpu_state = (state[4].state_dict(), state[3])
    want = _train("cpu", "adamw", 3, state=cpu_state)
    for setting in ("0", ""):
        monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", setting)
        got, built = _counted(lambda: _train(DEV, "adamw", 3, state=cpu_state))
        _compare(got, want)
        assert built == 1, setting


def test_reading_pieces_keeps_the_program_and_the_values():
    """Reading state between steps (a state dict, logging a parameter) slices pieces out of
    their pack: right values, and the next step is the same program."""
    torchacc.sync()
    model = Net().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = Net()
    ref.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(5):
        if s == 3:
            metrics.clear_all()
        for m, o, d in ((model, opt, DEV), (ref, ref_opt, "cpu")):
            _step(m, o, s, d)
        torchacc.sync()
        assert isinstance(model.head.bias._st.value.buf, tuple) or s == 0
        for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=k)
    assert new_graphs() == 0 and metrics.counter_value("CachedCompile") == 2


def test_a_frozen_piece_keeps_its_pack():
    """A parameter that stops being updated stays a piece of its old pack, which is then not
    donated: its value survives the later steps."""
    torchacc.sync()
    model = Net().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(4):
        if s == 2:
            model.head.bias.requires_grad_(False)
            frozen = model.head.bias.detach().cpu()
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        _step(model, opt, s)
        torchacc.sync(wait=True)
    assert buffer_of(model.head.bias._st.value) is not None
    torch.testing.assert_close(model.head.bias.detach().cpu(), frozen, rtol=0, atol=0)


def test_large_results_stay_loose(monkeypatch):
    monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", "5")
    torchacc.sync()
    model = Net().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(2):
        _step(model, opt, s)
        torchacc.sync()
    pieces = {n: isinstance(p._st.value.buf, tuple) for n, p in model.named_parameters()}
    assert pieces == {
        "conv.weight": False,  # 108 elements
        "bn.weight": True,  # 4
        "bn.bias": True,
        "head.weight": False,  # 320
        "head.bias": True,  # 5: the limit is inclusive
    }


@pytest.mark.parametrize("text", ["many", "1.5"])
def test_a_bad_setting_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", text)
    with pytest.raises(ValueError, match="TORCHACC_PACK_MAX_NUMEL.*whole number"):
        pack.max_numel()


def test_a_step_reading_the_previous_steps_loss(monkeypatch):
    """A result the step created (the loss) that the next step reads in its graph is sliced out
    of its pack and passed loose: right values, the same programs as without packing, and its
    Value stays readable afterwards."""

    def loop(device):
        torch.manual_seed(0)
        model = Net().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        prev, smooth, seen = None, torch.zeros(()).to(device), []
        for s in range(6):
            x, y = (t.to(device) for t in _batch(s))
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if prev is not None:
                smooth.mul_(0.9).add_(prev.detach(), alpha=0.1)  # last step's loss
            prev = loss
            if device != "cpu":
                torchacc.sync()
            seen.append(prev)
        return [smooth.cpu()] + [t.detach().cpu() for t in seen]

    want = loop("cpu")
    built = {}
    for setting in ("0", ""):
        monkeypatch.setenv("TORCHACC_PACK_MAX_NUMEL", setting)
        got, built[setting] = _counted(lambda: loop(DEV))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert built["0"] == built[""]


def test_reading_many_pieces_copies_each_pack_once():
    """A state dict read copies each pack to the host once and slices it there (not one device
    slice and transfer per tensor); a piece read on the device (``Value.array``) is the same
    data; the next step's new packs are read afresh."""
    torchacc.sync()
    model = Net().to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(3):
        _step(model, opt, s)
        torchacc.sync()
        values = [p._st.value for p in model.parameters()]
        packs = {id(v.buf[0]): v.buf[0] for v in values}
        assert len(packs) == 1 and next(iter(packs.values())).host is None
        metrics.clear_all()
        host = [p.detach().cpu() for p in model.parameters()]
        assert metrics.counter_value("TransferFromDevice") == len(values)
        assert next(iter(packs.values())).host is not None
        for v, h in zip(values, host):
            torch.testing.assert_close(torch.from_numpy(np.asarray(v.array)), h, rtol=0, atol=0)
