"""MFU while it runs (issue 41 part 4): the step program's FLOPs from XLA's cost analysis, read once
per compile and counted per launch at no cost (Note [Step FLOPs] in torchacc/metrics.py); the
GPU XLA flags' guard (Note [XLA GPU flags] in torchacc/_jaxconfig.py); the GPU check's smoke run."""

from __future__ import annotations

import json
import os

import prewarmed
import pytest
import torch

import torchacc
import torchacc.dynamo
from torchacc import _jaxconfig, metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _xla_flops(exe) -> float:
    costs = exe.cost_analysis()
    if isinstance(costs, (list, tuple)):
        costs = costs[0]
    return float(costs["flops"])


@pytest.fixture
def compiled(monkeypatch):
    """Every executable a compile path hands to ``metrics.program_compiled``."""
    seen = []
    real = metrics.program_compiled

    def spy(exe, flops=None):
        seen.append(exe)
        return real(exe, flops)

    monkeypatch.setattr(metrics, "program_compiled", spy)
    metrics.clear_all()
    return seen


def _mlp(device=None):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return m.to(device) if device is not None else m


def test_lazy_step_flops_are_the_compiled_programs_cost_analysis(compiled):
    dev = torchacc.device()
    model = _mlp(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16).to(dev)
    torchacc.sync()
    metrics.clear_counters()
    seen_before = len(compiled)
    steps, reads = 6, []
    for _ in range(steps):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torchacc.sync()
        reads.append(metrics.executed_flops())  # what a log line reads: no sync, no compile
    step_exes = compiled[seen_before:]
    assert len(step_exes) == 1, "one step program"
    flops = _xla_flops(step_exes[0])
    assert flops > 0
    assert metrics.program_flops(step_exes[0]) == flops
    assert metrics.last_program_flops() == flops
    assert reads == [flops * (i + 1) for i in range(steps)]
    # reading the FLOPs every step cost no sync, read or compile of its own
    assert metrics.counter_value("MarkStep") == steps
    assert metrics.counter_value("UncachedCompile") in (None, 1)
    assert metrics.counter_value("ReadSync") is None
    assert metrics.counter_value("TransferFromDevice") is None
    n, _, costs = metrics.metric_data("CostAnalysisTime")
    assert n == len(compiled)
    metrics.clear_counters()
    assert metrics.executed_flops() == 0.0 and metrics.last_program_flops() is None
    assert metrics.program_flops(step_exes[0]) == flops  # a program's FLOPs outlive the counters


def test_trace_once_step_flops_are_the_compiled_programs_cost_analysis(compiled):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    @torchacc.dynamo.compile_step
    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(5):
        step(x, y)
    programs = [e for e in compiled if metrics.program_flops(e)]
    assert len(programs) == 1, "the whole step is one program"
    flops = _xla_flops(programs[0])
    assert metrics.program_flops(programs[0]) == flops
    launched = metrics.counter_value("DynamoExecute")
    assert launched >= 3  # the first call runs eagerly, the second traces
    assert metrics.executed_flops() == pytest.approx(flops * launched)
    assert metrics.last_program_flops() == flops


def test_unknown_flops_are_not_recorded():
    class NoCosts:
        def cost_analysis(self):
            raise NotImplementedError("no cost analysis on this backend")

    class ZeroCosts:
        def cost_analysis(self):
            return [{"bytes accessed": 8.0}]  # older JAX: a list, and no "flops"

    metrics.clear_counters()
    for exe in (NoCosts(), ZeroCosts()):
        metrics.program_compiled(exe)
        metrics.program_ran(exe)
        assert metrics.program_flops(exe) is None
    assert metrics.executed_flops() == 0.0


def test_program_flops_leave_with_the_executable():
    class Exe:
        def cost_analysis(self):
            return {"flops": 12.0}

    exe = Exe()
    metrics.program_compiled(exe)
    key = id(exe)
    assert metrics._program_flops[key] == 12.0
    del exe
    assert key not in metrics._program_flops


_SPMD_STEP = """
import json, sys
import numpy as np
import torch
import torchacc
from torchacc import metrics
import torchacc.torch_xla.distributed.spmd as xs
import torchacc.torch_xla.runtime as xr

xr.use_spmd()
dev = torchacc.device()
torch.manual_seed(0)
model = torch.nn.Linear(64, 64).to(dev)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(256, 64).to(dev)
xs.mark_sharding(x, xs.Mesh(np.arange(4), (4,), ("data",)), ("data", None))
for _ in range(3):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    torchacc.sync()
print("FLOPS", json.dumps(metrics.last_program_flops()))
"""


@pytest.mark.slow
def test_spmd_step_flops_are_per_device():
    """A step whose batch is split over 4 devices: its program's FLOPs are one device's share
    (the matmuls / 4; the replicated update is small), what MFU per device divides."""
    env = dict(os.environ, CPU_NUM_DEVICES="4", JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = prewarmed.run(["-c", _SPMD_STEP], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FLOPS "))
    per_device = json.loads(line[6:])
    dev = torchacc.device()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 64).to(dev)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        torchacc.sync()
    whole = metrics.last_program_flops()
    assert 3.8 < whole / per_device <= 4.0, (whole, per_device)


# ----------------------------------------------------------------------------- XLA GPU flags
def _fake_binaries(tmp_path, monkeypatch, text: bytes):
    plugin = tmp_path / "xla_cuda_plugin.so"
    plugin.write_bytes(b"\0" * 64 + text + b"\0" * 64)
    monkeypatch.setattr(_jaxconfig, "_gpu_plugin_binaries", lambda: [str(plugin)])
    monkeypatch.setattr(_jaxconfig, "_xla_binaries", lambda: [])


def test_gpu_flags_added_only_when_xla_knows_them(tmp_path, monkeypatch):
    flag = _jaxconfig.GPU_XLA_FLAGS[0]
    name = flag.split("=")[0][2:].encode()
    _fake_binaries(tmp_path, monkeypatch, b"other flags\0" + name + b"\0more")
    assert _jaxconfig.gpu_xla_flags("", env={}) == flag
    assert (
        _jaxconfig.gpu_xla_flags("--xla_dump_to=/tmp/d", env={}) == f"--xla_dump_to=/tmp/d {flag}"
    )
    # the user's value wins, either way
    mine = flag.split("=")[0] + "=false"
    assert _jaxconfig.gpu_xla_flags(mine, env={}) == mine
    assert _jaxconfig.gpu_xla_flags("", env={"TORCHACC_XLA_GPU_FLAGS": "0"}) == ""
    # an XLA that does not know the flag never sees it (it would abort the process); nor one
    # where the name is only part of a longer string
    for text in (b"xla_gpu_something_else", b"\0xla." + name + b"\0", b"\0" + name + b"_v2\0"):
        _fake_binaries(tmp_path, monkeypatch, text)
        assert _jaxconfig.gpu_xla_flags("", env={}) == "", text


def test_no_gpu_flags_on_a_cpu_only_install(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert _jaxconfig._gpu_plugin_binaries() == []
    assert _jaxconfig.gpu_xla_flags("--xla_foo=1") == "--xla_foo=1"


# ----------------------------------------------------------------------------- the GPU check
@pytest.mark.slow
def test_gpu_check_smoke_one_run(tmp_path):
    """benchmarks/gpu_check.py --smoke: one run end to end on the CPU, its row and table."""
    out = tmp_path / "gc"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = prewarmed.run(
        [
            os.path.join(ROOT, "benchmarks", "gpu_check.py"),
            "--smoke",
            "--no_plan",
            "--only",
            "gpt2.eager",
            "--out",
            str(out),
            "--peak_tflops",
            "1",
        ],
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(ln) for ln in (out / "results.jsonl").read_text().splitlines()]
    meta, row = lines[0]["meta"], lines[1]
    assert meta["smoke"] and meta["env"]["jax_platform"] == "cpu"
    assert row["id"] == "gpt2.eager" and "error" not in row, row
    assert row["tokens_per_sec"] > 0 and row["peak_mem_gib"] > 0
    # MFU: the analytic model FLOPs over the step time, against --peak_tflops
    flops = meta["model_flops"]["gpt2"]
    assert row["model_tflops"] == pytest.approx(flops / (row["step_ms"] / 1000) / 1e12)
    assert row["mfu"] == pytest.approx(row["model_tflops"] / 1.0)
    table = (out / "results.md").read_text()
    assert "| gpt-tiny (smoke) | eager |" in table and "tok/s" in table


def _load(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_bench_" + name, os.path.join(ROOT, "benchmarks", name + ".py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_table_shows_tflops_and_mfu():
    """benchmarks/run.py: model TFLOP/s and MFU over the step time, XLA's TFLOP/s for torchacc;
    MFU n/a on a CPU unless --peak_tflops."""
    run = _load("run")
    flops = _load("_flops")
    args = run.parse_args(["--quick", "--peak_tflops", "2"])
    flags = run.launcher_flags(args, "gpt2", "torchacc", False, "-")
    model_flops, how = flops.from_launcher_flags(flags)
    assert how == "6N+12LdT" and model_flops > 0
    row = {"step_time_ms": 100.0, "tokens_per_sec": 5120.0}
    got = run.flops_stats(args, flags, row, {"torchacc": {"step_flops": 5e9}}, None)
    assert got["tflops"] == pytest.approx(model_flops / 0.1 / 1e12)
    assert got["mfu"] == pytest.approx(got["tflops"] / 2.0)
    assert got["xla_tflops"] == pytest.approx(5e9 / 0.1 / 1e12)
    cpu = run.flops_stats(run.parse_args(["--quick"]), flags, row, None, None)
    assert cpu["mfu"] is None and "xla_tflops" not in cpu
    h100 = run.flops_stats(run.parse_args(["--quick"]), flags, row, None, "NVIDIA H100 80GB HBM3")
    assert h100["mfu"] == pytest.approx(model_flops / 0.1 / 989.4e12)
    summary = [
        {"label": "gpt-tiny", "mode": "torchacc", "ok": 1, "runs": 1, "errors": [],
         "samples_per_sec": 80.0, "samples_per_sec_min": 80.0, "samples_per_sec_max": 80.0,
         "spread": 0.0, "step_time_ms": 100.0, "first_step_s": 1.0, "peak_mem_gib": 0.5,
         **row, **{k: v for k, v in cpu.items()}}
    ]  # fmt: skip
    meta = {"device": "cpu", "amp_level": "O0", "repeats": 1, "steps": 4, "warmup": 2,
            "nproc": 1, "date": "d", "command": "c"}  # fmt: skip
    md = run.markdown(summary, meta)
    assert "| tokens/s | step ms | TFLOP/s (XLA) | MFU |" in md
    assert f"| 5,120 | 100.0 | {cpu['tflops']:.3g} | n/a |" in md


def test_model_flops_resnet50_is_the_published_count():
    """ResNet-50 at 224²: 4.1 GMACs forward (8.2 GFLOPs), x3 for forward + backward."""
    flops, how = _load("_flops").model_flops_per_step("resnet50", 1, image_size=224)
    assert 23.5e9 < flops < 25e9, flops


def test_flops_window_reports_the_steps_since_the_last_line():
    class Exe:
        def cost_analysis(self):
            return {"flops": 4e12}

    exe = Exe()
    metrics.clear_counters()
    metrics.program_compiled(exe)
    window = metrics.FlopsWindow()
    assert window.take(steps=3, seconds_per_step=0.1) is None  # nothing ran yet
    for _ in range(3):
        metrics.program_ran(exe)
    got = window.take(steps=3, seconds_per_step=0.1, peak_flops=80e12)
    assert got == {"step_flops": 4e12, "tflops": pytest.approx(40.0), "mfu": pytest.approx(0.5)}
    metrics.program_ran(exe)
    assert window.take(steps=1, seconds_per_step=0.2)["mfu"] is None  # no peak: n/a


def test_device_peak():
    from torchacc import hardware

    assert hardware.device_peak("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12)
    assert hardware.device_peak("NVIDIA H100 80GB HBM3", "float32") == pytest.approx(66.9e12)
    assert hardware.device_peak("cpu") is None
    assert hardware.device_peak("cpu", peak_tflops=2.5) == pytest.approx(2.5e12)


def test_accelerate_page_reports_tokens_tflops_and_mfu():
    """ta.accelerate runs (gallery/accelerate/main.py) log tokens/s, and for the lazy device the
    step programs' TFLOP/s per device and MFU against --peak_tflops."""
    from gallery.accelerate import main as page

    argv = ["--steps", "4", "--warmup", "1", "--buckets", "16", "--max-len", "16", "--json"]
    eager, lazy = page.main([*argv, "--peak_tflops", "0.5"])
    assert eager["tokens_per_sec"] > 0 and lazy["tokens_per_sec"] > 0
    assert eager["tflops"] is None and eager["mfu"] is None  # no compiled program
    assert lazy["tflops"] > 0
    assert lazy["mfu"] == pytest.approx(lazy["tflops"] / 0.5)


# ----------------------------------------------------------------------------- the launcher
_COUNTS = ("MarkStep", "TransferFromDevice", "ReadSync")
_LAUNCHES = ("UncachedCompile", "PersistentCacheHit", "CachedCompile")


def test_launcher_logs_tokens_tflops_and_mfu_at_no_extra_sync_or_compile(
    tmp_path, monkeypatch, capfd
):
    """The launcher's step log, [summary], --output JSON and TensorBoard show tokens/s, TFLOP/s
    per device and MFU (--peak_tflops on the CPU); the same run without the FLOPs meter makes
    the same syncs, reads and program launches."""
    import re

    from gallery_harness import read_tensorboard

    import gallery.common.report as report
    from gallery.common.launchlib import torchacc_launch

    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(k, v)
    argv = ["--model", "gpt-tiny", "--batch_size", "8", "--seq_len", "32", "--max_steps", "4",
            "--warmup_steps", "2", "--log_interval", "2", "--amp_level", "O0", "--compiler-opt",
            "--peak_tflops", "0.01"]  # fmt: skip
    counts = []
    real_meter = report._flops_meter
    for meter in (False, True):
        monkeypatch.setattr(
            report, "_flops_meter", real_meter if meter else lambda *a: (None, None)
        )
        metrics.clear_counters()
        out = tmp_path / f"run{int(meter)}.json"
        extra = ["--output", str(out)] + (["--tensorboard", str(tmp_path / "tb")] if meter else [])
        torchacc_launch().main([*argv, *extra])
        counts.append(
            [metrics.counter_value(n) for n in _COUNTS]
            + [sum(metrics.counter_value(n) or 0 for n in _LAUNCHES)]
        )
    assert counts[0] == counts[1], counts  # the meter adds no sync, read, compile or launch
    log = capfd.readouterr()
    text = log.out + log.err
    line = re.compile(
        r"step 4/4 .* samples/s \| [\d,]+ tokens/s \| [\d.e+-]+ TFLOP/s/device, MFU [\d.]+% \| "
    )
    assert line.search(text), text[-3000:]
    assert re.search(r"\[summary\] .* tokens/s\), [\d.e+-]+ TFLOP/s/device, MFU [\d.]+%", text)

    result = json.loads((tmp_path / "run1.json").read_text())
    s = result["summary"]
    step_flops = metrics.last_program_flops()
    assert s["step_flops"] == pytest.approx(step_flops)  # the steady step's program
    assert s["steady_tflops_per_device"] == pytest.approx(
        step_flops / s["steady_step_time_s"] / 1e12, rel=1e-6
    )
    assert s["mfu"] == pytest.approx(s["steady_tflops_per_device"] / 0.01)
    assert s["peak_tflops"] == 0.01
    last = result["intervals"][-1]
    assert last["tokens_per_sec"] == pytest.approx(last["samples_per_sec"] * 32)
    assert last["tflops_per_device"] == pytest.approx(step_flops / last["batch_time"] / 1e12)
    assert "tflops_per_device" not in json.loads((tmp_path / "run0.json").read_text())["summary"]
    scalars, _ = read_tensorboard(tmp_path / "tb")
    assert [p for p, _ in scalars["perf/mfu"]] == [2, 4]
    assert scalars["perf/tflops_per_device"][-1][1] == pytest.approx(last["tflops_per_device"])
    assert scalars["train/tokens_per_sec"][-1][1] == pytest.approx(last["tokens_per_sec"])


def test_launcher_peak_tflops_must_be_positive():
    from torchacc import launch_args

    with pytest.raises(SystemExit):
        launch_args.parse_args(["--peak_tflops", "0"])
    assert launch_args.parse_args(["--peak_tflops", "989.4"]).peak_tflops == 989.4
