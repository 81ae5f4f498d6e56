"""Run pytorch/xla's own one-device tests, unchanged, on torchacc and print the per-file table.

    nice -n 10 python tools/torch_xla_tests.py /path/to/pytorch-xla-checkout
    python tools/torch_xla_tests.py CHECKOUT --only test_metrics.py test_ops.py   # a few files
    python tools/torch_xla_tests.py CHECKOUT --json /tmp/xla_tests.json            # keep results
    python tools/torch_xla_tests.py CHECKOUT --spmd    # test/spmd/ in SPMD mode (SPMD_DEVICES)

The checkout is a pytorch/xla source tree fetched by the developer (not part of torchacc, not in
CI; its ``test/`` and ``examples/``: test_assume_pure*.py import a model from ``examples/``); the
number this script prints was measured on the commit named in benchmarks/RESULTS.md. Each
top-level ``test/test_*.py`` (torch_xla's ``test_mp_*`` scripts included) runs in a fresh process
through the alias (``python -m torchacc.run_torch_xla FILE``, so the device is named ``xla``:
Note [The device's name]), one at a time, with torch_xla's own
one-device CPU environment (``PJRT_DEVICE=CPU CPU_NUM_DEVICES=1``, ``TORCH_TEST_DEVICES`` =
its ``pytorch_test_base.py``, ``PYTORCH_TEST_WITH_SLOW=1``, as its ``run_tests.sh`` sets them) and
a per-file time limit.

A file's result:
  pass     it exited 0 and ran at least one test that was not skipped (a script without unittest
           cases counts by its exit code);
  skip     it exited 0 but every test skipped itself (TPU- or GPU-only files), or it is listed
           in SKIP below with the reason: it does not run on a one-device CPU box even with
           torch_xla itself;
  fail     it exited non-zero;
  timeout  it ran past the time limit (counted as a failure).
The pass rate is pass / (pass + fail + timeout). Files listed in ERROR_TEXTS assert torch_xla's
exact error message texts (torchacc's texts differ); they are reported apart, outside the rate.
Per-test counts (unittest's "Ran N tests" line) are printed too, for the finer picture.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TPU = "TPU only: run by torch_xla's test/tpu scripts alone; its tests need a TPU"
_PALLAS = "Pallas TPU kernels: run by torch_xla's test/tpu scripts alone; needs a TPU"
# Files that do not run on a one-device CPU box even with torch_xla itself.
SKIP = {
    "test_utils.py": "a helper module, not a test",
    "test_xla_sharding_base.py": "a helper module of test/spmd, not a test",
    "test_gmm.py": _PALLAS,
    "test_pallas.py": _PALLAS,
    "test_pallas_spmd.py": _PALLAS,
    "test_splash_attention.py": _PALLAS,
    "test_multi_queries_paged_attention_kernel.py": _PALLAS,
    "test_ragged_paged_attention_kernel.py": _PALLAS,
    "test_quantized_matmul_pallas_kernel.py": _PALLAS,
    "test_mp_collective_matmul.py": _TPU,
    "test_mp_early_exit.py": "needs a torchrun launch and does nothing off a TPU",
    "test_profile_mp_mnist.py": "not run by any torch_xla test script; needs its profiler server",
}
# Files that import torchvision: PyPI's torchvision has no build that imports beside torch
# 2.13's CPU wheel ("operator torchvision::nms does not exist"), so where it is missing they are
# counted apart (they run, and count, where torchvision imports).
NEEDS_TORCHVISION = "needs torchvision, which does not import here"
# Files that assert torch_xla's exact error texts: counted apart (torchacc's messages differ).
ERROR_TEXTS = {
    "test_ops_error_message.py": "asserts torch_xla's C++ error message texts",
    "test_ops_error_message_functionalization_disabled.py": "asserts torch_xla's error texts",
    "test_xla_graph_execution.py": "asserts torch_xla's message for a disallowed execution",
}

# test/spmd/ runs on 4 CPU devices, standing in for the several devices of torch_xla's TPU runs
# (test/tpu/run_tests.sh), except the files whose cases are written for torch_xla's CPU CI: they
# branch on ``PJRT_DEVICE == 'CPU'`` and assert the one device that test/run_tests.sh gives them
# (its ``run_test`` sets ``CPU_NUM_DEVICES=1``; ``run_test_multi_devices`` sets 4). Those run with
# run_tests.sh's count (on a TPU, torch_xla skips those cases or takes their TPU branch).
SPMD_DEVICES = {
    "test_spmd_debugging.py": 1,  # run_test; its *_cpu cases: "PJRT_DEVICE=CPU ... one CPU"
    "test_xla_spmd_python_api_interaction.py": 1,  # run_test; counts == 1 under PJRT_DEVICE=CPU
}

# files run_tests.sh runs under ``run_save_tensor_hlo`` (test/utils/run_tests_utils.sh): graph
# dumps to XLA_SAVE_TENSORS_FILE in the hlo format (run_tests.sh also runs test_spmd_graph_dump
# once with the ir format; this tool runs each file once, in the hlo form)
SAVE_TENSORS_FMT = {
    "test_spmd_graph_dump.py": "hlo",
    "test_spmd_lowering_context.py": "hlo",
}

_RAN = re.compile(r"^Ran (\d+) tests? in", re.M)
_SUMMARY = re.compile(r"^(OK|FAILED)(?: \((.*)\))?\s*$", re.M)


def unittest_counts(output):
    """``(ran, failures, errors, skipped)`` from unittest's summary lines, or None."""
    ran = [int(n) for n in _RAN.findall(output)]
    if not ran:
        return None
    failures = errors = skipped = 0
    for _status, detail in _SUMMARY.findall(output):
        for part in (detail or "").split(","):
            name, _, value = part.strip().partition("=")
            if value.isdigit():
                if name == "failures":
                    failures += int(value)
                elif name == "errors":
                    errors += int(value)
                elif name == "skipped":
                    skipped += int(value)
    return sum(ran), failures, errors, skipped


def first_error(output):
    """The last exception line of the output (what failed first, in one line)."""
    lines = [ln for ln in output.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Exit)\b", ln.strip()):
            return ln.strip()[:160]
    return lines[-1].strip()[:160] if lines else ""


def run_file(test_dir, name, timeout, python, devices=1):
    fmt = SAVE_TENSORS_FMT.get(name) if os.path.basename(test_dir) == "spmd" else None
    if fmt is None:
        return _run_file(test_dir, name, timeout, python, devices, {})
    with tempfile.TemporaryDirectory() as tmp:  # a fresh dump file, removed afterwards
        save = {"XLA_SAVE_TENSORS_FILE": os.path.join(tmp, "xla_test_save_ir.txt")}
        save["XLA_SAVE_TENSORS_FMT"] = fmt
        return _run_file(test_dir, name, timeout, python, devices, save)


def _run_file(test_dir, name, timeout, python, devices, extra_env):
    env = dict(os.environ)
    env.update(extra_env)
    env.update(
        # run_tests.sh's environment: torch's device-type tests get torch_xla's test base
        TORCH_TEST_DEVICES=os.path.join(test_dir, "pytorch_test_base.py"),
        PYTORCH_TEST_WITH_SLOW="1",
        PJRT_DEVICE="CPU",
        CPU_NUM_DEVICES=str(devices),
        JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"),
        PYTHONPATH=os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p),
    )
    # by absolute path, as run_tests.sh runs them ("$CDIR/test_x.py"): some files find the
    # checkout's examples/ from their own __file__
    cmd = [python, "-m", "torchacc.run_torch_xla", os.path.join(os.path.abspath(test_dir), name)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=test_dir, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        output = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
            errors="replace"
        )
    seconds = time.perf_counter() - start
    counts = unittest_counts(output)
    if rc is None:
        result = "timeout"
    elif rc != 0:
        result = "fail"
    elif counts is not None and counts[0] > 0 and counts[3] == counts[0]:
        result = "skip"
    else:
        result = "pass"
    return {
        "file": name,
        "result": result,
        "rc": rc,
        "seconds": round(seconds, 1),
        "tests": counts,
        "error": "" if result in ("pass", "skip") else first_error(output),
        "output": output[-20000:],
    }


def table(rows):
    lines = [f"{'file':52} {'result':8} {'tests ran/fail/err/skip':24} {'s':>6}  first error"]
    for r in rows:
        tests = "/".join(map(str, r["tests"])) if r["tests"] else "-"
        lines.append(
            f"{r['file']:52} {r['result']:8} {tests:24} {r['seconds']:6.1f}  {r['error']}"[:220]
        )
    rated = [r for r in rows if r["result"] in ("pass", "fail", "timeout") and not r["apart"]]
    passed = sum(r["result"] == "pass" for r in rated)
    apart = [r for r in rows if r["apart"]]
    skipped = [r for r in rows if r["result"] == "skip"]
    lines.append("")
    lines.append(
        f"files: {passed} pass / {len(rated)} that run = {100.0 * passed / max(len(rated), 1):.1f}%"
        f"  ({len(skipped)} skipped; {len(apart)} error-text files counted apart: "
        f"{sum(r['result'] == 'pass' for r in apart)} pass)"
    )
    ran = fails = 0
    for r in rated:
        if r["tests"]:
            ran += r["tests"][0] - r["tests"][3]
            fails += r["tests"][1] + r["tests"][2]
    if ran:
        lines.append(
            f"unittest cases in those files (not skipped): {ran - fails} pass / {ran} = "
            f"{100.0 * (ran - fails) / ran:.1f}% (a file that timed out or died adds none)"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkout", help="a pytorch/xla source checkout (holds test/)")
    ap.add_argument("--only", nargs="*", help="file names under test/ to run (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per file (300)")
    ap.add_argument("--json", help="write the results (with each file's output tail) here")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument(
        "--spmd",
        action="store_true",
        help="run test/spmd/ instead, on 4 CPU devices (SPMD_DEVICES: run_tests.sh's count)",
    )
    args = ap.parse_args(argv)
    test_dir = os.path.join(os.path.abspath(args.checkout), "test")
    if not os.path.isdir(test_dir):
        ap.error(f"{args.checkout} has no test/ directory: pass a pytorch/xla checkout")
    devices = 1
    if args.spmd:  # test/spmd/: SPMD on 4 CPU devices, each file run as `python spmd/FILE`
        test_dir, devices = os.path.join(test_dir, "spmd"), 4
    names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(test_dir, "test_*.py")))
    if args.only:
        missing = sorted(set(args.only) - set(names))
        if missing:
            ap.error(f"not in {test_dir}: {', '.join(missing)}")
        names = [n for n in names if n in args.only]
    rows = []
    for name in names:
        if name in SKIP:
            rows.append(
                dict(file=name, result="skip", rc=None, seconds=0.0, tests=None,
                     error=SKIP[name], output="", apart=False)
            )  # fmt: skip
            continue
        n = SPMD_DEVICES.get(name, devices) if args.spmd else devices
        row = run_file(test_dir, name, args.timeout, args.python, n)
        row["apart"] = name in ERROR_TEXTS
        if row["result"] != "pass" and "No module named 'torchvision'" in row["output"]:
            row.update(result="skip", error=NEEDS_TORCHVISION)
        rows.append(row)
        print(f"{name}: {row['result']} ({row['seconds']} s) {row['error']}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    print()
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
