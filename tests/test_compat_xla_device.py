"""torch_xla scripts' ``device="xla"`` strings and ``xla::<op>`` counters (issue 33).

Note [The xla device string] (torchacc/torch_xla/_xla_device.py); the counters are
torchacc/lazy/op_counters.py's.
"""

import functools
import re

import prewarmed
import pytest
import torch

import torchacc
import torchacc.torch_xla  # noqa: F401  (installs the xla device mapping)
import torchacc.torch_xla.debug.metrics as met
from torchacc.torch_xla import _xla_device


def test_xla_strings_reach_the_torchacc_device_with_eager_numerics():
    """Run in a fresh process: a factory that reaches torch's XLA dispatch key (``device="xla"``)
    leaves the process in a state where a later backward through ``torch.stft`` fails inside
    torch's autograd engine (SystemError; README limits), which would break other tests."""
    import os

    case = os.path.join(os.path.dirname(os.path.abspath(__file__)), "xla_device_strings_case.py")
    proc = prewarmed.run(
        [case], cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=300
    )
    assert proc.returncode == 0 and "xla strings ok" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(2, device="xla:3"),
        lambda: torch.tensor([1.0], device="xla:3"),
        lambda: torch.randn(2).to("xla:3"),
        lambda: torch.randn(2).to(torch.device("xla", 3)),
    ],
    ids=["factory", "tensor", "to", "to_device"],
)
def test_another_device_index_is_one_clear_error(make):
    with pytest.raises(ValueError) as info:
        make()
    msg = str(info.value)
    assert "'xla:3'" in msg and "no such device" in msg and "'xla:0'" in msg, msg


def test_resolve_names_the_string_and_what_exists():
    dev = torchacc.device()
    for spec in ("xla", "xla:0", torch.device("xla"), 0, None, "torchacc:0", dev):
        assert _xla_device.resolve(spec) == dev
    for spec, what in (("cuda:0", "not an XLA device"), ("tpu", "not a device"), (2, "no such")):
        with pytest.raises(ValueError) as info:
            _xla_device.resolve(spec)
        assert f"device {spec!r}:" in str(info.value)
        assert what in str(info.value) and "'xla:0'" in str(info.value)
    with pytest.raises(TypeError, match="expected a str"):
        _xla_device.resolve(1.5)


def test_xla_op_counters_count_recorded_ops_and_clear():
    dev = torchacc.device()
    a = torch.ones(4, 4, device=dev)
    torchacc.sync()
    met.clear_counters()
    assert met.counter_value("xla::mm") is None and "xla::mm" not in met.counter_names()
    b = a @ a
    c = b @ a + 1
    d = (c + b).sum()
    assert met.counter_value("xla::mm") == 2
    assert met.counter_value("xla::add") == 2
    assert met.counter_value("xla::sum") == 1
    assert {"xla::mm", "xla::add", "xla::sum"} <= set(met.counter_names())
    assert "Counter: xla::mm\n  Value: 2" in met.metrics_report()
    torchacc.metrics.counter_inc("xla::mm", 3)  # torch_xla's _xla_increment_counter adds to it
    assert met.counter_value("xla::mm") == 5
    assert "Counter: xla::mm\n  Value: 5" in met.metrics_report()
    torchacc.sync()
    assert d.item() == 16 * (16 + 1 + 4)  # b = 4, c = 17 everywhere
    # a fallback (data-dependent shape) runs on CPU: counted as aten::<op>, not recorded
    met.clear_counters()
    assert met.counter_value("xla::mm") is None
    idx = torch.nonzero(torch.tensor([0.0, 3.0], device=dev) * 2)
    assert idx.cpu().flatten().tolist() == [1]
    assert met.counter_value("aten::nonzero") == 1 and met.counter_value("xla::nonzero") is None
    assert met.counter_value("xla::mul") == 1


def test_float8_tensors_move_and_multiply():
    for dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        t, w = torch.rand(3, 2).to(dtype), torch.rand(2, 5).to(dtype)
        xt = t.to("xla")
        assert xt.dtype == dtype and torch.equal(xt.cpu().view(torch.uint8), t.view(torch.uint8))
        out = torch.matmul(xt, w.to("xla")).cpu()
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), torch.matmul(t, w).float())


def test_xlac_internals_torch_xla_tests_call():
    from torchacc.torch_xla import _XLAC
    from torchacc.torch_xla.core import xla_op_registry as xor
    from torchacc.torch_xla.experimental import callback

    torch.manual_seed(0)
    a, b = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    # batch dim 0, contract lhs 2 with rhs 2: result (batch, lhs free, rhs free)
    out = _XLAC._xla_dot_general(a.to("xla"), b.to("xla"), (([2], [2]), ([0], [0])))
    torch.testing.assert_close(out.cpu(), torch.einsum("bik,bjk->bij", a, b))
    with pytest.raises(ValueError, match=r"lhs dim 2 \(4\) != rhs dim 1 \(5\)"):
        _XLAC._xla_dot_general(a.to("xla"), b.to("xla"), (([2], [1]), ()))
    _XLAC._xla_increment_counter("MyCounter", 3)
    _XLAC._xla_increment_counter("MyCounter", 2)
    assert met.counter_value("MyCounter") == 5
    pending = out * 2
    _XLAC._set_allow_execution(False)
    try:
        with pytest.raises(RuntimeError, match="execution is disallowed"):
            pending.cpu()
    finally:
        _XLAC._set_allow_execution(True)
    torch.testing.assert_close(pending.cpu(), 2 * torch.einsum("bik,bjk->bij", a, b))
    assert "XLA Shape: f32[2,3,5]" in _XLAC._get_xla_tensor_debug_info(pending)
    assert _XLAC._unsafe_buffer_pointer(pending) > 0
    ready = callback.on_ready_event(pending * 3)  # pending: fires after the next sync
    assert not ready.wait(0.2)
    torchacc.sync()
    assert ready.wait(30)
    op = xor.register("my_op", lambda a: a)
    with pytest.raises(NotImplementedError, match="xor.register\\('my_op'\\).*XlaBuilder"):
        op(pending)


def test_uninstall_restores_torch_and_install_again_maps():
    original_to = torch.Tensor.to
    _xla_device.uninstall()
    try:
        assert torch.Tensor.to is original_to.__torchacc_original__
        with pytest.raises(RuntimeError, match="xla"):
            torch.ones(1).to("xla")  # torch's own error without the mapping
    finally:
        _xla_device.install()
    assert torch.ones(1).to("xla").device == torchacc.device()


def test_torch_autocast_xla_is_torchacc_autocast():
    """``torch.autocast('xla')`` (torch would turn on AutocastXLA, which torchacc tensors do not
    carry) means torchacc's autocast: same dtypes and values as ``torch.autocast('torchacc')``;
    other device types pass through."""
    import torch.nn as nn

    torch.manual_seed(0)
    lin = nn.Linear(6, 4).to(torchacc.device())
    x = torch.randn(3, 6).to(torchacc.device())
    with torch.autocast("xla"):
        y = lin(x)
        s = torch.softmax(y, dim=1)  # an fp32-policy op
    with torch.autocast("torchacc", dtype=torch.bfloat16):
        want = lin(x)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(y.cpu(), want.cpu())
    with torch.amp.autocast(device_type="xla", dtype=torch.float16) as ctx:
        assert ctx.device == "torchacc" and lin(x).dtype == torch.float16
    with torch.autocast("cpu", dtype=torch.bfloat16) as ctx:
        assert ctx.device == "cpu" and torch.mm(torch.ones(2, 2), torch.ones(2, 2)).dtype == (
            torch.bfloat16
        )


def test_hlo_text_has_operand_shapes_and_opcode_names():
    """``_get_xla_tensors_hlo`` prints torch_xla's form: instructions named after their opcode,
    operands with their shapes (scripts and torch_xla's tests match lines with regexes)."""
    from torchacc.torch_xla import _XLAC

    a = torch.ones(3).to(torchacc.device())
    hlo = _XLAC._get_xla_tensors_hlo([(a * 2).exp()])
    line = next(ln for ln in hlo.splitlines() if " exponential(" in ln)
    assert re.fullmatch(
        r"\s+ROOT %exponential\.1 = f32\[3\]\{0\} exponential\(f32\[3\]\{0\} %multiply\.1\)", line
    ), hlo
    assert "metadata=" not in hlo


def test_device_named_xla_makes_device_comparisons_hold():
    """``TORCHACC_DEVICE_TYPE=xla`` (fresh process: the name is fixed per process) names the
    device ``xla``: ``t.device == torch.device('xla', 0)``, training as in eager, autocast('xla');
    a bad name is one clear error."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=300, cwd=repo)
    case = os.path.join(repo, "tests", "xla_device_name_case.py")
    proc = run([sys.executable, case], env=dict(os.environ, TORCHACC_DEVICE_TYPE="xla"))
    assert proc.returncode == 0 and "xla device name ok" in proc.stdout, proc.stderr[-4000:]
    bad = run(
        [sys.executable, "-c", "import torchacc"], env=dict(os.environ, TORCHACC_DEVICE_TYPE="tpu")
    )
    assert bad.returncode != 0
    assert "TORCHACC_DEVICE_TYPE='tpu': the torchacc device can be named torchacc or xla" in (
        bad.stderr
    )


@pytest.mark.parametrize(
    "argv, name",
    [
        (["python", "-m", "torchacc.run_torch_xla", "train.py"], "xla"),
        (["python", "-u", "-W", "ignore", "-mtorchacc.run_torch_xla", "-m", "pkg"], "xla"),
        (
            ["python", "-m", "torch.distributed.run", "-m", "torchacc.run_torch_xla", "t.py"],
            "torchacc",
        ),
        (["python", "train.py", "-m", "torchacc.run_torch_xla"], "torchacc"),
        (["python", "-c", "import torchacc"], "torchacc"),
    ],
)
def test_run_torch_xla_processes_name_the_device_xla(monkeypatch, argv, name):
    """Note [The device's name]: the interpreter's own ``-m torchacc.run_torch_xla`` (torchrun's
    workers are started that way; its agent process is not) names the device ``xla``."""
    import sys

    from torchacc.lazy import device as device_mod

    monkeypatch.setattr(sys, "orig_argv", argv)
    assert device_mod._default_type() == name


def test_preemption_sync_point_after_sigterm_in_one_process():
    """``_XLAC._activate_preemption_sync_manager``: no sync point until a SIGTERM arrives, then
    the next step asked about is one; deactivating restores the previous SIGTERM handler."""
    import os
    import signal

    from torchacc.torch_xla import _XLAC

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RuntimeError, match="not active"):
        _XLAC._sync_point_reached(0)
    _XLAC._activate_preemption_sync_manager()
    try:
        assert not any(_XLAC._sync_point_reached(step) for step in range(3))
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process keeps running
        assert _XLAC._sync_point_reached(3)
    finally:
        _XLAC._deactivate_preemption_sync_manager()
    assert signal.getsignal(signal.SIGTERM) == before
