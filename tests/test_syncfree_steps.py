"""One step count per parameter group (Note [One step count per group]): shared while the whole
group steps together, split exactly when it stops doing so, shared again after a state-dict round
trip -- with torch.optim's numbers throughout."""

import io

import torch
import torch.nn as nn

import torchacc
from torchacc.amp import syncfree

DEV = torchacc.device()


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head_a = nn.Linear(4, 2)
        self.head_b = nn.Linear(4, 2)

    def forward(self, x, use_b=True):
        h = torch.tanh(self.body(x))
        out = self.head_a(h)
        return out + self.head_b(h) if use_b else out


def _train(device, make_opt, uses, opt_state=None, model_state=None, start=0):
    torch.manual_seed(0)
    model = TwoHeads()
    if model_state is not None:
        model.load_state_dict(model_state)
    model = model.to(device)
    opt = make_opt(model.parameters())
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    g = torch.Generator().manual_seed(1)
    for _ in range(start):  # the batches an earlier run consumed
        torch.randn(3, 4, generator=g)
    for use_b in uses:
        x = torch.randn(3, 4, generator=g).to(device)
        opt.zero_grad(set_to_none=True)
        model(x, use_b).pow(2).sum().backward()
        opt.step()
        if device != "cpu":
            torchacc.sync()
    return model, opt


def _steps(model, opt):
    return [float(opt.state[p]["step"]) for p in model.parameters() if p in opt.state]


def _assert_same(got, want):
    (gm, go), (wm, wo) = got, want
    for a, e in zip(gm.parameters(), wm.parameters()):
        # Adam divides by sqrt(v): float32 rounding of XLA vs torch's CPU kernels grows to ~1e-5
        torch.testing.assert_close(a.detach().cpu(), e.detach(), rtol=1e-4, atol=3e-5)
    assert _steps(gm, go) == _steps(wm, wo)


def test_a_group_stepping_together_shares_one_count():
    model, opt = _train(DEV, lambda p: syncfree.AdamW(p, lr=0.1), [True] * 3)
    counts = {id(opt.state[p]["step"]) for p in model.parameters()}
    assert len(counts) == 1
    _assert_same((model, opt), _train("cpu", lambda p: torch.optim.AdamW(p, lr=0.1), [True] * 3))


def test_counts_split_when_a_parameter_misses_a_step():
    uses = [True, False, True, False, True]  # head_b has no gradient on steps 2 and 4
    got = _train(DEV, lambda p: syncfree.AdamW(p, lr=0.1), uses)
    want = _train("cpu", lambda p: torch.optim.AdamW(p, lr=0.1), uses)
    _assert_same(got, want)
    assert _steps(*got) == [5.0, 5.0, 5.0, 5.0, 3.0, 3.0]


def test_state_dict_round_trip_shares_again_and_continues_like_torch():
    first, rest = [True] * 2, [True] * 2
    model, opt = _train(DEV, lambda p: syncfree.AdamW(p, lr=0.1), first)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _train(
        DEV, lambda p: syncfree.AdamW(p, lr=0.1), rest, saved["opt"], saved["model"], len(first)
    )
    assert len({id(resumed[1].state[p]["step"]) for p in resumed[0].parameters()}) == 1
    _assert_same(resumed, _train("cpu", lambda p: torch.optim.AdamW(p, lr=0.1), first + rest))


def test_a_skipped_step_does_not_advance_the_shared_count():
    torch.manual_seed(0)
    model = TwoHeads().to(DEV)
    opt = syncfree.AdamW(model.parameters(), lr=0.1)
    for inf in (0.0, 1.0, 0.0):
        model(torch.ones(2, 4).to(DEV)).sum().backward()
        opt.step(found_inf=torch.tensor(inf).to(DEV))
        opt.zero_grad(set_to_none=True)
    assert _steps(model, opt) == [2.0] * 6
