"""Known steps (Note [Known steps]): a step that records the ops of an earlier step launches its
program without a graph walk, and computes exactly what the full path would.

Every test runs the same loop twice, with known steps on and off (``known.start``), and asserts
bit-equal results plus how each step launched (the ``KnownStep`` counter) and that no program
was built twice (``new_graphs``).
"""

from __future__ import annotations

import copy
import os
import textwrap

import prewarmed
import pytest
import torch
import torch.nn.functional as F
from compile_counts import new_graphs
from models import CNN

import torchacc
from torchacc import metrics
from torchacc import program as compiler
from torchacc.program import known

DEV = torchacc.device()


@pytest.fixture(autouse=True)
def _known_steps_on():
    torchacc.sync()  # nothing pending from an earlier test joins this test's first step
    known.start(True)
    yield
    known.start()


def _known():
    return metrics.counter_value("KnownStep") or 0


def _both(loop):
    """``loop()`` with known steps off, then on: (results off, results on, known-step count)."""
    known.start(False)
    off = loop()
    known.start(True)
    metrics.clear_all()
    on = loop()
    return off, on, _known()


def _assert_bit_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x, y)


def _cnn_loop(steps=6, lr_of=lambda s: 1e-2 / (1 + s), extra_every=0, keep_every=0):
    def loop():
        torch.manual_seed(0)
        model = CNN().to(DEV)
        opt = torch.optim.AdamW(model.parameters(), lr=lr_of(0), weight_decay=0.1)
        kept, out = [], []
        for s in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr_of(s)  # a Python scalar that changes every step
            g = torch.Generator().manual_seed(s)
            x = torch.randn(4, 3, 8, 8, generator=g).to(DEV)
            y = torch.randint(0, 5, (4,), generator=g).to(DEV)
            loss = F.cross_entropy(model(x), y)
            if extra_every and s % extra_every == 0:
                loss = loss + 0.01 * model.head.weight.square().sum()  # a different op stream
            loss.backward()
            opt.step()
            opt.zero_grad()
            if keep_every and s % keep_every == 0:
                kept.append(model.head.bias * 1)  # one more live pending output this step
            torchacc.sync()
            out.append(loss.detach())
        return [t.cpu() for t in out + kept + [p.detach() for p in model.parameters()]]

    return loop


def test_training_steps_are_known_after_the_first_two_and_equal_the_full_path():
    metrics.clear_all()
    off, on, launched = _both(_cnn_loop(steps=6))
    _assert_bit_equal(off, on)
    assert launched == 4  # steps 1 and 2 (optimizer state appears) are learnt, 3-6 are known


def test_a_known_step_walks_no_graph(monkeypatch):
    torchacc.sync()  # an earlier test's pending tensors would make loop 1's first step unique
    loop = _cnn_loop(steps=5)
    loop()  # learn the streams and compile
    walks = []
    real = compiler.Graph

    class CountingGraph(real):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            walks.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(compiler, "Graph", CountingGraph)
    metrics.clear_all()
    loop()
    # a new model of the same structure records the same streams: even its first steps are known
    assert len(walks) == 0 and _known() == 5 and new_graphs() == 0


def test_alternating_streams_are_each_known():
    metrics.clear_all()
    off, on, launched = _both(_cnn_loop(steps=10, extra_every=2))
    _assert_bit_equal(off, on)
    # learnt: step 0 (extra, no optimizer state yet), 1 (plain), 2 (extra with state)
    assert launched == 7
    assert new_graphs() == 0  # the second run found every program in memory


def test_a_step_with_one_more_live_output_is_another_variant():
    metrics.clear_all()
    off, on, launched = _both(_cnn_loop(steps=9, keep_every=3))
    _assert_bit_equal(off, on)
    # learnt: step 0 (keeps, no optimizer state yet), 1 (plain), 3 (keeps with state); step 6
    # keeps like step 3 and is known as that variant
    assert launched == 6
    assert new_graphs() == 0


def test_learning_rate_tensor_and_schedule_values_come_from_this_step():
    """The runtime scalars of a known step are this step's, not the learnt step's."""
    lrs = [1e-2, 5e-3, 1e-1, 0.0, 2e-2, 7e-2]

    def run_on(device):
        torch.manual_seed(0)
        model = CNN()
        model = copy.deepcopy(model).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=lrs[0], momentum=0.9)
        for s, lr in enumerate(lrs):
            opt.param_groups[0]["lr"] = lr
            g = torch.Generator().manual_seed(s)
            x = torch.randn(4, 3, 8, 8, generator=g).to(device)
            y = torch.randint(0, 5, (4,), generator=g).to(device)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if device.type == "torchacc":
                torchacc.sync()
        return [p.detach().cpu() for p in model.parameters()]

    metrics.clear_all()
    got = run_on(DEV)
    want = run_on(torch.device("cpu"))
    assert _known() >= 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_donation_follows_what_this_step_keeps_alive():
    """``new = old * 2``: when the user drops ``old`` its buffer is donated, when they keep it
    it must still read back; the known step must not reuse the other step's donations."""

    def loop():
        state = torch.arange(6.0).to(DEV)
        torchacc.sync()
        keeps, history = [], []
        for s in range(8):
            old = state
            state = old * 2 + 1
            if s % 2:
                keeps.append(old)  # alive after the sync: not donatable
            del old
            torchacc.sync()
            history.append(state)
        return [t.cpu() for t in keeps + history]

    metrics.clear_all()
    off, on, launched = _both(loop)
    _assert_bit_equal(off, on)
    assert launched >= 4
    want = torch.arange(6.0)
    for s in range(8):
        want = want * 2 + 1
        assert torch.equal(on[4 + s], want)


def test_a_read_before_mark_step_takes_the_full_path():
    def loop():
        torch.manual_seed(0)
        model = CNN().to(DEV)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen = []
        for s in range(5):
            g = torch.Generator().manual_seed(s)
            x = torch.randn(4, 3, 8, 8, generator=g).to(DEV)
            y = torch.randint(0, 5, (4,), generator=g).to(DEV)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            if s >= 3:
                seen.append(loss.item())  # runs part of the step before mark_step
            opt.step()
            opt.zero_grad()
            torchacc.sync()
        return [torch.tensor(seen)] + [p.detach().cpu() for p in model.parameters()]

    metrics.clear_all()
    off, on, launched = _both(loop)
    _assert_bit_equal(off, on)
    assert launched == 1  # step 2 only: 0 and 1 are learnt, 3 and 4 read before mark_step


def test_a_pending_value_of_an_earlier_step_is_not_known():
    """A view replays its chain lazily: its cached Value can be pending from an earlier step."""

    def loop():
        base = torch.arange(12.0).to(DEV)
        view = base[2:8]
        results = []
        for s in range(5):
            base.mul_(2)
            torchacc.sync()
            results.append(view + s)  # reads the view after its base moved
            torchacc.sync()
        return [t.cpu() for t in results]

    off, on, _ = _both(loop)
    _assert_bit_equal(off, on)
    want = torch.arange(12.0)
    for s in range(5):
        want = want * 2
        assert torch.equal(on[s], want[2:8] + s)


def test_changed_matmul_precision_is_not_a_known_step():
    def step(model, x):
        loss = model(x).square().sum()
        loss.backward()
        torchacc.sync()

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).to(DEV)
    x = torch.randn(4, 8).to(DEV)
    before = torch.get_float32_matmul_precision()
    try:
        for _ in range(3):
            step(model, x)
        metrics.clear_all()
        torch.set_float32_matmul_precision("high" if before == "highest" else "highest")
        from torchacc.torch_xla import backends  # noqa: F401  (precision follows torch)

        step(model, x)
        assert _known() == 0 and new_graphs() + (metrics.counter_value("CachedCompile") or 0) >= 1
    finally:
        torch.set_float32_matmul_precision(before)


def test_debug_says_where_a_step_left_its_known_stream(tmp_path):
    script = tmp_path / "diverge.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torchacc
            dev = torchacc.device()
            w = torch.ones(4, device=dev)
            for s in range(4):
                w = w * 2
                if s == 3:
                    w = w.exp()
                torchacc.sync()
            print(w.cpu().tolist())
            """
        )
    )
    env = dict(os.environ, TORCHACC_DEBUG="1", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(torchacc.__file__)), env.get("PYTHONPATH", "")]
    )
    proc = prewarmed.run([str(script)], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "known step: op #1 is aten.exp.default, the known step had mark_step there" in (
        proc.stderr
    )
    assert "diverge.py:8" in proc.stderr


def test_same_ops_wired_differently_are_different_steps():
    """Equal ops on equal shapes are not enough: which inputs feed which op must match too."""

    def loop():
        a = torch.arange(4.0).to(DEV)
        b = torch.full((4,), 10.0).to(DEV)
        out = []
        for s in range(6):
            c, d = a * 2, b * 3
            out.append(c - d if s % 2 else d - c)  # pending inputs swapped
            out.append(a - b if s % 3 else b - a)  # data inputs swapped
            torchacc.sync()
        return [t.cpu() for t in out]

    off, on, launched = _both(loop)
    _assert_bit_equal(off, on)
    a, b = torch.arange(4.0), torch.full((4,), 10.0)
    for s in range(6):
        c, d = a * 2, b * 3
        assert torch.equal(on[2 * s], c - d if s % 2 else d - c)
        assert torch.equal(on[2 * s + 1], a - b if s % 3 else b - a)
    assert launched >= 2


def test_programs_forgotten_in_the_middle_of_a_step():
    """``clear_memory_cache`` (a precision change, ``torch_xla.backends``) mid-step: the step
    takes the full path and the next ones are learnt again."""

    def loop():
        w = torch.ones(4).to(DEV)
        torchacc.sync()
        out = []
        for s in range(6):
            w = w * 2
            if s == 3:
                compiler.clear_memory_cache()
            w = w + 1
            torchacc.sync()
            out.append(w)
        return [t.cpu() for t in out]

    off, on, launched = _both(loop)
    _assert_bit_equal(off, on)
    # step 0 donates its input (nothing else holds it), steps 1-5 do not (``out`` holds it): steps
    # 0 and 1 are learnt, 2 is known, 3 is forgotten mid-step, 4 is learnt again, 5 is known
    assert launched == 2


def test_many_variants_of_one_stream_stay_bounded_and_correct():
    """A loop keeping a different intermediate alive every step: each step is a new variant of
    the same stream; the oldest variants are dropped and every result stays right."""
    w, ref = torch.ones(4).to(DEV), torch.ones(4)
    torchacc.sync()
    metrics.clear_all()
    for s in range(20):
        parts = [w * (k + 2) for k in range(20)]
        kept = parts[s]  # this step's extra live output
        w = torch.stack(parts).sum(0) / 100
        del parts
        torchacc.sync()
        ref_parts = [ref * (k + 2) for k in range(20)]
        torch.testing.assert_close(kept.cpu(), ref_parts[s])
        ref = torch.stack(ref_parts).sum(0) / 100
        torch.testing.assert_close(w.cpu(), ref)
    assert all(len(st.variants) <= known._MAX_VARIANTS for st in known._streams)
    assert _known() == 0  # every step kept another intermediate: none repeats an earlier one


def test_reading_gradient_views_after_the_sync_runs_no_program_and_keeps_steps_known():
    """A broadcast weight's gradient (autograd's ``sum_to_size``: a sum, then a view) is a view
    of a backward result: read after ``mark_step`` it is taken from the computed storage on the
    host (no program, no spoiled known step), and equals eager's."""
    torch.manual_seed(0)
    norm, head = _Scale(8), torch.nn.Linear(8, 3)
    models = {"cpu": (norm, head)}
    models["dev"] = tuple(copy.deepcopy(m).to(DEV) for m in models["cpu"])
    grads = {}
    for where, (n, h) in models.items():
        device = DEV if where == "dev" else "cpu"
        opt = torch.optim.SGD([*n.parameters(), *h.parameters()], lr=0.01)
        out = []
        for step in range(5):
            x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(step)).to(device)
            opt.zero_grad()
            h(n(x)).square().sum().backward()
            opt.step()
            if device == DEV:
                torchacc.sync()
                if step == 2:
                    metrics.clear_all()
            out.append(n.weight.grad.cpu())
        grads[where] = out
    assert metrics.counter_value("UncachedCompile") in (None, 0)
    assert _known() == 2  # steps 3 and 4 launched as known steps
    for got, want in zip(grads["dev"], grads["cpu"]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)  # 5 SGD steps apart


class _Scale(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)

    def forward(self, x):
        return x * self.weight
