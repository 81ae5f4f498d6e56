"""Autograd-level kernels (Note [Autograd-level kernels]): F.linear as one op each way."""

import pytest
import torch
import torch.nn.functional as F

import torchacc

DEV = torchacc.device()


def _grads(x, w, b, device, create_graph=False):
    x, w = x.to(device).requires_grad_(x.requires_grad), w.to(device).requires_grad_()
    b = None if b is None else b.to(device).requires_grad_()
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    out = F.linear(x, w, b)
    loss = out.pow(3).sum()  # its gradient depends on out: second derivatives reach every leaf
    grads = torch.autograd.grad(loss, leaves, create_graph=create_graph)
    if create_graph:  # a second derivative through the backward
        grads = torch.autograd.grad(sum((g * g).sum() for g in grads), leaves)
    return [out.detach().cpu()] + [g.cpu() for g in grads]


@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 3, 5), (2, 2, 3, 5)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("input_grad", [True, False])
def test_linear_matches_eager(shape, bias, input_grad):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g).requires_grad_(input_grad)
    w = torch.randn(4, 5, generator=g)
    b = torch.randn(4, generator=g) if bias else None
    for got, want in zip(_grads(x, w, b, DEV), _grads(x, w, b, "cpu")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_double_backward_matches_eager():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, generator=g).requires_grad_()
    w, b = torch.randn(4, 5, generator=g), torch.randn(4, generator=g)
    got = _grads(x, w, b, DEV, create_graph=True)
    want = _grads(x, w, b, "cpu", create_graph=True)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_linear_records_one_op_each_way():
    layer = torch.nn.Linear(5, 4).to(DEV)
    x = torch.randn(2, 3, 5).to(DEV).requires_grad_()
    out = layer(x)
    assert out._st.value.node.op.rule.name == "torchacc.linear.default"
    out.sum().backward()
    for grad in (x.grad, layer.weight.grad, layer.bias.grad):
        assert grad._st.value.node.op.rule.name == "torchacc.linear_backward.default"
    with torch.no_grad():
        assert layer(x).grad_fn is None


def test_linear_bf16_autocast_matches_eager():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(4)

    def run(device):
        wd = w.to(device).requires_grad_()
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            out = F.linear(x.to(device), wd, b.to(device))
        out.float().sum().backward()
        return out.cpu(), wd.grad.cpu()

    (out, gw), (eout, egw) = run(DEV), run("cpu")
    assert out.dtype == eout.dtype == torch.bfloat16 and gw.dtype == torch.float32
    torch.testing.assert_close(out, eout, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gw, egw, rtol=1e-2, atol=1e-2)


def test_linear_bad_input_names_the_problem():
    x, w = torch.randn(3, 5).to(DEV), torch.randn(4, 6).to(DEV)
    with pytest.raises(RuntimeError, match="torchacc.linear"):
        F.linear(x, w)
    with pytest.raises(RuntimeError, match="torchacc.linear"):
        F.linear(x, torch.randn(4, 5, dtype=torch.float64).to(DEV))


def test_function_transforms_through_torchacc_layers_match_cpu():
    # torchacc's autograd Functions skip Function.apply's Python preamble except under a functorch
    # transform (record.direct_apply): torch.func.grad must still see them
    torch.manual_seed(0)
    w, x = torch.randn(3, 4), torch.randn(2, 4)

    def loss(w, x):
        return (torch.nn.functional.linear(x, w) ** 2).sum()

    want = torch.func.grad(loss)(w, x)
    got = torch.func.grad(loss)(w.to(torchacc.device()), x.to(torchacc.device()))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
