"""What ``benchmarks/gpu_check.py`` learns beside its runs: the machine (a probe subprocess for
torch/JAX devices, ``nvidia-smi``'s line, the accelerator's peak FLOP/s) and the plan's estimates
(``torchacc.plan``, computed in a CPU-only, niced subprocess so they cost no GPU time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpu_check_runs import WORKLOADS
from run_stats import _error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_PROBE = r"""
import json, os, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["torch_cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        out["torch_device"] = torch.cuda.get_device_name(0)
except Exception as e:
    out["torch_error"] = repr(e)
try:
    import torchacc  # sets torchacc's XLA defaults (torchacc/_jaxconfig.py)
    import jax, jaxlib
    out["jax"] = jax.__version__
    out["jaxlib"] = jaxlib.__version__
    d = jax.devices()[0]
    out["jax_platform"] = d.platform
    out["device_kind"] = d.device_kind
    out["jax_device_count"] = jax.device_count()
except Exception as e:
    out["jax_error"] = repr(e)
for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
          "XLA_CLIENT_MEM_FRACTION", "JAX_PLATFORMS", "TORCHACC_XLA_GPU_FLAGS"):
    out[k] = os.environ.get(k)
print("PROBE " + json.dumps(out))
"""


def probe_environment(env: dict, timeout: float) -> dict:
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("PROBE "):
                return json.loads(line[6:])
        return {"probe_error": _error_line(proc.stdout + proc.stderr)}
    except subprocess.TimeoutExpired:
        return {"probe_error": f"environment probe exceeded {timeout:.0f} s"}


def nvidia_smi() -> str | None:
    """The GPU's name, driver, memory and clocks as nvidia-smi reports them (None without it)."""
    try:
        proc = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def peak_flops(args, info: dict) -> tuple[float | None, str]:
    if args.peak_tflops:
        return args.peak_tflops * 1e12, f"--peak_tflops {args.peak_tflops:g}"
    sys.path.insert(0, ROOT)
    from torchacc import hardware

    kind = info.get("device_kind") or info.get("torch_device") or ""
    acc = hardware.from_device_kind(kind)
    if acc is None:
        return (
            None,
            f"n/a ({kind or 'unknown device'}: no peak in torchacc.hardware; --peak_tflops)",
        )
    dtype = "float32" if args.smoke else "bfloat16"
    return acc.peak(dtype), f"{acc.name} {dtype} dense {acc.peak(dtype) / 1e12:.1f} TFLOP/s"


_PLAN = r"""
import dataclasses, json, sys
spec = json.loads(sys.argv[1])
try:
    from torchacc.plan import plan
except Exception as e:
    print("PLAN " + json.dumps({"id": "*", "error": "torchacc.plan not importable: " + repr(e)}))
    sys.exit(0)
import inspect
params = inspect.signature(plan).parameters
takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
for item in spec:
    try:
        kwargs = {k: v for k, v in item["kwargs"].items() if takes_any or k in params}
        p = plan(**kwargs)
        d = dataclasses.asdict(p) if dataclasses.is_dataclass(p) else dict(vars(p))
        print("PLAN " + json.dumps({"id": item["id"], "plan": d}, default=str), flush=True)
    except Exception as e:
        print("PLAN " + json.dumps({"id": item["id"], "error": repr(e)[:300]}), flush=True)
"""


def plan_requests(args, accel: str | None, workloads) -> list[dict]:
    out = []
    for workload in workloads:
        flags = WORKLOADS[workload]["smoke" if args.smoke else "gpu"]
        kw = {
            "model": flags[flags.index("--model") + 1],
            "batch_size": int(flags[flags.index("--batch_size") + 1]),
            "precision": "fp32" if args.smoke else "bf16",
            "optimizer": "adamw",
        }
        if "--seq_len" in flags:
            kw["seq_len"] = int(flags[flags.index("--seq_len") + 1])
        if "--image_size" in flags:
            kw["image_size"] = int(flags[flags.index("--image_size") + 1])
        if accel:
            kw["device"] = accel
        out.append({"id": workload, "kwargs": {**kw, "mesh": "dp=1"}})
        if workload != "resnet50":
            out.append({"id": workload + "-fsdp", "kwargs": {**kw, "mesh": "fsdp=1"}})
    return out


def start_plans(args, accel, env, logdir, workloads):
    if args.no_plan:
        return None
    penv = dict(env, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")  # no GPU memory
    log = open(os.path.join(logdir, "plan.log"), "w")
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-c",
        _PLAN,
        json.dumps(plan_requests(args, accel, workloads)),
    ]
    try:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=penv, stdout=log, stderr=subprocess.STDOUT, text=True
        ), log
    except OSError:
        cmd = cmd[3:]
        return subprocess.Popen(
            cmd, cwd=ROOT, env=penv, stdout=log, stderr=subprocess.STDOUT, text=True
        ), log


def read_plans(logdir) -> dict:
    path = os.path.join(logdir, "plan.log")
    plans = {}
    if not os.path.exists(path):
        return plans
    with open(path) as f:
        for line in f:
            if line.startswith("PLAN "):
                try:
                    item = json.loads(line[5:])
                except ValueError:
                    continue
                plans[item["id"]] = item
    return plans


def _num(d: dict, *names):
    """The first of ``names`` that ``d`` (or a nested dict of it) holds as a number."""
    for name in names:
        v = d.get(name)
        if isinstance(v, (int, float)):
            return v
    for v in d.values():
        if isinstance(v, dict):
            got = _num(v, *names)
            if got is not None:
                return got
    return None


def plan_summary(item: dict | None) -> dict:
    if not item:
        return {}
    if "error" in item:
        return {"plan_error": item["error"]}
    p = item["plan"]
    return {
        "plan_step_s": _num(p, "step_time", "step_time_s", "est_step_time_s"),
        "plan_mfu": _num(p, "mfu", "est_mfu"),
        "plan_mem_gib": (lambda b: b / 2**30 if b else None)(
            _num(p, "total", "total_bytes", "per_device_bytes")
        ),
        "plan_flops": _num(p, "flops", "xla_flops", "flops_per_step"),
    }
