"""``--tensorboard DIR`` and ``--profile START:STOP`` of the launcher (issue 31): event files that
TensorBoard's ``EventAccumulator`` parses, equal to the run's ``--output`` JSON, written without a
device read of their own; a jax.profiler capture of 3 steps naming the XLA program executions and
the ``StepTrace`` regions; and the bad inputs (exit 2, one line, before anything starts).

The eager path's scalars (2 processes, GradScaler) and torch.profiler capture are checked in
tests/test_gallery_gpt.py (the two-process fp16 run).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import subprocess
import sys

import prewarmed
import pytest
from gallery_harness import ROOT, child_env, launcher_checks, read_tensorboard, run_launcher

from gallery.common.launchlib import torchacc_launch

launch = torchacc_launch()
checks = launcher_checks()
WORKER = ROOT / "benchmarks" / "_worker.py"
GPT = ["--model=gpt-tiny", "--seq_len=16", "--batch_size=4", "--max_steps=6", "--log_interval=4"]


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, p.stdout, p.stderr)
    assert "[launch]" not in p.stdout and "Traceback" not in p.stderr
    return lines[0]


# ----------------------------------------------------------------------------- flags
def test_flags_parse_and_reach_the_workers():
    args = launch.parse_args(["--tensorboard", "tb", "--profile", "10:13"])
    assert args.profile == "10:13" and args.profile_dir == "tb"  # the profile goes under DIR
    argv = launch.worker_argv(args)
    assert argv[argv.index("--profile") + 1] == "10:13"
    assert launch.parse_args(argv).profile_dir == "tb"
    args = launch.parse_args(["--profile", "0:2", "--profile_dir", "p", "--tensorboard", "tb"])
    assert args.profile_dir == "p"
    assert launch.parse_args([]).tensorboard is None


@pytest.mark.parametrize("value", ["3", "a:b", "-1:3", "2:", ":4"])
def test_profile_value_that_is_not_a_window_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as e:
        launch.parse_args([f"--profile={value}"])
    assert e.value.code == 2
    assert "expected START:STOP (two integers >= 0" in capsys.readouterr().err


def test_observe_rules(tmp_path):
    def ns(**kw):
        return argparse.Namespace(**{"tensorboard": None, "profile": None, **kw})

    none = lambda name: False  # noqa: E731 - nothing is installed
    only_x = lambda name: name == "tensorboardX"  # noqa: E731
    assert checks.tensorboard_writer_package(only_x) == "tensorboardX"
    assert checks.tensorboard_writer_package(none) is None
    assert checks.observe_errors(ns(tensorboard="tb"), importable=only_x) is None
    assert checks.observe_errors(ns(tensorboard="tb"), importable=none) == (
        "--tensorboard tb: needs the tensorboard package (pip install tensorboard) or "
        "tensorboardX; neither is installed"
    )
    window = ns(profile="3:3", profile_dir="p", max_steps=None)
    assert "START must be < STOP" in checks.observe_errors(window)
    window.profile = "1:4"
    assert checks.observe_errors(window) is None
    assert checks.observe_errors(window, total_steps=3) == (
        "--profile 1:4: STOP 4 is beyond the run's 3 steps"
    )
    window.max_steps = 3
    assert checks.observe_errors(window) == "--profile 1:4: STOP 4 is beyond --max_steps 3"
    window.max_steps, window.profile_dir = 4, None
    assert "--profile needs a directory" in checks.observe_errors(window)
    errors = checks.path_errors(ns(tensorboard=str(tmp_path / "new" / "tb")))
    assert errors == [] and (tmp_path / "new" / "tb").is_dir()  # created, like --save_dir


# ----------------------------------------------------------------------------- bad input
@pytest.mark.timeout(120)
def test_bad_tensorboard_and_profile_fail_before_anything_starts(tmp_path):
    (tmp_path / "file").write_text("x")
    tb = tmp_path / "tb"
    cases = [
        (
            ["--tensorboard", tmp_path / "file" / "tb"],
            f"--tensorboard {tmp_path / 'file' / 'tb'}: cannot write there (Not a directory)",
        ),
        (["--tensorboard", tb, "--profile", "5:5"], "--profile 5:5: START must be < STOP"),
        (["--tensorboard", tb, "--profile", "2:7"], "--profile 2:7: STOP 7 is beyond --max_steps"),
        (["--profile", "1:3"], "--profile needs a directory: --profile_dir DIR, or --tensorboard"),
    ]
    for flags, message in cases:
        # no --seq_len: parsing does not import torch (gpt's block size), the errors come fast
        p = run_launcher("--model=gpt-tiny", "--max_steps=6", *flags, expect_rc=None, timeout=60)
        line = _one_error_line(p)
        assert line.startswith("launch_single_task.py: error: ") and message in line, line
    assert not list(tb.glob("events.*"))  # nothing started


@pytest.mark.timeout(120)
def test_tensorboard_without_a_writer_package_is_one_line():
    code = (
        "import runpy, sys; sys.modules['tensorboard'] = sys.modules['tensorboardX'] = None; "
        f"sys.argv = ['launch_single_task.py', *sys.argv[1:]]; "
        f"runpy.run_path({str(ROOT / 'launch_single_task.py')!r}, run_name='__main__')"
    )
    p = prewarmed.run(
        ["-c", code, "--model=gpt-tiny", "--tensorboard", "tb"],
        env=child_env(),
        cwd=ROOT,
        timeout=60,
    )
    assert _one_error_line(p) == (
        "launch_single_task.py: error: --tensorboard tb: needs the tensorboard package (pip "
        "install tensorboard) or tensorboardX; neither is installed"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_profile_beyond_an_epoch_based_run_is_refused_by_the_worker(tmp_path):
    """Without --max_steps the run's length is known once the data set is: the worker says so."""
    p = subprocess.run(
        [sys.executable, "-m", "gallery.gpt.main", *GPT[:3], "--mock_samples=8"]
        + ["--profile=1:5", f"--profile_dir={tmp_path}"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert lines == ["error: --profile 1:5: STOP 5 is beyond the run's 2 steps"], p.stderr


# ----------------------------------------------------------------------------- compiler path
def _worker_run(out_dir, *flags):
    """One compiler-path run in place (benchmarks/_worker.py): its --output JSON, torchacc's
    counters and timings, and its stdout."""
    out, metrics = out_dir / "m.json", out_dir / "metrics.json"
    p = subprocess.run(
        [sys.executable, str(WORKER), str(metrics), "--", *GPT, "--compiler-opt"]
        + ["--amp_level=O1", f"--output={out}", *map(str, flags)],
        cwd=ROOT,
        env=child_env({"TORCHACC_CACHE_DIR": "off"}),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return json.loads(out.read_text()), json.loads(metrics.read_text())["torchacc"], p.stdout


def _events(xplane: str) -> list[tuple[str, str, float, float, dict]]:
    """(line, name, start ns, end ns, stats) of every event in a jax.profiler capture."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane)
    return [
        (line.name, ev.name, ev.start_ns, ev.start_ns + ev.duration_ns, dict(ev.stats))
        for plane in data.planes
        for line in plane.lines
        for ev in line.events
    ]


@pytest.fixture(scope="module")
def compiler_runs(tmp_path_factory):
    """gpt-tiny on the compiler path, 6 steps: with --tensorboard and --profile 2:5, and
    without either."""
    base = tmp_path_factory.mktemp("observe")
    (base / "on").mkdir()
    (base / "off").mkdir()
    tb = base / "tb"
    on = _worker_run(base / "on", "--tensorboard", tb, "--profile", "2:5")
    off = _worker_run(base / "off")
    return tb, on, off


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.xdist_group("observe_compiler_runs")  # one fixture run for both tests
def test_compiler_path_scalars_match_the_run_and_cost_no_device_read(compiler_runs):
    tb, (m, counters, stdout), (m_off, counters_off, _) = compiler_runs
    scalars, acc = read_tensorboard(tb)
    assert f"TensorBoard scalars: {tb}" in stdout
    # one train/loss point per step (the log fetched them 4 at a time), equal to --output's
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(m["losses"], rel=1e-6)
    # the interval values of the progress lines (steps 4 and 6)
    intervals = m["intervals"]
    assert [s for s, _ in scalars["train/samples_per_sec"]] == [i["step"] for i in intervals]
    assert [v for _, v in scalars["train/samples_per_sec"]] == pytest.approx(
        [i["samples_per_sec"] for i in intervals], rel=1e-6
    )
    assert [v for _, v in scalars["train/step_time_ms"]] == pytest.approx(
        [1000.0 * i["batch_time"] for i in intervals], rel=1e-6
    )
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([6e-4, 6e-4])
    peak = [v for _, v in scalars["memory/peak_bytes"]]
    assert peak == pytest.approx([i["peak_mem_gib"] * 2**30 for i in intervals], rel=1e-6)
    source = acc.Tensors("memory/peak_bytes_source/text_summary")
    assert [e.tensor_proto.string_val[0].decode() for e in source] == ["host_rss"]
    compiles = counters["counters"]["UncachedCompile"]
    assert [v for _, v in scalars["compile/count"]] == [compiles, compiles]
    assert scalars["compile/seconds"][-1][1] == pytest.approx(
        sum(counters["timings"]["CompileTime"]), rel=1e-5
    )
    assert "amp/loss_scale" not in scalars  # bf16: no GradScaler
    # the run's flags, once, as hparams
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["model"].string_value == "gpt-tiny" and hp["mode"].string_value == "torchacc"
    assert hp["batch_size"].number_value == 4 and hp["profile"].string_value == "2:5"
    # nothing extra was read from the device, nothing compiled differently, same numerics
    c, c_off = counters["counters"], counters_off["counters"]
    assert c["TransferFromDevice"] == c_off["TransferFromDevice"]
    assert c["UncachedCompile"] == c_off["UncachedCompile"]
    assert m["losses"] == m_off["losses"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.xdist_group("observe_compiler_runs")  # one fixture run for both tests
def test_profile_of_three_steps_names_program_executions_and_step_regions(compiler_runs):
    tb, (m, _, stdout), _ = compiler_runs
    runs = glob.glob(str(tb / "plugins" / "profile" / "*"))
    assert len(runs) == 1
    assert f"profile of steps 3..5 (jax.profiler): {runs[0]}" in stdout
    assert f"open it with `tensorboard --logdir {tb}`" in stdout
    assert glob.glob(runs[0] + "/perfetto_trace.json.gz")  # Perfetto opens this one
    (xplane,) = glob.glob(runs[0] + "/*.xplane.pb")
    events = _events(xplane)
    steps = [e for e in events if e[1] == "train_step"]
    assert sorted(int(e[4]["step_num"]) for e in steps) == [3, 4, 5]
    calls = [e for e in events if e[1].startswith("PjitFunction(")]
    # a launch is a PjitFunction event not nested in another one (jax reports nested layers)
    launches = [e for e in calls if not any(o is not e and o[2] <= e[2] and e[3] <= o[3]
                                            for o in calls)]  # fmt: skip
    for _, _, start, end, stats in steps:
        # each StepTrace region launched the step's XLA program (its mark_step) exactly once
        inside = [e for e in launches if start <= e[2] and e[3] <= end]
        assert len(inside) == 1, (stats, [e[1] for e in inside])
    # and XLA ran programs on its own threads
    assert any(e[1].startswith("ThunkExecutor::Execute") for e in events)
    assert math.isfinite(m["summary"]["final_loss"])
