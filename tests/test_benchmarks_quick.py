"""benchmarks/run.py --quick, reduced: one model, eager + torchacc, one repeat."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_benchmarks_quick(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmarks", "run.py"),
        "--quick",
        "--models", "gpt2",
        "--modes", "eager,torchacc",
        "--repeats", "1",
        "--steps", "4",
        "--warmup", "1",
        "--timeout", "100",
        "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    data = json.loads((out / "results.json").read_text())
    rows = {s["mode"]: s for s in data["summary"]}
    assert set(rows) == {"eager", "torchacc"}

    eager = rows["eager"]
    assert eager["ok"] == 1 and not eager["errors"]
    assert eager["samples_per_sec"] > 0 and eager["step_time_ms"] > 0
    assert eager["first_step_s"] > 0 and eager["peak_mem_gib"] >= 0
    assert eager["speedup_vs_eager"] == pytest.approx(1.0)

    acc = rows["torchacc"]
    if acc["ok"]:
        assert acc["samples_per_sec"] > 0
        assert acc.get("compiles", 0) >= 1  # from torchacc.metrics
        assert acc.get("trace_ms_per_step") is not None
    else:  # the compiler path failed: recorded clearly, not a crash
        assert acc["errors"] and all(e.strip() for e in acc["errors"])
        run = next(r for r in data["runs"] if r["mode"] == "torchacc")
        assert os.path.exists(os.path.join(ROOT, run["log"]))

    md = (out / "results.md").read_text()
    assert "| gpt2 (gpt-tiny, b8) | eager |" in md
    assert "torchacc" in md


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
