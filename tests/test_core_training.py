"""Training parity: tiny models train on the torchacc device exactly like eager CPU PyTorch."""

import copy

import pytest
import torch
import torch.nn.functional as F
from compile_counts import new_graphs
from models import CNN, MLP, TinyGPT

import torchacc
from torchacc import metrics


def _data(kind, step):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    if kind == "cnn":
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (16,), generator=g)


def _make(kind):
    if kind == "mlp":
        return MLP()
    if kind == "cnn":
        return CNN()
    return TinyGPT(sdpa=(kind == "gpt_sdpa"))


def _train(model, device, kind, steps=5):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses, compiles = [], []
    for step in range(steps):
        x, y = _data(kind, step)
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if device.type == "torchacc":
            torchacc.sync()
            compiles.append(new_graphs())
        losses.append(loss)
    return [float(v.item()) for v in losses], compiles


@pytest.mark.parametrize("kind", ["mlp", "cnn", "gpt", "gpt_sdpa"])
def test_train_matches_eager(kind):
    torch.manual_seed(0)
    ref = _make(kind)
    model = copy.deepcopy(ref).to(torchacc.device())
    metrics.clear_all()
    got, compiles = _train(model, torchacc.device(), kind)
    want, _ = _train(ref, torch.device("cpu"), kind)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-4, atol=1e-5, msg=name)
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b.cpu(), c, rtol=1e-4, atol=1e-5, msg=name)
    assert compiles[-1] == compiles[1], f"recompiled after step 2: {compiles}"
    assert metrics.executed_fallback_ops() == []


def test_tied_weights_stay_tied_and_optimizer_survives_to():
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    ref[1].weight = ref[0].weight
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # built before .to(), as users do
    model.to(torchacc.device())
    assert model[0].weight is model[1].weight
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    idx = torch.tensor([[1, 2, 3]])
    for m, o, dev in ((model, opt, torchacc.device()), (ref, ropt, torch.device("cpu"))):
        m(idx.to(dev)).sum().backward()
        o.step()
    torch.testing.assert_close(model[0].weight.cpu(), ref[0].weight.detach())


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=0.01),
        lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    ],
    ids=["sgd", "adam_amsgrad", "adamw", "rmsprop"],
)
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizers_foreach_and_loop_match_eager(make_opt, foreach):
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref).to(torchacc.device())
    ropt, opt = make_opt(ref.parameters()), make_opt(model.parameters())
    for group in opt.param_groups:
        group["foreach"] = foreach
    for step in range(3):
        x, y = _data("mlp", step)
        for m, o, dev in ((model, opt, torchacc.device()), (ref, ropt, torch.device("cpu"))):
            F.cross_entropy(m(x.to(dev)), y.to(dev)).backward()
            o.step()
            o.zero_grad()
        torchacc.sync()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-4, atol=1e-5)
