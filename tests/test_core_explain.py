"""Every sync and compile of the lazy path says why, in the user's words (issue 19, item 5).

Real traced steps: reads of pending tensors are counted at the user's line with the kind of read,
a read that splits a step gets a one-time warning at that line, a recompile names the input
(variable, parameter, optimizer state, ``batch input k``) and the ATen op, the summary's counts
are the metrics' counters. Output and warnings are checked in fresh processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import prewarmed
import pytest
import torch

import torchacc
from torchacc import metrics
from torchacc.lazy import fallback

DEV = torchacc.device()
HERE = os.path.relpath(__file__)


def _line(offset=1):
    """The line number ``offset`` lines below the caller's."""
    return sys._getframe(1).f_lineno + offset


def _run(tmp_path, script, debug=False):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TORCHACC_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."),
    )
    env.pop("TORCHACC_DEBUG", None)
    if debug:
        env["TORCHACC_DEBUG"] = "1"
    out = prewarmed.run([str(path)], env=env, cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stderr
    return out, path.read_text().splitlines()


def _line_of(lines, text):
    """1-based number of the only line containing ``text``."""
    found = [i + 1 for i, ln in enumerate(lines) if text in ln]
    assert len(found) == 1, (text, found)
    return found[0]


_STEP = """
    import torch, torchacc
    import torchacc.torch_xla.core.xla_model as xm
    from torchacc import metrics
    dev = torchacc.device()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8).to(dev)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        {read}
        xm.mark_step()
    print("SITES", metrics.sync_sites())
"""


def test_print_before_mark_step_hints_once_at_the_users_line(tmp_path):
    out, lines = _run(tmp_path, _STEP.format(read="print(loss)"))
    line, mark = _line_of(lines, "print(loss)"), _line_of(lines, "xm.mark_step()")
    hints = [ln for ln in out.stderr.splitlines() if "SyncWarning" in ln]
    assert len(hints) == 1, out.stderr  # once, though every step splits
    assert hints[0].startswith(f"{tmp_path / 'script.py'}:{line}: SyncWarning: ")
    assert f"`print(loss)` at script.py:{line}" in hints[0]
    assert f"mark_step at script.py:{mark}" in hints[0] and "2 graphs" in hints[0]
    assert "torchacc: sync:" not in out.stderr  # no per-sync lines without TORCHACC_DEBUG


def test_reading_after_mark_step_is_no_sync_and_no_hint():
    w = torch.randn(8, 2).to(DEV)
    metrics.clear_counters()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            loss = (torch.randn(4, 8).to(DEV) @ w).sum()
            torchacc.sync()
            loss.item()  # computed already: a transfer, not a sync
    assert not [w for w in caught if issubclass(w.category, torchacc.SyncWarning)]
    assert metrics.counter_value("ReadSync") is None
    assert metrics.counter_value("TransferFromDevice") == 2


def _pending():
    # float data: an integer one computed from uploads only would be read on the host instead
    # (Note [Reads of host-known values])
    return (torch.arange(6.0).to(DEV) * 2).sum()


@pytest.mark.parametrize(
    "kind, read",
    [
        ("`t.item()`", lambda t: t.item()),
        ("`float(t)`", lambda t: float(t)),
        ("`t.cpu()`", lambda t: t.cpu()),
        ("`t.tolist()`", lambda t: t.tolist()),
        ("`t.numpy()`", lambda t: t.numpy()),
        ("`repr(t)` (print)", lambda t: repr(t)),
        ("`str(t)` (print)", lambda t: str(t)),
    ],
)
def test_each_kind_of_read_is_counted_at_its_line(kind, read):
    t = _pending()
    metrics.clear_counters()
    read(t)
    line = read.__code__.co_firstlineno  # the lambda's frame is the user's innermost
    assert metrics.sync_sites() == [(("read", kind, f"{HERE}:{line}"), 1)]
    assert metrics.counter_value("ReadSync") == 1


def test_control_flow_on_a_pending_tensor_is_named():
    t = _pending()
    metrics.clear_counters()
    line = _line()
    if t > 100:
        pass
    assert metrics.sync_sites() == [
        (("read", "`t > 100` (bool in control flow)", f"{HERE}:{line}"), 1)
    ]


def _last_reason():
    return metrics.compile_explanations()[-1]


def test_changed_batch_shape_names_the_variable():
    w = torch.randn(16, 2).to(DEV)
    metrics.clear_counters()
    for n in (3, 3, 7):
        x = torch.randn(n, 16).to(DEV)
        out = (x @ w).sum()  # noqa: F841  (alive at the sync: computed by it)
        line = _line()
        torchacc.sync()
    reasons = metrics.compile_explanations()
    assert f"mark_step at {HERE}:{line}" in reasons[-1]
    assert "input `x` is f32[7, 16]; the nearest cached graph had f32[3, 16]" in reasons[-1]


def test_unnamed_batch_input_is_batch_input_k():
    w = torch.randn(16, 2).to(DEV)
    out = []
    for n in (5, 9):
        out.append((torch.randn(n, 16).to(DEV) @ w).sum())  # the input has no variable
        torchacc.sync()
    assert "input `batch input 0` is f32[9, 16]" in _last_reason()


def test_same_op_with_another_argument_is_named():
    x = torch.randn(5, 17).to(DEV)  # shapes of its own: no graph of another test matches
    torchacc.sync()
    for dim in (0, 1):
        out = x.sum(dim) * 2  # noqa: F841  (alive at the sync: computed by it)
        torchacc.sync()
    reason = _last_reason()
    assert "aten::sum.dim_IntList (op 0" in reason, reason
    assert "has argument (1,) where the nearest cached graph had (0,)" in reason, reason


def test_a_batched_foreach_node_is_named_by_its_op():
    ts = [torch.randn(7, 29).to(DEV) for _ in range(3)]  # shapes of their own
    torchacc.sync()
    for foreach in (torch._foreach_div, torch._foreach_mul):
        out = foreach(ts, 2.0)  # noqa: F841  (alive at the sync: computed by it)
        torchacc.sync()
    reason = _last_reason()
    assert "aten::mul.Scalar (x3, one batched _foreach_ node)" in reason, reason


def test_same_ops_with_other_live_tensors_are_named():
    x = torch.randn(3, 19).to(DEV)
    torchacc.sync()
    kept = []
    for keep_both in (False, True):
        y = x * 2
        z = y + 1
        kept.append((y, z) if keep_both else z)
        del y, z
        torchacc.sync()
    want = "the same ops, but 2 live tensors to compute vs 1 in the nearest cached graph"
    assert want in _last_reason(), _last_reason()


def test_changed_parameter_is_named_by_its_module_path():
    model = torch.nn.Module()
    for n in (3, 11):
        model.w = torch.nn.Parameter(torch.ones(n).to(DEV))
        out = (model.w * 2).sum()  # noqa: F841  (alive at the sync: computed by it)
        torchacc.sync()
    assert "input `model.w` is f32[11]; the nearest cached graph had f32[3]" in _last_reason()


def test_new_optimizer_state_is_named_after_the_parameter():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 13).to(DEV)  # shapes of its own: no graph of another test matches
    opt = torch.optim.Adam(lin.parameters(), lr=0.1, foreach=True)
    for _ in range(2):
        lin(torch.ones(2, 6).to(DEV)).sum().backward()
        opt.step()
        opt.zero_grad()
        torchacc.sync()
    reason = _last_reason()
    assert "new: `opt.state[lin.weight]['exp_avg" in reason, reason
    assert "`opt.state[lin.weight]['exp_avg']`" in reason and "lin.bias" in reason


_DEBUG_SCRIPT = (
    _STEP.format(read="value = loss.item()")
    + """
    for n in (4, 4, 5):
        x = torch.ones(n).to(torchacc.device())
        (x * 3).sum().item()
    y = torch.ones(5).to(torchacc.device())
    z = y - 3
    z.sum().item()
    a, b = torch.ones(2, 3, 5).to(torchacc.device()), torch.ones(7, 5).to(torchacc.device())
    torch.nn.functional.linear(a, b).sum().item()
"""
)


def test_debug_names_each_read_sync_and_each_recompile(tmp_path):
    """TORCHACC_DEBUG=1: a line per read sync (``.item()`` every step) at the user's line, and
    each compile's reason with input names, ATen op names and the line that recorded the op."""
    out, lines = _run(tmp_path, _DEBUG_SCRIPT, debug=True)
    line = _line_of(lines, "loss.item()")
    syncs = [ln for ln in out.stderr.splitlines() if ln.startswith("torchacc: sync:")]
    want = f"torchacc: sync: `loss.item()` at script.py:{line} reads a pending tensor"
    assert syncs[:3] == [want] * 3, out.stderr
    assert f"(('read', '`loss.item()`', 'script.py:{line}'), 3)" in out.stdout

    compiles = [ln for ln in out.stderr.splitlines() if ln.startswith("torchacc: compiling")]
    compiles = compiles[-3:]  # the script's second part: n=5, then `y - 3`, then linear
    assert "input `x` is f32[5]; the nearest cached graph had f32[4]" in compiles[0], compiles
    sub = _line_of(lines, "z = y - 3")
    assert f"starts with aten::sub.Tensor, recorded at script.py:{sub}" in compiles[1]
    linear = _line_of(lines, "functional.linear")
    assert (
        "starts with aten::linear (recorded as torchacc's fused torchacc::linear), recorded at "
        f"script.py:{linear}"
    ) in compiles[2]
    assert ".default" not in "\n".join(compiles)  # ATen names, not Python op objects


def test_summary_counts_are_the_metrics_counters():
    metrics.clear_counters()
    w = torch.randn(8, 3).to(DEV)
    for n in (2, 2, 6):
        loss = (torch.randn(n, 8).to(DEV) @ w).relu().sum()
        loss.item()  # before the sync: a read sync
        torchacc.sync()
    s = metrics.explain_summary(top=100)
    compiles = (metrics.counter_value("UncachedCompile") or 0) + (
        metrics.counter_value("PersistentCacheHit") or 0
    )
    assert s["compiles"] == compiles == len(s["compile_reasons"]) >= 1
    assert s["mark_steps"] == metrics.counter_value("MarkStep") == 3
    assert s["read_syncs"] == metrics.counter_value("ReadSync") == 3
    assert s["syncs"] == 6 == sum(site["count"] for site in s["top_sync_sites"])
    report = metrics.explain_report()
    assert report.startswith(f"torchacc: {compiles} compile")
    assert "6 syncs (3 mark_step, 3 reads of a pending tensor)" in report
    assert f"sync x3: `loss.item()` at {HERE}:" in report
    import torchacc.torch_xla.debug.metrics as met

    assert met.explain_report() == report and "Counter: ReadSync: 3" in met.short_metrics_report()


def test_fallback_warning_points_at_the_users_line():
    x = torch.tensor([3.0, 1.0, 3.0]).to(DEV)
    fallback._warned.discard("aten::_unique2")  # warned once per process
    with pytest.warns(UserWarning, match="_unique2.*no lowering") as caught:
        line = _line()
        torch.unique(x)  # torch/functional.py calls the op: the warning is still at this line
    w = [w for w in caught if "_unique2" in str(w.message)][0]
    assert (os.path.abspath(w.filename), w.lineno) == (os.path.abspath(__file__), line)


def test_debug_off_leaves_the_recording_path_untouched():
    from torchacc.lazy import dispatch
    from torchacc.lazy.tensor import LazyTensor

    assert os.environ.get("TORCHACC_DEBUG", "0") in ("", "0")
    assert LazyTensor.__dict__["__torch_dispatch__"].__func__ is dispatch._torch_dispatch


def test_every_input_of_a_training_step_is_named():
    """Parameters the step updates in place (their storage now holds the pending new value) are
    named through the update nodes; optimizer state, buffers and the batch too."""
    import sys as _sys

    from torchacc.engine import names
    from torchacc.ir import live_storages
    from torchacc.program import Graph

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):  # the second step has momentum buffers
        x = torch.randn(5, 4).to(DEV)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            torchacc.sync()
    pending = {id(st.value): st.value for st in live_storages() if st.value.node is not None}
    graph = Graph(list(pending.values()))  # what the sync below compiles
    got = set(names.input_names(graph.inputs, _sys._getframe()))
    torchacc.sync()
    want = {"x", "model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias"}
    want |= {"model.1.running_mean", "model.1.running_var", "model.1.num_batches_tracked"}
    want |= {f"opt.state[model.{p}]['momentum_buffer']" for p in ("0.weight", "0.bias")}
    assert want <= got, sorted(got)
    assert not [n for n in got if n.startswith("batch input")], sorted(got)


def test_fallback_warning_in_a_python_c_script(tmp_path):
    """``python -c``: the user's "file" has a loader that cannot give its source; the fallback
    warning must still be shown (it once raised ImportError from inside warnings.warn_explicit)."""
    code = (
        "import torch, torchacc; x = torch.ones(3).to(torchacc.device()); "
        "print(torch.unique(x).cpu().tolist())"
    )
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        TORCHACC_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."),
    )
    out = subprocess.run(
        [sys.executable, "-W", "always", "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0]"
    assert "<string>:1: UserWarning: torchacc: aten._unique2.default has no lowering" in out.stderr
