"""Helpers for the launcher/gallery tests: run the launcher or a worker module in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch_single_task.py"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Variables that would make a child think it is already a worker of some other job.
_WORKER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHACC_COMPILER_OPT",
    "TORCHACC_KERNEL_OPT",
)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _WORKER_VARS and not k.startswith(("OMPI_", "PMI_", "PMIX_", "MPI_LOCAL"))
    }
    env["OMP_NUM_THREADS"] = "1"  # the test machine has few cores; workers share them
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def _run(cmd, env, timeout, expect_rc):
    p = subprocess.run(
        cmd, cwd=ROOT, env=child_env(env), capture_output=True, text=True, timeout=timeout
    )
    if expect_rc is not None and p.returncode != expect_rc:
        raise AssertionError(
            f"{' '.join(map(str, cmd))}\nexit code {p.returncode} (expected {expect_rc})\n"
            f"--- stdout\n{p.stdout[-8000:]}\n--- stderr\n{p.stderr[-8000:]}"
        )
    return p


def run_launcher(*flags, env=None, timeout=240, expect_rc=0) -> subprocess.CompletedProcess:
    return _run([sys.executable, str(LAUNCHER), *map(str, flags)], env, timeout, expect_rc)


def run_module(module, *flags, env=None, timeout=240, expect_rc=0) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", module, *map(str, flags)], env, timeout, expect_rc)


def load_metrics(path) -> dict:
    with open(path) as f:
        return json.load(f)


def check_metrics(m: dict, steps: int, world_size: int, start: int = 0) -> None:
    """The --output JSON of a finished eager run has what the README promises (peak memory from
    torch's CUDA allocator on a GPU machine, the process's peak RSS on a CPU one)."""
    assert m["steps"] == list(range(start, start + steps))
    assert len(m["losses"]) == steps and all(math.isfinite(x) for x in m["losses"])
    assert len(m["step_times"]) == steps and all(t > 0 for t in m["step_times"])
    assert len(m["samples_per_sec"]) == steps
    assert m["config"]["world_size"] == world_size
    s = m["summary"]
    assert s["steps_run"] == steps and s["world_size"] == world_size
    assert s["final_loss"] == m["losses"][-1]
    # Where peak memory is read (issue 19.12): the CUDA allocator for eager CUDA, XLA's allocator
    # for XLA:GPU, else this process's peak RSS.
    hardware = m["config"].get("hardware", m["config"]["device"])
    expected = "cuda" if hardware.startswith("cuda") else "xla" if "GPU" in hardware else "host_rss"
    assert s["peak_mem_gib"] > 0 and s["peak_mem_source"] == expected
    assert s["steady_samples_per_sec"] > 0 and s["first_step_time_s"] > 0
    assert m["intervals"] and m["intervals"][-1]["step"] == start + steps


def read_tensorboard(logdir):
    """``(scalars, accumulator)`` of the one TensorBoard run in ``logdir``, parsed by TensorBoard's
    own ``EventAccumulator``: ``scalars[tag] = [(step, value), ...]``."""
    import pytest

    ea_mod = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator",
        reason="tensorboard not installed (pip install .[test])",
    )
    events = sorted(Path(logdir).glob("events.out.tfevents.*"))
    assert len(events) == 1, f"expected one event file (rank 0 writes), found {events}"
    acc = ea_mod.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    return scalars, acc


# ----------------------------------------------------------------------------- devices
def launcher_checks():
    """``torchacc/launch_checks.py`` as the launcher loads it."""
    from gallery.common.launchlib import torchacc_launch

    return torchacc_launch().checks


def needs_processes(nproc: int, compiler_opt: bool = False):
    """Skip marker for a test that starts ``nproc`` workers on this node: the launcher refuses
    more processes than devices (GPUs, else CPU cores), and so does this skip, with its reason."""
    import pytest

    limit, what = launcher_checks().device_limit(compiler_opt)
    return pytest.mark.skipif(
        nproc > limit, reason=f"needs {nproc} devices for {nproc} processes; this node has {what}"
    )


# ----------------------------------------------------------------------------- live processes
def start_launcher(*flags, log_dir, env=None) -> subprocess.Popen:
    """Start the launcher in its own session (so a test can signal its process group like a
    terminal does); stdout/stderr go to ``log_dir/out.txt`` / ``err.txt``."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / "out.txt", "w")
    err = open(log_dir / "err.txt", "w")
    try:
        return subprocess.Popen(
            [sys.executable, str(LAUNCHER), *map(str, flags)],
            cwd=ROOT,
            env=child_env(env),
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    finally:
        out.close()
        err.close()


def read_logs(log_dir) -> tuple[str, str]:
    log_dir = Path(log_dir)
    return (log_dir / "out.txt").read_text(), (log_dir / "err.txt").read_text()


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2 :].split()[1])


def descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            parent = _ppid(int(name))
            if parent is not None:
                children.setdefault(parent, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rindex(")") + 2] != "Z"


def wait_until(predicate, timeout: float, period: float = 0.2) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(period)
    return bool(predicate())


def kill_pids(pids) -> None:
    """SIGKILL each pid a test started (by id), ignoring those already gone."""
    import signal

    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _socket_inodes(pid: int) -> set[str]:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _decode_address(text: str) -> tuple[str, int]:
    import ipaddress
    import struct

    host, port = text.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        addr = ipaddress.IPv4Address(struct.pack("<I", struct.unpack(">I", raw)[0]))
    else:  # four little-endian 32-bit words
        words = struct.unpack(">4I", raw)
        addr = ipaddress.IPv6Address(b"".join(struct.pack("<I", w) for w in words))
        addr = addr.ipv4_mapped or addr  # ::ffff:127.0.0.1 is IPv4 loopback
    return str(addr), int(port, 16)


def listening_sockets(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    owner = {}
    for pid in pids:
        for inode in _socket_inodes(pid):
            owner[inode] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in owner:  # 0A: LISTEN
                addr, port = _decode_address(cols[1])
                out.append((owner[cols[9]], addr, port))
    return out
