"""benchmarks/run.py --quick, reduced: one model, eager + torchacc + torchacc-dynamo, one repeat."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(cwd, *flags):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), *flags]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)


@pytest.mark.slow
def test_benchmarks_quick(tmp_path):
    # A relative --out from another cwd: files land there and are reported as given.
    proc = _bench(
        tmp_path,
        "--quick",
        "--models", "gpt2",
        "--modes", "eager,torchacc,torchacc-dynamo",
        "--repeats", "1",
        "--steps", "4",
        "--warmup", "2",
        "--timeout", "150",
        "--out", "bench",
        "--tensorboard", "tb",
    )  # fmt: skip
    log = proc.stdout + proc.stderr
    # Every requested mode must succeed: a recorded error string is a failure.
    assert proc.returncode == 0, log
    out = tmp_path / "bench"
    assert "[bench] wrote bench/results.json, bench/results.md" in proc.stdout, log

    data = json.loads((out / "results.json").read_text())
    rows = {s["mode"]: s for s in data["summary"]}
    assert set(rows) == {"eager", "torchacc", "torchacc-dynamo"}
    for mode, row in rows.items():
        assert row["ok"] == 1 and not row["errors"], (mode, row)
        assert row["samples_per_sec"] > 0 and row["step_time_ms"] > 0
        assert row["samples_per_sec_min"] <= row["samples_per_sec"] <= row["samples_per_sec_max"]
        assert row["spread"] == 0.0  # one repeat
        assert row["label"] == "gpt-tiny (batch 8, seq 64)"
    for run in data["runs"]:
        assert (tmp_path / run["log"]).is_file() and run["log"].startswith("bench/runs/")
    # --tensorboard: one TensorBoard run per mode, side by side, with every step's loss
    from gallery_harness import read_tensorboard

    assert sorted(p.name for p in (tmp_path / "tb" / "gpt2").iterdir()) == sorted(rows)
    for mode in rows:
        scalars, _ = read_tensorboard(tmp_path / "tb" / "gpt2" / mode)
        assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4], mode
        assert scalars["train/samples_per_sec"][0][0] == 4  # --log_interval is --steps
        assert ("compile/count" in scalars) == (mode != "eager"), mode

    eager, acc = rows["eager"], rows["torchacc"]
    assert eager["first_step_s"] > 0 and eager["peak_mem_gib"] >= 0
    assert eager["speedup_vs_eager"] == pytest.approx(1.0)
    assert acc.get("compiles", 0) >= 1  # from torchacc.metrics
    assert acc.get("trace_ms_per_step") is not None
    # compile_step counts its own compiles in torchacc.metrics: the whole step is one program,
    # traced once (step 1 eager, step 2 traces), never recompiled
    dyn = rows["torchacc-dynamo"]
    assert (dyn["compiles"], dyn["recompiles"], dyn["step_traces"]) == (1, 0, 1), dyn

    # The busy-box verdict follows from the recorded load samples (one repeat: no spread).
    meta = data["meta"]
    assert len(meta["loadavg"]) == 2 * len(data["runs"])
    assert meta["busy"] == (max(meta["loadavg"]) > meta["cores"])
    assert ("WARNING: busy box" in proc.stdout) == meta["busy"]

    md = (out / "results.md").read_text()
    assert "| gpt-tiny (batch 8, seq 64) | eager |" in md
    assert "| gpt-tiny (batch 8, seq 64) | torchacc |" in md
    assert "| gpt-tiny (batch 8, seq 64) | torchacc-dynamo |" in md and "| 1 / 0 |" in md
    assert "gpt2" not in md.split("|", 1)[1]  # the quick run is never labelled gpt2
    assert ("WARNING: busy box" in md) == meta["busy"]


@pytest.mark.slow
def test_benchmarks_exit_nonzero_naming_failed_run(tmp_path):
    # A launcher flag error fails in seconds, before any model is built.
    proc = _bench(
        tmp_path,
        "--quick",
        "--models", "gpt2",
        "--modes", "eager",
        "--extra=--no_such_flag",
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[bench] FAILED: 1 of 1 runs:" in proc.stderr
    named = "gpt2 eager repeat 1: launch_single_task.py: error: unrecognized arguments: --no_such"
    assert named in proc.stderr, proc.stderr
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert data["summary"][0]["ok"] == 0 and "--no_such_flag" in data["summary"][0]["errors"][0]


@pytest.mark.slow
def test_trace_overhead_reports_paired_ratios(tmp_path):
    out = tmp_path / "trace.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "trace_overhead.py"),
        "--models", "gpt",
        "--steps", "2",
        "--repeats", "3",
        "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads(out.read_text())
    assert row["model"] == "gpt" and row["ops_per_step"] > 0
    assert len(row["repeat_ratios"]) == 3 and all(r > 0 for r in row["repeat_ratios"])
    # the ratio is the median of the per-repeat paired ratios, not a ratio of medians
    assert row["ratio"] == sorted(row["repeat_ratios"])[1]
    assert row["us_per_op"] == pytest.approx(row["traced_step_ms"] * 1e3 / row["ops_per_step"])
