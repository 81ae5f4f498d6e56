"""Eager semantics of mutation and aliasing: each case runs on CPU and on torchacc, and every
tensor the case touched must match afterwards (outputs and the mutated inputs)."""

import pytest
import torch

import torchacc


def _setitem_col(x, y):
    x[:, 0] = y[:, 1]
    return x


def _view_add(x, y):
    x.view(-1).add_(1)
    return x


def _transpose_write(x, y):
    x.t()[1].mul_(3)
    return x


def _chain_of_views(x, y):
    v = x[1:].transpose(0, 1)
    v[0].fill_(-2)
    return x, v


def _slice_step(x, y):
    x[::2, 1:3] += y[::2, :2]
    return x


def _select_neg(x, y):
    x[-1] = 5
    return x


def _copy_broadcast(x, y):
    x.copy_(y[0])
    return x


def _diag_write(x, y):
    x.diagonal().zero_()
    return x


def _unbind_write(x, y):
    a, b, c = x.unbind(0)
    b.add_(10)
    return x, a


def _split_write(x, y):
    parts = x.split(2, dim=1)
    parts[1].mul_(0)
    return x


def _split_default_dim(x, y):
    parts = x.split(1)  # dim 0 when not given
    parts[2].mul_(-1)
    x.add_(1)  # every part sees the base's write
    return x, parts[0].clone(), parts[1].clone(), parts[2].clone()


def _split_sizes_and_chunk_default_dim(x, y):
    a, b = x.split([1, 2])
    c, d = y.chunk(2)
    b[1].fill_(7)
    d.mul_(2)
    y.sub_(1)
    return x, y, a.clone(), c.clone(), d.clone()


def _empty_views_at_an_offset(x, y):
    e = x[0:0, 1:2]  # no elements, storage offset 1, row stride 4
    x[0:0, 1:3].add_(1)  # writes nothing
    return e + 1, torch.cat([x[2:2, 1:], y[1:, 1:]]), e.sum(), x


def _as_strided_write(x, y):
    v = x.as_strided((2, 2), (4, 1), 1)
    v.add_(100)
    return x


def _expand_read_after_write(x, y):
    e = x[0].expand(3, 4)
    x.add_(1)
    return e.clone()


def _view_sees_base_write(x, y):
    v = x[:, 1]
    x.mul_(2)
    return v.clone(), x


def _data_assign(x, y):
    x.data = y.clone()
    x.add_(1)
    return x


def _inplace_dtype(x, y):
    x.add_(y.double())
    return x


def _detach_shares(x, y):
    d = x.detach()
    d.sub_(1)
    return x


def _squeeze_unsqueeze(x, y):
    x.unsqueeze(0).squeeze(0)[2].fill_(9)
    return x


def _permute_write(x, y):
    z = x.view(3, 2, 2).permute(2, 0, 1)
    z[1] = 0
    return x


def _index_put(x, y):
    x[torch.tensor([0, 2]), torch.tensor([1, 3])] = torch.tensor([7.0, 8.0])
    return x


def _masked_fill_(x, y):
    x.masked_fill_(y > 0, 0.5)
    return x


def _out_arg(x, y):
    torch.add(x, y, out=x)
    return x


def _clamp_view(x, y):
    x[1:].clamp_(min=0)
    return x


def _narrow_write(x, y):
    x.narrow(1, 1, 2).copy_(torch.ones(3, 2))
    return x


def _zero_grad_style(x, y):
    z = x.clone()
    z.zero_()
    return z, x


def _t_data_inplace(x, y):
    x.data.mul_(2)
    return x


def _foreach_same_tensor_twice(x, y):
    torch._foreach_add_([x, x], [y, y])  # eager: x += y twice
    return x


def _foreach_reads_a_written_tensor(x, y):
    a, b = x[0:1], y[1:2]
    torch._foreach_mul_([a, b], [b, a])  # the second element reads a after the first wrote it
    return x


def _foreach_views_of_one_base(x, y):
    torch._foreach_addcmul_(list(x.unbind(0)), list(y.unbind(0)), list(y.unbind(0)), value=0.5)
    return x


def _foreach_div_scalarlist_then_sqrt(x, y):
    torch._foreach_div_([x, y], [2.0, 4.0])
    out = torch._foreach_sqrt([x.abs(), y.abs()])
    return x, y, out[0], out[1]


CASES = [
    v
    for k, v in sorted(globals().items())
    if k.startswith("_") and callable(v) and k not in ("_run",)
]


def _run(fn, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    y = torch.randn(3, 4, generator=g)
    x, y = x.to(device), y.to(device)
    if device.type == "torchacc":
        # in-case helpers make CPU tensors (torch.tensor([...])) they go to the device too
        pass
    out = fn(x, y)
    outs = out if isinstance(out, tuple) else (out,)
    return [t.cpu() for t in outs] + [x.cpu(), y.cpu()]


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__.strip("_"))
def test_aliasing_matches_eager(fn):
    want = _run(fn, torch.device("cpu"))
    got = _run(_on_device(fn), torchacc.device())
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w)


def _on_device(fn):
    """Run ``fn`` with torch.tensor(...) literals created on the device, as a user would."""

    def wrapped(x, y):
        orig = torch.tensor

        def tensor(data, **kw):
            kw.setdefault("device", x.device)
            return orig(data, **kw)

        torch.tensor = tensor
        try:
            return fn(x, y)
        finally:
            torch.tensor = orig

    return wrapped


def test_writes_then_sync_then_views():
    dev = torchacc.device()
    x = torch.zeros(4, 4).to(dev)
    v = x[1]
    torchacc.sync()
    v.add_(1)
    torchacc.sync()
    x[2, 2] = 3
    assert v.cpu().tolist() == [1.0] * 4
    assert x.cpu()[2, 2].item() == 3
    assert x.sum().item() == 7


def test_batchnorm_running_stats_update():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm1d(3)
    dbn = torch.nn.BatchNorm1d(3).to(torchacc.device())
    x = torch.randn(5, 3)
    bn(x)
    dbn(x.to(torchacc.device()))
    torch.testing.assert_close(dbn.running_mean.cpu(), bn.running_mean)
    torch.testing.assert_close(dbn.running_var.cpu(), bn.running_var)
    assert dbn.num_batches_tracked.item() == 1


def test_foreach_records_one_batched_node():
    ts = [torch.full((2, k + 1), float(k)).to(torchacc.device()) for k in range(5)]
    torchacc.sync()
    torch._foreach_mul_(ts, 2.0)
    torch._foreach_add_(ts, ts, alpha=0.5)
    nodes = {id(t._st.value.node) for t in ts}
    assert len(nodes) == 1 and None not in {t._st.value.node for t in ts}
    for k, t in enumerate(ts):
        assert t.cpu().tolist() == [[3.0 * k] * (k + 1)] * 2


def _lists(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    shapes = [(3,), (2, 2), (4, 1), ()]
    return [[torch.randn(s, generator=g).to(dtype).to(device) for s in shapes] for _ in range(3)]


_FOREACH_CASES = {
    "copy_": lambda a, b, c: torch._foreach_copy_(a, b),
    "zero_": lambda a, b, c: torch._foreach_zero_(a),
    "maximum_": lambda a, b, c: torch._foreach_maximum_(a, b),
    "clamp_min_": lambda a, b, c: torch._foreach_clamp_min_(a, 0.1),
    "addcdiv_tensor": lambda a, b, c: torch._foreach_addcdiv_(
        a, b, [x.abs() + 1 for x in c], torch.tensor([0.5, -1.0, 2.0, 3.0])
    ),
    "add_list_alpha": lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.3),
    "lerp_list": lambda a, b, c: torch._foreach_lerp_(a, b, [x.sigmoid() for x in c]),
    "pow_scalarlist": lambda a, b, c: torch._foreach_pow_(
        [x.abs() + 0.5 for x in a], [1.0, 2.0, 0.5, 3.0]
    ),
    "norm": lambda a, b, c: torch._foreach_norm(a, 3.0),
    "pow_scalar": lambda a, b, c: torch._foreach_pow([x.abs() for x in a], 2.0),
    "pow_scalar_base": lambda a, b, c: torch._foreach_pow(2.0, a),
    "sqrt_out": lambda a, b, c: torch._foreach_sqrt([x.abs() for x in b]),
    "mul_tensor": lambda a, b, c: torch._foreach_mul_(a, c[3]),
    "sub_bf16": lambda a, b, c: torch._foreach_sub_(
        [x.to(torch.bfloat16) for x in a], [x.to(torch.bfloat16) for x in b]
    ),
}


@pytest.mark.parametrize("name", sorted(_FOREACH_CASES))
def test_foreach_ops_match_eager(name):
    """Batched foreach nodes (Note [Batched foreach nodes]) against eager, one op family each."""
    results = []
    for device in (torch.device("cpu"), torchacc.device()):
        a, b, c = _lists(device)
        out = _FOREACH_CASES[name](a, b, c)
        results.append([t.cpu() for t in (out or [])] + [t.cpu() for t in a + b + c])
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_inplace_op_maps_to_a_functional_op_with_its_arguments():
    """``x.op_(...)`` records the functional ``op`` overload taking the same arguments (names can
    differ: ``pow_.Scalar`` is ``pow.Tensor_Scalar``, not ``pow.Scalar(Scalar self, ...)``)."""
    from torchacc.lazy import mutation
    from torchacc.lowering import RULES

    checked = 0
    for packet_name in sorted({op.overloadpacket.__name__ for op in RULES}):
        inplace_packet = getattr(torch.ops.aten, packet_name + "_", None)
        if inplace_packet is None or packet_name.startswith("_foreach"):
            continue
        for ov in inplace_packet.overloads():
            op = getattr(inplace_packet, ov)
            functional, mode = mutation.functional_variant(op)
            if functional is None or mode != "inplace":
                continue
            want = [(a.name, str(a.type)) for a in op._schema.arguments]
            got = [(a.name, str(a.type)) for a in functional._schema.arguments]
            assert got == want, (op, functional)
            checked += 1
    assert checked > 100


@pytest.mark.parametrize(
    "call",
    [
        lambda x: x.pow_(2.0),
        lambda x: x.pow_(x),
        lambda x: x.abs_().pow_(0.5),
        lambda x: x.div_(2, rounding_mode="floor"),
        lambda x: x.clamp_(min=torch.zeros(()).to(x.device)),
        lambda x: x.fmod_(0.7),
        lambda x: x.lerp_(x * 2, 0.25),
    ],
)
def test_inplace_ops_match_eager(call):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, generator=g)
    want = call(x.clone())
    got = call(x.clone().to(torchacc.device())).cpu()
    torch.testing.assert_close(got, want, equal_nan=True)
