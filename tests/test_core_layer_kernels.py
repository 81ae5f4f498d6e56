"""Layer kernels (Note [Layer kernels]): batch norm, and convolution/linear with autocast's casts
folded in, as one autograd Function each -- eager numerics and running statistics, the same
program as torch's composites, double backward."""

import pytest
import torch
import torch.nn as nn

import torchacc
from torchacc.lazy import layer_kernels

DEV = torchacc.device()


def _bn_run(device, make, x, steps=2, create_graph=False, no_grad=False):
    torch.manual_seed(0)
    m = make()
    with torch.no_grad():  # non-trivial affine parameters, drawn on the CPU for both sides
        if m.weight is not None:
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.5, 0.5)
    m = m.to(device)
    outs, grads = [], []
    for step in range(steps):
        xi = (x + step).to(device).requires_grad_(not no_grad)
        if no_grad:
            with torch.no_grad():
                outs.append(m(xi).cpu())
            continue
        out = m(xi)
        loss = (out * out * out).sum()  # second derivatives reach every leaf
        leaves = [xi] + [p for p in m.parameters()]
        g = torch.autograd.grad(loss, leaves, create_graph=create_graph)
        if create_graph:
            g = torch.autograd.grad(sum((gi * gi).sum() for gi in g), leaves)
        outs.append(out.detach().cpu())
        grads.extend(gi.cpu() for gi in g)
    stats = [b.cpu() for b in m.buffers()]
    return outs, grads, stats


def _close(got, want, rel):
    """Equal up to ``rel`` of each tensor's largest magnitude: a gradient entry that cancels
    (0.007 next to entries of 100) carries float32 rounding of its summands, not its own size."""
    for a, e in zip(got, want):
        scale = max(1.0, e.abs().max().item()) if e.numel() and e.is_floating_point() else 1.0
        torch.testing.assert_close(a, e, rtol=rel, atol=rel * scale)


BN_CASES = {
    "2d-affine": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5)),
    "2d-no-affine": (lambda: nn.BatchNorm2d(3, affine=False), (4, 3, 5, 5)),
    "1d-3d-input": (lambda: nn.BatchNorm1d(3), (4, 3, 7)),
    "1d-2d-input": (lambda: nn.BatchNorm1d(6), (5, 6)),
    "cumulative-momentum": (lambda: nn.BatchNorm2d(3, momentum=None), (2, 3, 4, 4)),
    "no-running-stats": (lambda: nn.BatchNorm2d(3, track_running_stats=False), (4, 3, 5, 5)),
}


@pytest.mark.parametrize("case", list(BN_CASES))
def test_batch_norm_train_matches_eager(case):
    make, shape = BN_CASES[case]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    got, want = _bn_run(DEV, make, x), _bn_run("cpu", make, x)
    _close(sum(got, []), sum(want, []), 1e-5)


def test_batch_norm_double_backward_matches_eager():
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(4))
    got = _bn_run(DEV, BN_CASES["2d-affine"][0], x, steps=1, create_graph=True)
    want = _bn_run("cpu", BN_CASES["2d-affine"][0], x, steps=1, create_graph=True)
    _close(sum(got, []), sum(want, []), 1e-4)


def test_batch_norm_training_without_grad_updates_stats():
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(5))
    got = _bn_run(DEV, BN_CASES["2d-affine"][0], x, no_grad=True)
    want = _bn_run("cpu", BN_CASES["2d-affine"][0], x, no_grad=True)
    _close(sum(got, []), sum(want, []), 1e-5)


def test_batch_norm_is_one_node_and_one_autograd_function():
    m = nn.BatchNorm2d(3).to(DEV)
    x = torch.randn(2, 3, 4, 4).to(DEV).requires_grad_()
    version = m.running_mean._version
    out = m(x)
    node = out._st.value.node
    assert node.op.rule.name == "aten._native_batch_norm_legit_functional.default"
    # the running statistics are outputs 3 and 4 of that same node: no extra op or tensor
    assert m.running_mean._st.value.node is node and m.running_mean._st.value.index == 3
    assert m.running_var._st.value.node is node and m.running_var._st.value.index == 4
    assert m.running_mean._version > version  # an in-place update, as eager's
    # the batch counter: the same op the in-place dispatch records, and a version bump
    counter = m.num_batches_tracked
    counted = counter._st.value.node.op
    counter.add_(1)
    assert counter._st.value.node.op is counted and counter._version == 2
    assert int(counter.cpu()) == 2
    assert type(out.grad_fn).__name__ == "_BatchNormTrainBackward"
    out.sum().backward()
    assert x.grad._st.value.node.op.rule.name == "aten.native_batch_norm_backward.default"


def test_batch_norm_eval_takes_torchs_path_and_matches_eager():
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(6))

    def run(device):
        torch.manual_seed(0)
        m = nn.BatchNorm2d(3).to(device)
        m(x.to(device))  # one training step moves the stats
        m.eval()
        xi = x.to(device).requires_grad_()
        out = m(xi)
        out.sum().backward()
        return [out.detach().cpu(), xi.grad.cpu()] + [b.cpu() for b in m.buffers()]

    for a, e in zip(run(DEV), run("cpu")):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


# --- autocast: casts folded into convolution and linear -------------------------------------


def _autocast_run(device, layer, x, create_graph=False):
    torch.manual_seed(0)
    m = layer().to(device)
    xi = x.to(device).requires_grad_()
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        out = m(xi)
    loss = (out.float() ** 3).sum()
    leaves = [xi] + list(m.parameters())
    grads = torch.autograd.grad(loss, leaves, create_graph=create_graph)
    if create_graph:
        grads = torch.autograd.grad(sum((g.float() ** 2).sum() for g in grads), leaves)
    return out, [out.detach().cpu()] + [g.cpu() for g in grads]


LAYERS = {
    "conv2d": (lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 6, 6)),
    "conv2d-strided-grouped-nobias": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, bias=False),
        (2, 4, 9, 9),
    ),
    "conv1d": (lambda: nn.Conv1d(3, 5, 2), (2, 3, 8)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2), (1, 2, 4, 4, 4)),
    "linear": (lambda: nn.Linear(8, 5), (3, 8)),
    "linear-3d-nobias": (lambda: nn.Linear(8, 5, bias=False), (2, 3, 8)),
}


def _unfolded(monkeypatch):
    monkeypatch.setattr(layer_kernels, "_foldable", lambda *tensors: False)


@pytest.mark.parametrize("case", list(LAYERS))
def test_folded_casts_give_the_same_program_results(case, monkeypatch):
    layer, shape = LAYERS[case]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(7))
    out, folded = _autocast_run(DEV, layer, x)
    assert out.dtype == torch.bfloat16
    _unfolded(monkeypatch)
    _, plain = _autocast_run(DEV, layer, x)
    for a, e in zip(folded, plain):  # node for node the same math: bitwise equal
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, rtol=0, atol=0)


@pytest.mark.parametrize("case", list(LAYERS))
def test_folded_casts_match_eager_autocast(case):
    layer, shape = LAYERS[case]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(8))
    _, got = _autocast_run(DEV, layer, x)
    _, want = _autocast_run("cpu", layer, x)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        # bf16 products: XLA and torch's CPU kernels accumulate in different orders
        torch.testing.assert_close(a.float(), e.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case", ["conv2d", "linear"])
def test_folded_casts_double_backward(case):
    layer, shape = LAYERS[case]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(9))
    _, got = _autocast_run(DEV, layer, x, create_graph=True)
    _, want = _autocast_run("cpu", layer, x, create_graph=True)
    for a, e in zip(got, want):
        # second-order terms meet in bf16 in another order than torch's engine sums them: equal
        # up to bf16 rounding of the largest term
        scale = e.float().abs().max()
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("case", ["conv2d", "linear"])
def test_folded_cast_is_one_autograd_node(case):
    layer, shape = LAYERS[case]
    m = layer().to(DEV)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        out = m(torch.randn(*shape).to(DEV).requires_grad_())
    assert type(out.grad_fn).__name__.startswith("_Cast")
    # no ToCopyBackward between the layer and its parameters: the casts are graph nodes only
    leaves = [type(f).__name__ for f, _ in out.grad_fn.next_functions if f is not None]
    assert "ToCopyBackward0" not in leaves and "AccumulateGrad" in leaves


def test_folded_casts_leave_float64_alone():
    torch.manual_seed(0)
    m = nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64)
    want = m(x)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        out = m.to(DEV)(x.to(DEV))
    assert out.dtype == torch.float64  # autocast does not touch float64, folded or not
    torch.testing.assert_close(out.cpu(), want)


def _recorded_nodes(monkeypatch):
    """Every Node recorded from now on (chained in front of the known-steps observer)."""
    from torchacc.ir import graph

    nodes, observe = [], graph.observe

    def record(node):
        nodes.append(node)
        if observe is not None:
            observe(node)

    monkeypatch.setattr(graph, "observe", record)
    return nodes


def test_folded_convolution_is_one_node_each_way(monkeypatch):
    layer, shape = LAYERS["conv2d"]
    m = layer().to(DEV)
    xi = torch.randn(*shape).to(DEV).requires_grad_()
    nodes = _recorded_nodes(monkeypatch)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        out = m(xi)
    loss = out.float().sum()
    start = len(nodes)
    loss.backward()
    names = [n.op.rule.name for n in nodes]
    # the casts of input, weight and bias are inside the convolution node, forward and backward;
    # the only casts recorded are out.float() and its backward
    assert names[:2] == ["torchacc.cast_convolution.default", "aten._to_copy.default"]
    backward = names[start:]
    assert backward.count("torchacc.cast_convolution_backward.default") == 1
    assert backward.count("aten._to_copy.default") == 1, backward
    assert xi.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def test_folded_linear_backward_reuses_the_forward_casts(monkeypatch):
    layer, shape = LAYERS["linear"]
    m = layer().to(DEV)
    xi = torch.randn(*shape).to(DEV).requires_grad_()
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        out = m(xi)
    loss = out.float().sum()
    leaves = {id(xi._st.value), id(m.weight._st.value)}
    nodes = _recorded_nodes(monkeypatch)
    loss.backward()
    recast = [
        n for n in nodes if n.op.rule.name == "aten._to_copy.default" and id(n.inputs[0]) in leaves
    ]
    # the backward reads the casts of the input and weight the forward recorded
    assert recast == [] and any("backward" in n.op.rule.name for n in nodes)
    assert xi.grad.dtype == torch.float32 and m.weight.grad.dtype == torch.float32


def _bn_module_run(device, make, shape, mode=None):
    torch.manual_seed(0)
    m = make().to(device)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(11)).to(device)
    with mode if mode is not None else torch.enable_grad():
        out = m(x.requires_grad_())
    out.sum().backward()
    return [out.detach().cpu(), x.grad.cpu()] + [b.cpu() for b in m.buffers()]


def test_batch_norm_module_skips_functional_batch_norm(monkeypatch):
    import torch.nn.functional as F

    calls = []
    batch_norm = F.batch_norm
    monkeypatch.setattr(F, "batch_norm", lambda *a, **k: calls.append(1) or batch_norm(*a, **k))
    want = _bn_module_run("cpu", BN_CASES["2d-affine"][0], (4, 3, 5, 5))
    assert calls == [1]  # the CPU module goes through F.batch_norm ...
    got = _bn_module_run(DEV, BN_CASES["2d-affine"][0], (4, 3, 5, 5))
    assert calls == [1]  # ... a torchacc training step does not
    _close(got, want, 1e-5)


def test_batch_norm_module_stats_switched_off_after_construction():
    def make():
        m = nn.BatchNorm2d(3)
        m.track_running_stats = False  # buffers exist but must be neither used nor updated
        return m

    got = _bn_module_run(DEV, make, (4, 3, 5, 5))
    want = _bn_module_run("cpu", make, (4, 3, 5, 5))
    _close(got, want, 1e-5)
    assert int(got[-1]) == 0  # num_batches_tracked untouched, as eager


def test_batch_norm_module_under_a_torch_function_mode_runs_torchs_forward():
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    mode = Seen()
    got = _bn_module_run(DEV, BN_CASES["2d-affine"][0], (4, 3, 5, 5), mode)
    assert "batch_norm" in mode.names  # the mode saw the layer, as without torchacc
    want = _bn_module_run("cpu", BN_CASES["2d-affine"][0], (4, 3, 5, 5))
    _close(got, want, 1e-5)


@pytest.mark.parametrize("device", ["cpu", DEV])
def test_batch_norm_module_errors_match_torchs(device):
    m = nn.BatchNorm2d(3).to(device)
    with pytest.raises(ValueError, match=r"more than 1 value per channel.*\[1, 3, 1, 1\]"):
        m(torch.randn(1, 3, 1, 1).to(device))
    with pytest.raises(ValueError, match="expected 4D input"):
        m(torch.randn(2, 3).to(device))
    m.eps = 0.0
    with pytest.raises(ValueError, match="eps must be positive"):
        m(torch.randn(2, 3, 2, 2).to(device))


@pytest.mark.parametrize("case", ["conv2d", "conv1d", "conv3d", "linear"])
def test_layer_modules_fold_without_the_functional_call(case, monkeypatch):
    import torch.nn.functional as F

    layer, shape = LAYERS[case]
    name = "linear" if case == "linear" else case[:6]
    calls = []
    functional = getattr(F, name)
    monkeypatch.setattr(F, name, lambda *a, **k: calls.append(1) or functional(*a, **k))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(12))
    out, via_module = _autocast_run(DEV, layer, x)
    assert calls == [] and out.dtype == torch.bfloat16
    _, functional_again = _autocast_run(DEV, lambda: _FunctionalForward(layer()), x)
    for a, e in zip(via_module, functional_again):  # the same folded kernel: bitwise equal
        torch.testing.assert_close(a, e, rtol=0, atol=0)


class _FunctionalForward(nn.Module):
    """``layer`` called through its functional form (the dispatcher's autocast kernel)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        import torch.nn.functional as F

        m = self.layer
        if isinstance(m, nn.Linear):
            return F.linear(x, m.weight, m.bias)
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[m.weight.dim() - 2]
        return conv(x, m.weight, m.bias, m.stride, m.padding, m.dilation, m.groups)


def test_layer_modules_outside_autocast_or_under_a_mode_take_torchs_path():
    from torch.overrides import TorchFunctionMode

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    m = nn.Conv2d(3, 4, 3).to(DEV)
    x = torch.randn(2, 3, 5, 5).to(DEV)
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        with torch.autocast("torchacc", enabled=False):
            assert m(x).dtype == torch.float32  # autocast switched off inside
        mode = Seen()
        with mode:
            out = m(x)
    assert "conv2d" in mode.names and out.dtype == torch.bfloat16
    assert nn.Linear(3, 2)(torch.randn(1, 3)).dtype == torch.float32  # CPU: torch's own path


def _relu_chain(device, inplace, create_graph=False, view=False):
    torch.manual_seed(0)
    w = torch.randn(3, 4).to(device).requires_grad_()
    a = w * 2.0 - 0.5
    out = nn.ReLU(inplace=inplace)(a[1:] if view else a)
    loss = (out * out * w[: out.shape[0]]).sum()
    (g,) = torch.autograd.grad(loss, [w], create_graph=create_graph)
    if create_graph:
        (g,) = torch.autograd.grad((g * g).sum(), [w])
    return out, [out.detach().cpu(), g.cpu(), torch.tensor([a._version, out._version])]


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("create_graph", [False, True])
def test_relu_module_matches_eager(inplace, create_graph):
    out, got = _relu_chain(DEV, inplace, create_graph)
    assert type(out.grad_fn).__name__ == "_ReLUBackward"  # one Function, no saved-output detach
    _, want = _relu_chain("cpu", inplace, create_graph)
    for a, e in zip(got, want):  # values, gradients and version counters
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)


def test_relu_module_on_a_view_or_leaf_or_without_grad_takes_torchs_path():
    out, got = _relu_chain(DEV, True, view=True)  # in place on a view: torch's relu_
    assert type(out.grad_fn).__name__ != "_ReLUBackward"
    for a, e in zip(got, _relu_chain("cpu", True, view=True)[1]):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    for device in ("cpu", DEV):  # a leaf that needs grad: torch's error, on both devices
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            nn.ReLU(inplace=True)(torch.ones(2).to(device).requires_grad_())
    with torch.no_grad():
        x = torch.tensor([-1.0, 2.0]).to(DEV)
        assert nn.ReLU(inplace=True)(x) is x and x.cpu().tolist() == [0.0, 2.0]


@pytest.mark.parametrize("device", ["cpu", DEV])
def test_relu_output_changed_in_place_refuses_backward_as_eager(device):
    w = torch.randn(3).to(device).requires_grad_()
    out = nn.ReLU()(w * 2.0)
    loss = (out * 3.0).sum()  # a backward that needs relu's saved output
    out.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_replaced_module_forwards_still_script_and_save(tmp_path):
    # torchacc replaces these modules' forwards; TorchScript compiles torch's own (the branch
    # under `not torch.jit.is_scripting()` is skipped), so scripting, saving and loading work
    cases = [
        (nn.BatchNorm2d(3), (2, 3, 4, 4)),
        (nn.Conv2d(3, 4, 3), (1, 3, 5, 5)),
        (nn.Conv1d(2, 2, 1), (1, 2, 3)),
        (nn.Linear(2, 3), (2, 2)),
        (nn.ReLU(), (3,)),
    ]
    for m, shape in cases:
        x = torch.randn(*shape)
        scripted = torch.jit.script(m)
        torch.jit.save(scripted, tmp_path / "m.pt")
        loaded = torch.jit.load(tmp_path / "m.pt")
        for other in (scripted, loaded):
            torch.testing.assert_close(other(x), m(x), rtol=0, atol=0)
