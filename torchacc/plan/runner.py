"""Running the planner's worker process (``torchacc/plan/_worker.py``): its environment (the
virtual device count set before JAX starts), the request on stdin, the progress lines while it
compiles, and its JSON measurements (or its :class:`PlanError`) back."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

from torchacc.plan.models import PlanError


def run_worker(jobs, n_devices, progress):
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("CPU_NUM_DEVICES", None)
    env.pop("XLA_USE_SPMD", None)
    say = progress or _stderr_progress
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchacc.plan._worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        text=True,
    )  # fmt: skip
    proc.stdin.write(json.dumps({"jobs": jobs}))
    proc.stdin.close()
    err_lines = []
    start = time.perf_counter()
    state = {"msg": "starting"}
    done = threading.Event()

    def read_err():
        for line in proc.stderr:
            if line.startswith("[plan-progress] "):
                state["msg"] = line[len("[plan-progress] ") :].strip()
                say(f"plan: {state['msg']} ... {time.perf_counter() - start:.0f} s")
            else:
                err_lines.append(line)

    def tick():
        while not done.wait(10):
            say(f"plan: {state['msg']} ... {time.perf_counter() - start:.0f} s")

    t_err = threading.Thread(target=read_err, daemon=True)
    t_tick = threading.Thread(target=tick, daemon=True)
    t_err.start()
    t_tick.start()
    out = proc.stdout.read()
    proc.wait()
    done.set()
    t_err.join(5)
    raws = []
    for line in out.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            if "error" in d:
                raise PlanError(d["error"])
            raws.append(d)
    if proc.returncode != 0 or not raws:
        tail = "".join(err_lines[-30:])
        hint = ""
        if proc.returncode in (-9, 137):
            hint = " (killed: out of host memory?)"
        raise PlanError(f"the planner's compile failed{hint}:\n{tail}")
    return raws


def _stderr_progress(line):
    print(line, file=sys.stderr, flush=True)
