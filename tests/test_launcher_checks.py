"""The launcher's checks before anything starts (issue 19 items 1, 2, 4, 9; issue 13 item 2):
each problem is exit code 2 and one line naming the flag, the path or the limit, from a real
launcher process. Also the pieces behind them (peak memory, mismatch rule, checkpoint loading)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest
import torch
from gallery_harness import ROOT, child_env, launcher_checks, run_launcher

from gallery.common import checkpoint, logger

checks = launcher_checks()


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert p.returncode == 2 and "[launch]" not in p.stdout, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    return lines[0]


# ----------------------------------------------------------------------------- processes
@pytest.mark.timeout(120)
def test_more_processes_than_devices_is_refused_before_anything_starts():
    limit, what = checks.device_limit(compiler_opt=False)
    t0 = time.monotonic()
    p = run_launcher("--model=gpt-tiny", f"--nproc_per_node={limit + 1}", expect_rc=None)
    line = _one_error_line(p)
    assert f"--nproc_per_node {limit + 1} exceeds this node's {what}" in line
    assert f"use --nproc_per_node <= {limit}" in line
    p = run_launcher("--model=gpt-tiny", "--nproc_per_node=10000", expect_rc=None)
    assert "--nproc_per_node 10000 exceeds" in _one_error_line(p)
    assert time.monotonic() - t0 < 60


def test_nproc_rule():
    limit, what = checks.device_limit(compiler_opt=False)
    assert checks.nproc_error(limit, False, False) is None
    err = checks.nproc_error(limit + 1, False, False)
    assert err is not None and str(limit) in err
    if "GPU" in what:  # GPUs take one process each, --oversubscribe or not
        assert checks.nproc_error(limit + 1, False, True) is not None
    else:
        assert "--oversubscribe" in err
        assert checks.nproc_error(limit + 1, False, True) is None


# ----------------------------------------------------------------------------- paths
@pytest.mark.timeout(120)
def test_unusable_path_flags_fail_at_start():
    p = run_launcher(
        "--model=gpt-tiny", "--max_steps=1", "--save_dir=/etc/passwd/ck", expect_rc=None
    )
    assert "--save_dir /etc/passwd/ck: cannot write there (Not a directory)" in _one_error_line(p)


def test_path_rules(tmp_path):
    for flag, path, message in [
        ("save_dir", "/proc/ckpts", "--save_dir /proc/ckpts: cannot write there"),
        ("output", "/proc/torchacc/m.json", "--output /proc/torchacc/m.json: cannot write in"),
        ("data", str(tmp_path / "gone"), f"--data {tmp_path / 'gone'}: does not exist"),
    ]:
        errors = checks.path_errors(argparse.Namespace(**{flag: path}))
        assert len(errors) == 1 and errors[0].startswith(message), errors
    a = argparse.Namespace(
        save_dir=str(tmp_path / "new" / "ck"),
        output=str(tmp_path),
        data="mock",
        resume=str(tmp_path / "none.pt"),
        compiler_opt=True,
    )
    errors = checks.path_errors(a, environ={"TORCHACC_CACHE_DIR": "/proc/cache"})
    assert (tmp_path / "new" / "ck").is_dir()  # a missing --save_dir is created, not an error
    assert errors == [
        f"--output {tmp_path}: is a directory, expected a file name",
        f"--resume {tmp_path / 'none.pt'}: does not exist",
        "TORCHACC_CACHE_DIR /proc/cache: cannot write there (No such file or directory)",
    ]
    (tmp_path / "file").write_text("x")
    a = argparse.Namespace(save_dir=str(tmp_path / "file"), output=None, data="mock")
    assert checks.path_errors(a) == [
        f"--save_dir {tmp_path / 'file'}: exists and is not a directory"
    ]
    a.save_dir, a.compiler_opt = None, True
    assert checks.path_errors(a, environ={"TORCHACC_CACHE_DIR": "off"}) == []


# ----------------------------------------------------------------------------- checkpoints
class _Payload:
    """Unpickling this runs code: it creates ``marker``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(path, model_state=None, **extra):
    state = {"model": model_state or {}, "optimizer": {}, "step": 1, **extra}
    torch.save(state, path)
    return path


@pytest.mark.timeout(120)
def test_crafted_checkpoint_does_not_run_its_payload(tmp_path):
    marker = tmp_path / "pwned"
    evil = _checkpoint(tmp_path / "evil.pt", {"w": _Payload(marker)}, model_name="gpt-tiny")
    p = run_launcher("--model=gpt-tiny", f"--resume={evil}", expect_rc=None)
    line = _one_error_line(p)
    assert not marker.exists()
    assert f"--resume {evil}: refused to load" in line and "posix.system" in line
    assert "weights_only=True" in line
    # the same file unpickled the unsafe way would have run it: the test's payload is real
    torch.load(evil, weights_only=False)
    assert marker.exists()


@pytest.mark.timeout(120)
def test_resume_from_a_file_that_is_not_a_checkpoint(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("garbage\n")
    p = run_launcher("--model=gpt-tiny", f"--resume={text}", expect_rc=None)
    assert f"--resume {text}: not a checkpoint" in _one_error_line(p)


def test_resume_checks_of_the_launcher(tmp_path):
    from gallery.common.launchlib import torchacc_launch

    launch = torchacc_launch()
    other = _checkpoint(tmp_path / "other.pt", model_name="gpt-tiny")
    args = launch.parse_args(["--model=resnet50", f"--resume={other}"])
    assert launch._check_resume(args) == (
        f"--resume {other}: checkpoint of model gpt-tiny, but this run trains resnet50"
    )
    torch.save({"weights": torch.zeros(2)}, tmp_path / "plain.pt")
    args = launch.parse_args(["--model=gpt-tiny", f"--resume={tmp_path / 'plain.pt'}"])
    assert "not a training checkpoint of this trainer" in launch._check_resume(args)
    (tmp_path / "ck").mkdir()
    good = _checkpoint(tmp_path / "ck" / "checkpoint_00000003.pt", model_name="gpt-tiny")
    args = launch.parse_args(["--model=gpt-tiny", f"--resume={tmp_path / 'ck'}"])
    assert launch._check_resume(args) is None and args.resume == str(good)  # workers get the file


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    good = _checkpoint(tmp_path / "checkpoint_00000002.pt")
    newest = tmp_path / "checkpoint_00000004.pt"
    data = good.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # a save cut short
    warnings = []
    path, state = checkpoint.resolve_checkpoint(str(tmp_path), warn=warnings.append)
    assert path == str(good) and state["step"] == 1
    assert len(warnings) == 1 and str(newest) in warnings[0] and "damaged" in warnings[0]
    good.write_bytes(b"")  # both bad: one line naming the directory
    with pytest.raises(checkpoint.CheckpointError, match="no loadable checkpoint"):
        checkpoint.resolve_checkpoint(str(tmp_path))


def test_checkpoint_of_another_configuration_says_what_differs(tmp_path, capsys):
    from gallery.common import trainer
    from gallery.gpt.model import build_gpt

    class Args:
        resume = str(_checkpoint(tmp_path / "c.pt", build_gpt("gpt-mini").state_dict()))

    task = argparse.Namespace(name="gpt-tiny")
    with pytest.raises(SystemExit) as e:
        trainer._load_resume(Args, task, build_gpt("gpt-tiny"), 0, logger.create_logger())
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err == (
        f"error: --resume {Args.resume}: the checkpoint does not fit gpt-tiny: 24 unexpected "
        "(e.g. h.2.ln_1.weight); shape of wte.weight (8192, 256) in the checkpoint vs (512, 64) "
        "here (+28 more)"
    )


# ----------------------------------------------------------------------------- CUDA vs JAX
def test_cuda_jax_mismatch_rule():
    no_gpu = checks.cuda_jax_mismatch(0, [], environ={})
    assert no_gpu is None
    msg = checks.cuda_jax_mismatch(2, [], environ={})
    assert "torch sees 2 CUDA GPU(s)" in msg and ".[cuda12]" in msg and "TORCHACC_DEVICE=cpu" in msg
    assert checks.cuda_jax_mismatch(2, [], environ={"TORCHACC_DEVICE": "cpu"}) is None
    assert checks.cuda_jax_mismatch(1, ["jax-cuda12-plugin"], environ={}) is None
    hidden = checks.cuda_jax_mismatch(1, ["jax-cuda12-plugin"], environ={"JAX_PLATFORMS": "cpu"})
    assert "JAX_PLATFORMS=cpu" in hidden
    broken = checks.cuda_jax_mismatch(1, ["jax-cuda13-plugin"], environ={}, jax_sees_gpu=False)
    assert "jax-cuda13-plugin) found no usable GPU" in broken
    assert checks.cuda_jax_mismatch(1, [], environ={}, jax_sees_gpu=True) is None


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_compiler_opt_refused_when_jax_cannot_see_the_gpu():
    if checks.cuda_device_count() == 0:
        pytest.skip("torch sees no CUDA GPU")
    p = run_launcher(
        "--model=gpt-tiny", "--compiler-opt", env={"JAX_PLATFORMS": "cpu"}, expect_rc=None
    )
    assert "so torchacc (--compiler-opt) would run on XLA:CPU" in _one_error_line(p)
    p = run_launcher(
        "--model=gpt-tiny", "--compiler-opt", "--max_steps=1", "--seq_len=16", "--batch_size=2",
        env={"JAX_PLATFORMS": "cpu", "TORCHACC_DEVICE": "cpu"},
    )  # fmt: skip
    assert "XLA:CPU" in p.stdout  # TORCHACC_DEVICE=cpu says the CPU is meant


def test_installed_plugins_are_listed_without_starting_jax():
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        "from gallery.common.launchlib import torchacc_launch\n"
        "print(torchacc_launch().checks.jax_cuda_plugins())\n"
        "assert 'jax' not in sys.modules\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env()
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("[")


# ----------------------------------------------------------------------------- memory
def test_peak_memory_never_goes_down():
    readings = iter([4.5, 4.4, 4.6, 1.0])
    try:
        logger.set_peak_memory_fn(lambda: next(readings) * 2**30, "xla")
        assert [logger.peak_memory_gib() for _ in range(4)] == [
            (4.5, "xla"), (4.5, "xla"), (4.6, "xla"), (4.6, "xla"),
        ]  # fmt: skip
        logger.reset_peak_memory_fn()
        rss, src = logger.peak_memory_gib()
        import resource

        assert src == "host_rss"
        assert rss == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    finally:
        logger.reset_peak_memory_fn()


def test_seed_once_unless_the_model_draws_random_numbers():
    from torch import nn

    from gallery.common.trainer import _draws_random
    from gallery.gpt.model import build_gpt

    assert not _draws_random(build_gpt("gpt-tiny"))  # the gallery models: dropout 0
    assert _draws_random(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)))
