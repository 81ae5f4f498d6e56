"""scan / scan_layers / ScannedLayers on the trace-once frontend (torch.compile(backend="torchacc")
and compile_step): one ``torch.ops.higher_order.scan`` node each way, lowered as one lax.scan
(Note [Scan on the trace-once frontend] in torchacc/lazy/scan.py).

Every result is compared with the same layers run as a plain loop in eager PyTorch; the captured
graphs are checked to hold one scan node forward and one backward with the same number of ops at
every depth (the body is traced once), with no graph break (dynamo's own counters) and the
compile counts of torchacc.metrics.
"""

import copy
import math
import os
import re
import sys

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import torchacc.dynamo
from torchacc import metrics
from torchacc.dynamo import aot
from torchacc.torch_xla.experimental.scan import scan
from torchacc.torch_xla.experimental.scan_layers import ScannedLayers, scan_layers

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from gallery.gpt.model import build_gpt  # noqa: E402

SCAN = torch.ops.higher_order.scan


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    counters.clear()
    metrics.clear_all()
    yield
    torch._dynamo.reset()


@pytest.fixture
def graphs(monkeypatch):
    """The AOT graphs torch.compile hands to torchacc, by kind (forward / backward)."""
    seen = {}
    real = aot.lower_graph

    def spy(gm, example_inputs, name):
        seen.setdefault(name, []).append(gm)
        return real(gm, example_inputs, name)

    monkeypatch.setattr(aot, "lower_graph", spy)
    return seen


def _close(a, b, tol=1e-5):
    scale = max(1.0, float(b.detach().abs().max()))
    torch.testing.assert_close(a.detach(), b.detach(), atol=tol * scale, rtol=tol)


def _ops(gm):
    """Ops in ``gm`` and in its scan bodies: (top-level scan nodes, all call_function nodes)."""
    scans = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SCAN]
    total = 0
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule):
            total += sum(1 for n in mod.graph.nodes if n.op == "call_function")
    return len(scans), total


def _gpt_pair(depth):
    """The gallery GPT unrolled and the same values with ``ScannedLayers`` blocks."""
    torch.manual_seed(0)
    kw = dict(n_layer=depth, n_embd=32, n_head=2, vocab_size=64, block_size=16, dropout=0.0)
    ref = build_gpt("gpt-mini", **kw)
    scanned = copy.deepcopy(ref)
    scanned.h, scanned.scan_layers = ScannedLayers(ref.h), True
    return ref, scanned


def _loss(model, idx):
    logits = model(idx)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1))


def _check_grads(ref, scanned):
    for name in scanned.h.weights()[0]:
        want = torch.stack([dict(b.named_parameters())[name].grad for b in ref.h])
        _close(getattr(scanned.h, name.replace(".", "__")).grad, want)
    _close(scanned.wte.weight.grad, ref.wte.weight.grad)


def test_scanned_gpt_under_torch_compile_is_one_scan_each_way_at_any_depth(graphs):
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    shapes = {}
    for depth in (2, 8):
        torch._dynamo.reset()
        metrics.clear_all()
        graphs.clear()
        ref, scanned = _gpt_pair(depth)
        want = _loss(ref, idx)
        want.backward()
        got = _loss(torch.compile(scanned, backend="torchacc", fullgraph=True), idx)
        got.backward()
        _close(got, want)
        _check_grads(ref, scanned)
        assert metrics.counter_value("DynamoGraph") == 1
        assert metrics.counter_value("DynamoCompile") == 2  # one forward, one backward program
        (fw,), (bw,) = graphs["forward"], graphs["backward"]
        shapes[depth] = (_ops(fw), _ops(bw))
        assert shapes[depth][0][0] == 1 and shapes[depth][1][0] == 1
    assert shapes[2] == shapes[8]  # the blocks traced once: the same graphs at depth 2 and 8
    assert not counters["graph_break"]


def test_scan_pytrees_and_scan_layers_under_torch_compile():
    def fn(carry, x):
        h = torch.tanh(carry["h"] @ x["w"] + x["b"])
        # a second carry leaf with and one without grad: their gradients reach the scan's
        # backward as views of one tensor, which torch's operator alone refuses (_DistinctGrads)
        return {"h": h, "c": carry["c"] * 0.5 + h, "n": carry["n"] + 1}, (h * 2, None)

    torch.manual_seed(0)
    h0 = torch.randn(3, 8, requires_grad=True)
    w = (torch.randn(5, 8, 8) * 0.4).requires_grad_()
    b = torch.randn(5, 8, requires_grad=True)

    def run(h0, w, b):
        init = {"h": h0, "c": h0 * 2, "n": torch.zeros(())}
        carry, (ys, none) = scan(fn, init, {"w": w, "b": b})
        assert none is None
        return carry["h"].sum() + ys.square().sum() + carry["c"].sum() + carry["n"], ys

    got, ys = torch.compile(run, backend="torchacc", fullgraph=True)(h0, w, b)
    got.backward()
    grads = [t.grad.clone() for t in (h0, w, b)]
    for t in (h0, w, b):
        t.grad = None
    want, ys_want = run(h0, w, b)  # eager: the plain loop
    want.backward()
    _close(got, want)
    _close(ys, ys_want)
    for g, t in zip(grads, (h0, w, b)):
        _close(g, t.grad)

    # torch_xla's scan_layers (each layer's own parameters, stacked per call)
    layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
    got = torch.compile(lambda x: scan_layers(layers, x).sum(), backend="torchacc")(h0)
    got.backward()
    grads = [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad()
    want = nn.Sequential(*layers)(h0).sum()
    want.backward()
    _close(got, want)
    for g, p in zip(grads, layers.parameters()):
        _close(g, p.grad)
    assert not counters["graph_break"]


def _compile_step_run(depth, idx):
    """Three SGD steps of the scanned GPT through compile_step and of a copy run eagerly (the
    same ScannedLayers as its plain loop); returns the step program's (scan nodes, ops)."""
    _, scanned = _gpt_pair(depth)
    eager = copy.deepcopy(scanned)
    opt, eager_opt = (
        torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (scanned, eager)
    )

    @torchacc.dynamo.compile_step
    def step(idx):
        opt.zero_grad()
        loss = _loss(scanned, idx)
        loss.backward()
        opt.step()
        return loss

    metrics.clear_all()
    for _ in range(3):
        got = step(idx)
        eager_opt.zero_grad()
        want = _loss(eager, idx)
        want.backward()
        eager_opt.step()
        _close(got, want)
    for p, q in zip(scanned.parameters(), eager.parameters()):
        _close(p, q)
    assert metrics.counter_value("StepTrace") == 1
    assert metrics.counter_value("StepRecompile") is None
    assert metrics.counter_value("DynamoCompile") == 1  # the whole step: one program
    (prog,) = step._programs.values()
    return _ops(prog.lowered.gm)


def test_scanned_gpt_in_compile_step_trains_like_eager_with_one_program():
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    sizes = {depth: _compile_step_run(depth, idx) for depth in (2, 4)}
    assert sizes[2][0] == 2  # the blocks forward, their backward
    assert sizes[2] == sizes[4]


def _saved_bytes(fw):
    """Bytes the forward graph computes and saves for the backward (its inputs excluded)."""
    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    vals = [o.meta.get("val") for o in out[1:] if isinstance(o, torch.fx.Node)]
    saved = [o for o, v in zip(out[1:], vals) if o.op != "placeholder"]
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in saved)


_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "s64": 8, "pred": 1}


def _loop_stack_bytes(hlo):
    """Bytes of the stacks the programs' scan loops write step by step (dynamic-update-slice
    inside a while body, whose result is the whole stack)."""
    total = 0
    for line in hlo.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\S* dynamic-update-slice\(", line)
        if m and "while/body" in line:
            total += _BYTES[m.group(1)] * math.prod(int(d) for d in m.group(2).split(",") if d)
    return total


def test_backward_scan_reads_the_stacks_without_copies():
    """Note [Copy-free backward scans]: no flip (HLO reverse) of a stack in the lowered
    programs, and the forward scan saves no more than the unrolled loop's forward (torch's
    operator alone saved a transposed copy of every weight stack too: 1.7x), in torch.compile's
    forward/backward programs and in compile_step's one program."""
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    ref, scanned = _gpt_pair(4)
    seen = {}
    real = aot.lower_graph

    def spy(gm, example_inputs, name):
        lowered = real(gm, example_inputs, name)
        seen.setdefault(name, []).append((gm, lowered))
        return lowered

    def hlo(lowered):
        return "".join(e.as_text() for p in lowered.pieces for e in p._exes.values())

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot, "lower_graph", spy)
        _loss(torch.compile(ref, backend="torchacc"), idx).backward()
        ((loop_fw, _),) = seen["forward"]
        seen.clear()
        torch._dynamo.reset()
        _loss(torch.compile(scanned, backend="torchacc"), idx).backward()
    (fw, fw_low), (bw, bw_low) = seen["forward"][0], seen["backward"][0]
    assert _ops(fw)[0] == 1 and _ops(bw)[0] == 1
    loop_saved = _saved_bytes(loop_fw)
    assert 0 < _saved_bytes(fw) <= loop_saved
    fw_hlo, bw_hlo = hlo(fw_low), hlo(bw_low)
    assert "while" in fw_hlo and "while" in bw_hlo
    assert "reverse(" not in fw_hlo + bw_hlo
    assert 0 < _loop_stack_bytes(fw_hlo) <= loop_saved

    opt = torch.optim.AdamW(scanned.parameters(), lr=1e-3)

    @torchacc.dynamo.compile_step(eager_steps=0)
    def step(idx):
        opt.zero_grad()
        loss = _loss(scanned, idx)
        loss.backward()
        opt.step()
        return loss

    step(idx)
    (prog,) = step._programs.values()
    exe = prog.flat.exe if prog.flat is not None else prog.lowered.pieces[0]._exes[()]
    step_hlo = exe.as_text()
    assert "reverse(" not in step_hlo
    stacked = sum(p.numel() * p.element_size() for p in scanned.h.parameters())
    # the forward scan's stacks and the backward scan's stacked gradients, nothing more
    assert 0 < _loop_stack_bytes(step_hlo) <= loop_saved + stacked


def test_bad_input_errors_name_the_problem_on_the_trace_once_frontend():
    x = torch.randn(2, 8)
    bad = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)])
    msg = r"parameter 'weight' of layer 2 has shape \(4, 8\) torch.float32, layer 0's \(8, 8\)"
    with pytest.raises(ValueError, match=msg):
        torch.compile(lambda x: scan_layers(bad, x), backend="torchacc")(x)
    with pytest.raises(ValueError, match=msg):
        ScannedLayers(bad)
    # fullgraph: dynamo reports the same ValueError inside its own exception
    torch._dynamo.reset()
    with pytest.raises(Exception, match=msg):
        torch.compile(lambda x: scan_layers(bad, x), backend="torchacc", fullgraph=True)(x)

    w = torch.randn(4, 8, 8)
    carry_msg = r"fn changed carry from shape \(2, 8\) torch.float32 to \(1, 8\) torch.float32"

    def shrink(c, w):
        return (c @ w)[:1], None

    with pytest.raises(Exception, match=carry_msg):  # dynamo wraps errors raised inside fn
        torch.compile(lambda x, w: scan(shrink, x, w), backend="torchacc")(x, w)

    lin = nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    @torchacc.dynamo.compile_step(eager_steps=0)
    def step(x, w):
        opt.zero_grad()
        out = scan(shrink, lin(x), w)[0].sum()
        out.backward()
        opt.step()
        return out

    with pytest.raises(ValueError, match=carry_msg):
        step(x, w)

    # make_fx would freeze a tensor fn closes over into the body: refused as on the lazy device
    @torchacc.dynamo.compile_step(eager_steps=0)
    def closing(x, w):
        opt.zero_grad()
        h = lin(x)
        out = scan(lambda c, w: (torch.tanh(c @ w + h), None), h, w)[0].sum()
        out.backward()
        opt.step()
        return out

    with pytest.raises(ValueError, match="fn uses a tensor it closes over"):
        closing(x, w)

    # torch's operator cannot differentiate a scan carrying an integer tensor: said by name
    def count(c, w):
        return {"h": torch.tanh(c["h"] @ w), "k": c["k"] + 1}, None

    h = x.clone().requires_grad_()
    with pytest.raises(Exception, match=r"carry\['k'\] is a torch.int64 tensor"):
        init = {"h": h, "k": torch.zeros((), dtype=torch.int64)}
        torch.compile(lambda h, w: scan(count, init, w), backend="torchacc")(h, w)
