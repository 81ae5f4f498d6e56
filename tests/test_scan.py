"""scan / scan_layers (torch_xla.experimental): one lax.scan each way, eager-exact results.

Every result is compared with the same computation run eagerly on the CPU (scan's plain-loop
reference there, ``nn.Sequential`` for scan_layers); the recorded graph is checked to hold one
``torchacc.scan`` node forward and one backward whatever the depth, and repeated steps compile
nothing new.
"""

import copy

import pytest
import torch
import torch.nn as nn
from compile_counts import new_graphs
from models import Attention

import torchacc
from torchacc import metrics
from torchacc.lazy.record import value_of
from torchacc.program.key import _collect
from torchacc.torch_xla.experimental.scan import scan
from torchacc.torch_xla.experimental.scan_layers import scan_layers

DEV = torch.device("torchacc")


def _to(tree, device):
    return torch.utils._pytree.tree_map(
        lambda t: t.detach().to(device).requires_grad_(t.requires_grad), tree
    )


def _close(a, b, tol=1e-5):
    """Equal to ``tol`` relative to the reference's largest magnitude (float32 sums reassociate)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    scale = max(1.0, float(b.detach().abs().max())) if b.is_floating_point() else 0.0
    torch.testing.assert_close(a.detach().cpu(), b.detach(), atol=tol * scale, rtol=tol)


def _pending_ops(tensors):
    """Names of the pending nodes that compute ``tensors`` (before the sync runs them)."""
    order, _ = _collect([value_of(t) for t in tensors])
    return [n.op.rule.name for n in order]


class Block(nn.Module):
    """A pre-LN transformer block (attention + MLP) with a buffer it reads."""

    def __init__(self, d=16, heads=2, sdpa=False):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads, sdpa)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x)) * self.scale


def _fn(carry, x):
    # a pytree carry (tuple) and xs (dict), no_grad inside, ys a tuple with an integer leaf
    h, acc = carry
    h = torch.tanh(h @ x["w"] + x["b"])
    with torch.no_grad():
        count = (h > 0).sum(-1)
    return (h, acc + h.sum(-1)), (h * 2, count)


def test_scan_pytrees_forward_backward_match_eager_loop():
    torch.manual_seed(0)
    init = (torch.randn(3, 4, requires_grad=True), torch.zeros(3, requires_grad=True))
    xs = {"w": torch.randn(5, 4, 4, requires_grad=True), "b": torch.randn(5, 4)}
    (c_ref, ys_ref) = scan(_fn, init, xs)  # CPU tensors: the eager Python loop
    loss = c_ref[0].sum() + c_ref[1].pow(2).sum() + ys_ref[0].pow(2).mean()
    refs = torch.autograd.grad(loss, [init[0], init[1], xs["w"]])

    d_init, d_xs = _to(init, DEV), _to(xs, DEV)
    metrics.clear_all()
    (c, ys) = scan(_fn, d_init, d_xs)
    loss = c[0].sum() + c[1].pow(2).sum() + ys[0].pow(2).mean()
    grads = torch.autograd.grad(loss, [d_init[0], d_init[1], d_xs["w"]])
    ops = _pending_ops([*grads, *c, *ys])
    assert ops.count("torchacc.scan.default") == 2  # forward and backward, each one node
    torchacc.sync()
    for a, b in zip([*c, *ys, *grads], [*c_ref, *ys_ref, *refs]):
        _close(a, b)
    assert ys[1].dtype == torch.int64 and not ys[1].requires_grad
    assert xs["b"].grad is None and metrics.executed_fallback_ops() == []


def _stack(depth, sdpa=False, seed=0):
    torch.manual_seed(seed)
    return nn.ModuleList(Block(sdpa=sdpa) for _ in range(depth))


@pytest.mark.parametrize("sdpa", [False, True])
def test_scan_layers_matches_sequential_and_is_depth_independent(sdpa):
    x = torch.randn(2, 8, 16)
    counts = {}
    for depth in (2, 5):
        layers = _stack(depth, sdpa)
        out_ref = nn.Sequential(*layers)(x)
        out_ref.square().mean().backward()
        dev_layers = copy.deepcopy(layers).to(DEV)
        out = scan_layers(dev_layers, x.to(DEV))
        out.square().mean().backward()
        # each layer's gradient is a view of the stacked one: copies, so the sync computes them
        grads = [p.grad.clone() for p in dev_layers.parameters()]
        ops = _pending_ops([out, *grads])
        stacking = ("aten.stack.default", "aten.select.int", "aten.clone.default")
        counts[depth] = sorted(op for op in ops if op not in stacking)
        assert ops.count("torchacc.scan.default") == 2
        n_params = len(list(layers[0].parameters()))
        assert ops.count("aten.select.int") == depth * n_params  # the gradients' unstacking
        torchacc.sync()
        _close(out, out_ref)
        for g, q in zip(grads, layers.parameters()):
            _close(g, q.grad)
    # beyond stacking the weights and unstacking their gradients, the same ops at any depth
    assert counts[2] == counts[5]


def test_scan_layers_training_compiles_like_unrolled_and_reuses_its_program():
    torch.manual_seed(1)
    ref = _stack(3, seed=1)
    model = copy.deepcopy(ref).to(DEV)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    metrics.clear_all()
    compiles = []
    for step in range(4):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))
        for m, opt, device in ((ref, opts[0], "cpu"), (model, opts[1], DEV)):
            out = scan_layers(m, x.to(device), is_layer_pure=True)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        torchacc.sync()
        compiles.append(new_graphs())
    assert compiles == [1, 1, 1, 1]
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p, q, 1e-4)


def test_bad_input_errors_name_the_problem():
    layers = [nn.Linear(4, 4), nn.Linear(4, 5)]
    with pytest.raises(ValueError, match=r"'weight' of layer 1 has shape \(5, 4\).*\(4, 4\)"):
        scan_layers([m.to(DEV) for m in layers], torch.randn(2, 4).to(DEV))
    with pytest.raises(ValueError, match="layer 1 is a ReLU, layer 0 a Linear"):
        scan_layers([nn.Linear(4, 4), nn.ReLU()], torch.randn(2, 4))
    xs = {"a": torch.zeros(3, 2).to(DEV), "b": torch.zeros(4, 2).to(DEV)}
    with pytest.raises(ValueError, match=r"xs\['a'\] has shape \(3, 2\), xs\['b'\] has shape"):
        scan(lambda c, x: (c, None), torch.zeros(2).to(DEV), xs)
    with pytest.raises(ValueError, match=r"changed carry from shape \(2,\) torch.float32 to \(1,"):
        scan(lambda c, x: (c[:1], None), torch.zeros(2).to(DEV), torch.zeros(3, 2).to(DEV))
    with pytest.raises(
        ValueError,
        match=r"carry\[1\] from shape \(2,\) torch.float32 to \(2,\) "
        "torch.float64",
    ):
        scan(
            lambda c, x: ((c[0], c[1].double()), None),
            (torch.zeros(2).to(DEV),) * 2,
            torch.zeros(3, 2).to(DEV),
        )


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_gallery_models_scan_layers_match_their_loop(name):
    """build_gpt/build_llama(scan_layers=True): the same values, the blocks' weights stacked
    (ScannedLayers), one scan each way; outputs and every gradient equal the loop's."""
    from gallery.gpt.model import build_gpt, num_params
    from gallery.llama.model import build_llama
    from torchacc.launch_args import parse_args

    assert parse_args([f"--model={name}", "--scan-layers"]).scan_layers
    assert not parse_args([f"--model={name}"]).scan_layers
    build = build_gpt if name.startswith("gpt") else build_llama
    models = []
    for scanned in (False, True):
        torch.manual_seed(0)
        models.append(build(name, kernels=True, scan_layers=scanned))
    loop, stacked = models
    assert num_params(loop) == num_params(stacked)
    blocks = loop.h if name.startswith("gpt") else loop.layers
    idx = torch.randint(0, 100, (2, 16))
    results = []
    for model in (loop.to(DEV), stacked.to(DEV)):
        out = model(idx.to(DEV))
        out.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((out, grads, _pending_ops([out, *grads.values()])))
    torchacc.sync()
    (out_a, grads_a, ops_a), (out_b, grads_b, ops_b) = results
    assert ops_b.count("torchacc.scan.default") == 2 and "torchacc.scan.default" not in ops_a
    assert "aten.stack.default" not in ops_b  # the weights are stored stacked
    _close(out_b.cpu(), out_a.cpu())
    prefix = "h." if name.startswith("gpt") else "layers."
    for n, g in grads_b.items():
        if not n.startswith(prefix):
            _close(g.cpu(), grads_a[n].cpu())
            continue
        inner = n[len(prefix) :].replace("__", ".").removeprefix("block.")
        per_layer = [grads_a[f"{prefix}{i}.{inner}"].cpu() for i in range(len(blocks))]
        _close(g.cpu(), torch.stack(per_layer))
    # on CPU the same module runs its layers as a loop: the same values as the plain blocks
    with torch.no_grad():
        torch.testing.assert_close(stacked.cpu()(idx), loop.cpu()(idx), rtol=1e-5, atol=1e-5)


def test_closures_and_random_ops_are_refused_before_recording():
    w = torch.randn(4, 4).to(DEV)
    init, xs = torch.zeros(4).to(DEV), torch.ones(3, 4).to(DEV)
    with pytest.raises(ValueError, match="fn uses a tensor it closes over"):
        scan(lambda c, x: (c @ w + x, None), init, xs)
    with pytest.raises(NotImplementedError, match="random op .*dropout"):
        scan(lambda c, x: (torch.nn.functional.dropout(c + x, 0.5), None), init, xs)


def test_autocast_applies_inside_the_scanned_layers():
    """The body is traced on placeholder torchacc tensors, so torchacc's autocast policy (and its
    fused linear/attention ops) apply inside it as in the loop: the same loss bit for bit."""
    from gallery.gpt.model import build_gpt
    from torchacc.torch_xla.amp import autocast

    losses = []
    for scanned in (False, True):
        torch.manual_seed(0)
        model = build_gpt("gpt-tiny", scan_layers=scanned).to(DEV)
        with autocast(DEV, dtype=torch.bfloat16):
            out = model(torch.randint(0, 100, (2, 16)).to(DEV))
        loss = out.float().square().mean()
        loss.backward()
        torchacc.sync()
        assert out.dtype == torch.bfloat16
        losses.append(loss.item())
    assert losses[0] == losses[1]
