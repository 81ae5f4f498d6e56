"""Traced regions (torchacc/lazy/region.py): torch's ``while_loop`` / torch_xla's ``fori_loop`` as
one ``lax.while_loop`` node, ``assume_pure`` as one ``call_graph`` node, and the scan-based GRU
with the fused GRU cell torch's own ``nn.GRU`` calls on the device; results against eager CPU.
"""

import copy
import sys

import pytest
import torch
import torch.nn as nn
from compile_counts import new_graphs

import torchacc
from torchacc import metrics
from torchacc.lazy.record import value_of
from torchacc.program.key import _collect
from torchacc.torch_xla.experimental import assume_pure as ap
from torchacc.torch_xla.experimental import fori_loop as fl
from torchacc.torch_xla.experimental.gru import GRU

DEV = torch.device("torchacc")
# after fori_loop's import, torch's while_loop takes torchacc tensors
torch_while_loop = sys.modules["torch._higher_order_ops.while_loop"].while_loop


def _pending_ops(tensors):
    order, _ = _collect([value_of(t) for t in tensors])
    return [n.op.rule.name for n in order]


def test_while_loop_with_closure_matches_python_loop_and_reuses_its_program():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    scale = torch.rand(4)
    x = torch.randn(3, 4)
    lin_d, scale_d = copy.deepcopy(lin).to(DEV), scale.to(DEV)

    def body(i, h, total):  # reads a module's weights and a captured tensor
        h = torch.tanh(lin_d(h)) * scale_d
        return i - 1, h, total + h.sum().to(total.dtype)

    with torch.no_grad():
        ref_h, ref_total = x, torch.tensor(0.0, dtype=torch.float64)
        for _ in range(5):
            ref_h = torch.tanh(lin(ref_h)) * scale
            ref_total = ref_total + ref_h.sum().double()
        metrics.clear_all()
        for _ in range(2):
            zero = torch.zeros((), dtype=torch.float64, device=DEV)
            init = (torch.tensor(5, device=DEV), x.to(DEV), zero)
            i, h, total = torch_while_loop(lambda i, h, t: i > 0, body, init)
            assert _pending_ops([h]).count("torchacc.while_loop.default") == 1
            torchacc.sync()
            assert int(i.cpu()) == 0
            torch.testing.assert_close(h.cpu(), ref_h, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(total.cpu(), ref_total, atol=1e-5, rtol=1e-6)
            assert new_graphs() == 1  # the second step reuses the first one's program
        # torch_xla's kernel: additional inputs after the carried ones, in both functions
        i2, h2 = fl.while_loop(
            lambda i, h, w: i > 0,
            lambda i, h, w: (i - 1, h * w),
            (torch.tensor(2, device=DEV), x.to(DEV)),
            (scale_d,),
        )
        torchacc.sync()
        torch.testing.assert_close(h2.cpu(), x * scale * scale)
        # fori_loop: torch_xla's layout [spent counter, *values]
        out = fl.fori_loop(0, 3, lambda v: v * 2, torch.ones(2, device=DEV))
        torchacc.sync()
        assert int(out[0].cpu()) == 0 and out[1].cpu().tolist() == [8.0, 8.0]
        # on CPU tensors it is torch's own while_loop
        cpu = torch_while_loop(lambda i: i < 3, lambda i: (i + 1,), (torch.tensor(0),))
        assert int(cpu[0]) == 3


def test_while_loop_bad_input_errors_name_the_problem():
    i, x = torch.tensor(2, device=DEV), torch.ones(2, device=DEV)
    with torch.no_grad():
        with pytest.raises(ValueError, match="changed carried input 1 from shape"):
            fl.while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x.sum()), (i, x))
        with pytest.raises(ValueError, match="one bool scalar"):
            fl.while_loop(lambda i, x: x > 0, lambda i, x: (i - 1, x), (i, x))
        with pytest.raises(ValueError, match="carried input 1 is a int"):
            fl.while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x), (i, 3))
        with pytest.raises(ValueError, match="cpu tensor"):
            fl.while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x), (i, torch.ones(2)))
    w = torch.ones(2, device=DEV, requires_grad=True)
    with pytest.raises(NotImplementedError, match="no backward"):
        fl.while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x * w), (i, x))


def test_assume_pure_traces_once_reads_closures_live_and_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))
    model_d = copy.deepcopy(model).to(DEV)
    bias = torch.randn(3)
    bias_d = bias.to(DEV)
    calls = []

    def f(params, x, k):  # params passed in; bias_d read from the closure; k a Python value
        calls.append(1)
        y = torch.func.functional_call(model_d, params, (x,))
        y = y.clone()
        y += bias_d  # in-place on its own tensor: functionalized
        return {"y": y * k, "k": k}

    pure = ap.assume_pure_torch(f, use_cache=True)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 6)
            out = pure(dict(model_d.named_parameters()), x.to(DEV), 2.0)
            assert out["k"] == 2.0
            assert _pending_ops([out["y"]]).count("torchacc.call_graph.default") == 1
            torchacc.sync()
            torch.testing.assert_close(out["y"].cpu(), (model(x) + bias) * 2.0)
            bias.add_(1.0)  # the closure is read live, not baked into the graph
            bias_d.add_(1.0)
        assert len(calls) == 1
        pure(dict(model_d.named_parameters()), torch.randn(2, 6, device=DEV), 2.0)
        assert len(calls) == 2  # a new input shape traces again
        with pytest.raises(ValueError, match="writes into a tensor the function closes over"):
            ap.assume_pure_torch(lambda a: bias_d.add_(a))(torch.ones(3, device=DEV))
        with pytest.raises(NotImplementedError, match="random op"):
            ap.assume_pure_torch(lambda a: a + torch.rand_like(a))(torch.ones(3, device=DEV))


def test_assume_pure_backward_matches_eager():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    lin_d = copy.deepcopy(lin).to(DEV)
    x = torch.randn(4, 5, requires_grad=True)
    scale = torch.randn(3)
    scale_d = scale.to(DEV)

    calls = []

    def f(params, x):  # two outputs, one of them not differentiable
        calls.append(x.device.type)
        y = torch.func.functional_call(lin_d if x.device.type != "cpu" else lin, params, (x,))
        return torch.tanh(y) * (scale_d if x.device.type != "cpu" else scale), x.argmax(-1)

    ref, idx = f(dict(lin.named_parameters()), x)
    (ref.sum() * 3).backward()
    pure = ap.assume_pure(f)
    for _ in range(2):  # the second call reuses both traces
        xd = x.detach().to(DEV).requires_grad_()
        for p in lin_d.parameters():
            p.grad = None
        out, idx_d = pure(dict(lin_d.named_parameters()), xd)
        (out.sum() * 3).backward()
        torchacc.sync()
        torch.testing.assert_close(out.cpu(), ref.detach())
        assert idx_d.cpu().tolist() == idx.tolist()
        torch.testing.assert_close(xd.grad.cpu(), x.grad)
        for (name, p), q in zip(lin.named_parameters(), lin_d.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name)
    assert calls.count("torchacc") == 1  # traced once; the backward from the forward graph
    w = torch.ones(3, device=DEV, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad without taking it as an argument"):
        ap.assume_pure(lambda a: a * w)(torch.ones(3, device=DEV, requires_grad=True))


@pytest.mark.parametrize("bias,batch_first", [(True, False), (False, True)])
def test_gru_scan_and_torch_gru_on_device_match_eager(bias, batch_first):
    torch.manual_seed(0)
    ref = nn.GRU(5, 7, num_layers=2, bias=bias, batch_first=batch_first)
    scan_gru = GRU(5, 7, num_layers=2, bias=bias, batch_first=batch_first)
    scan_gru.load_state_dict(ref.state_dict())  # torchacc swaps parameters on load
    x = torch.randn(3, 6, 5) if batch_first else torch.randn(6, 3, 5)
    h = torch.randn(2, 3, 7)
    xr, hr = x.clone().requires_grad_(), h.clone().requires_grad_()
    out, hn = ref(xr, hr)
    (out.sum() + hn.sum()).backward()
    # torch's own GRU on the device: its fused GRU cell forward and backward, and (batch_first)
    # the in-place transpose of its output
    for m in (scan_gru.to(DEV), copy.deepcopy(ref).to(DEV)):
        xd, hd = x.to(DEV).requires_grad_(), h.to(DEV).requires_grad_()
        od, hnd = m(xd, hd)
        (od.sum() + hnd.sum()).backward()
        torchacc.sync()
        for a, b in ((od, out), (hnd, hn), (xd.grad, xr.grad), (hd.grad, hr.grad)):
            torch.testing.assert_close(a.cpu(), b.detach(), atol=1e-5, rtol=1e-5)
        for (name, p), q in zip(ref.named_parameters(), m.parameters()):
            torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert type(GRU(5, 7, bidirectional=True)) is torch.nn.modules.rnn.GRU


def test_inplace_view_ops_change_the_tensor_like_eager():
    a = torch.arange(6.0).reshape(2, 3)
    t = a.to(DEV)
    row = t[0]  # a view taken before: it still sees writes through the transposed tensor
    t.transpose_(0, 1)
    a.transpose_(0, 1)
    assert t.shape == a.shape and t.stride() == a.stride()
    t.mul_(2)
    a.mul_(2)
    u = torch.ones(3, 1, device=DEV).squeeze_(1).unsqueeze_(0)
    torchacc.sync()
    torch.testing.assert_close(t.cpu(), a)
    torch.testing.assert_close(row.cpu(), a.t()[0])
    assert u.shape == (1, 3)


def test_gradient_accumulation_matches_eager_accumulation_in_one_loop():
    from torchacc.torch_xla.experimental.gradient_accumulation import gradient_accumulation

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)  # frozen: no gradient, left alone
    model_d = copy.deepcopy(model).to(DEV)
    x, y = torch.randn(3, 5, 4), torch.randn(3, 5, 2)

    def step(m, xb, yb, count):
        loss = nn.functional.mse_loss(m(xb), yb)
        return loss, count + 1

    ref_loss, count = 0.0, torch.tensor(0)
    for k in range(3):
        loss, count = step(model, x[k], y[k], count)
        (loss / 3).backward()
        ref_loss += float(loss) / 3
    metrics.clear_all()
    for _ in range(2):
        loss_d, count_d = gradient_accumulation(
            lambda xb, yb, c: step(model_d, xb, yb, c),
            (x.to(DEV), y.to(DEV)),
            model_d,
            torch.tensor(0, device=DEV),
        )
        assert _pending_ops([loss_d]).count("torchacc.while_loop.default") == 1
        torchacc.sync()
        assert int(count_d.cpu()) == 3
        torch.testing.assert_close(float(loss_d.cpu()), ref_loss, atol=1e-6, rtol=1e-5)
    assert new_graphs() == 2  # the loop's program, then the one that also adds into .grad
    for (name, p), q in zip(model.named_parameters(), model_d.parameters()):
        if p.grad is None:
            assert q.grad is None, name
        else:  # two accumulations
            torch.testing.assert_close(q.grad.cpu(), 2 * p.grad, atol=1e-6, rtol=1e-5, msg=name)

    def noisy(xb, yb, t):  # a random op: a fresh key per iteration
        return nn.functional.mse_loss(model_d(xb), yb), torch.rand_like(t) - t

    with pytest.raises(AssertionError, match="writes in place into its input"):
        gradient_accumulation(
            lambda xb, yb, c: (model_d(xb).sum(), c.add_(1)),
            (x.to(DEV), y.to(DEV)),
            model_d,
            torch.tensor(0, device=DEV),
        )
    _, t = gradient_accumulation(noisy, (x.to(DEV), y.to(DEV)), model_d, torch.zeros(2, device=DEV))
    torchacc.sync()
    assert bool((t.cpu() != 0).all())
    with pytest.raises(ValueError, match="cannot be empty"):
        gradient_accumulation(noisy, (), model_d)


def test_assume_pure_may_copy_from_a_closure_into_its_own_tensor():
    src = torch.arange(3.0, device=DEV)

    def f(a):
        buf = torch.empty_like(a)
        buf.copy_(src)  # writes its own tensor, reads the closure
        return buf + a

    with torch.no_grad():
        out = ap.assume_pure_torch(f)(torch.ones(3, device=DEV))
        torchacc.sync()
    assert out.cpu().tolist() == [1.0, 2.0, 3.0]


def test_rnn_modules_load_state_dicts_under_the_swap_policy():
    # import torchacc turns on torch's swap_module_params_on_conversion; RNNs' weak references
    # to their weights blocked the swap (torchacc/nn/rnn.py)
    assert torch.__future__.get_swap_module_params_on_conversion()
    for cls in (nn.LSTM, nn.RNN, torch.nn.modules.rnn.GRU):
        src, dst = cls(3, 4, num_layers=2), cls(3, 4, num_layers=2)
        weight = dst.weight_ih_l0
        dst.load_state_dict(src.state_dict())
        assert dst.weight_ih_l0 is weight  # swapped in place: the same Parameter object
        x = torch.randn(5, 1, 3)
        torch.testing.assert_close(dst(x)[0], src(x)[0])
