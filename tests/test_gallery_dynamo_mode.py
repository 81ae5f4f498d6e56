"""``--compiler-opt --compile_mode=dynamo``: the gallery step through torchacc.dynamo.compile_step,
run by the real launcher, against the eager run (one process at O0 and bf16; two processes with
fp16 and GradScaler against eager DDP); and what the mode refuses (rc 2, one line)."""

from __future__ import annotations

import pytest
from gallery_harness import load_metrics, run_launcher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

GPT = ["--model=gpt-tiny", "--seq_len=16", "--batch_size=2", "--log_interval=1"]
DYNAMO = ("--compiler-opt", "--compile_mode=dynamo")
# One ulp of bf16 relative to the loss: eager CPU autocast and the traced step may round a few
# ops differently (measured on gpt-tiny, 3 steps: relative differences 0, 5e-5, 2e-5).
BF16_RTOL = 2.0**-8
# fp16 autocast: measured 3e-6 relative on gpt-tiny x2, 3 steps; a few fp16 ulps of headroom
FP16_RTOL = 2.0**-10


_runs: dict = {}


def _train(tmp_path_factory, *flags):
    """Run the launcher once per distinct command line in this module (tests share runs)."""
    if flags not in _runs:
        out = tmp_path_factory.mktemp("run") / "metrics.json"
        p = run_launcher(*GPT, "--max_steps=3", *flags, f"--output={out}", timeout=360)
        _runs[flags] = (p, load_metrics(out))
    return _runs[flags]


# The first two tests share the O0 dynamo run (_runs): on one xdist worker it runs once
@pytest.mark.xdist_group("dynamo_mode_o0")
def test_dynamo_mode_matches_eager_at_O0(tmp_path_factory):
    _, eager = _train(tmp_path_factory, "--amp_level=O0")
    p, dyn = _train(tmp_path_factory, "--amp_level=O0", *DYNAMO)
    assert "[summary] gpt-tiny torchacc-dynamo x1 cpu O0/fp32" in p.stdout
    assert dyn["config"]["compile_mode"] == "dynamo" and dyn["config"]["mode"] == "torchacc-dynamo"
    assert dyn["steps"] == eager["steps"] == [0, 1, 2]
    for i, (d, e) in enumerate(zip(dyn["losses"], eager["losses"], strict=True)):
        assert abs(d - e) <= 1e-4 * abs(e), (i, dyn["losses"], eager["losses"])
    # step 1 runs eagerly, step 2 traces the whole step once; step 3 only launches the program
    assert dyn["summary"]["compiled_steps"] == [1, 2]
    assert "step 2 traces and compiles the whole step" in p.stdout


@pytest.mark.xdist_group("dynamo_mode_o0")
def test_dynamo_mode_bf16_autocast(tmp_path_factory):
    amp = ("--amp_level=O1", "--amp_dtype=bf16")
    _, eager = _train(tmp_path_factory, *amp)
    p, dyn = _train(tmp_path_factory, *amp, *DYNAMO)
    _, fp32 = _train(tmp_path_factory, "--amp_level=O0", *DYNAMO)
    assert "torchacc-dynamo x1 cpu O1/bf16" in p.stdout
    for i, (d, e) in enumerate(zip(dyn["losses"], eager["losses"], strict=True)):
        assert abs(d - e) <= BF16_RTOL * abs(e), (i, dyn["losses"], eager["losses"])
    # the compiled steps (2 and 3) really ran in bf16: fp32 gives other numbers
    assert dyn["losses"][1:] != fp32["losses"][1:]


def test_dynamo_mode_two_processes_fp16_grad_scaler_matches_eager_ddp(tmp_path_factory):
    """The compiled step all-reduces the gradients (xm.all_reduce, no DDP) and runs the fp16
    GradScaler on the device; eager runs DDP + torch.amp.GradScaler."""
    flags = ("--amp_level=O1", "--amp_dtype=fp16", "--nproc_per_node=2")
    _, eager = _train(tmp_path_factory, *flags)
    p, dyn = _train(tmp_path_factory, *flags, *DYNAMO)
    assert "torchacc-dynamo x2 cpu O1/fp16" in p.stdout and "O1/fp16+GradScaler" in p.stdout
    for i, (d, e) in enumerate(zip(dyn["losses"], eager["losses"], strict=True)):
        assert abs(d - e) <= FP16_RTOL * abs(e), (i, dyn["losses"], eager["losses"])
    assert dyn["summary"]["compiled_steps"] == [1, 2]


def _one_error_line(p) -> str:
    lines = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    assert len(lines) == 1, p.stderr
    return lines[0]


def test_launcher_refuses_dynamo_without_compiler_opt():
    p = run_launcher(*GPT, "--max_steps=1", "--compile_mode=dynamo", expect_rc=None, timeout=60)
    line = _one_error_line(p)
    for w in ["--compile_mode=dynamo", "--compiler-opt"]:
        assert w in line, line
    assert "[launch]" not in p.stdout  # refused before any worker started
