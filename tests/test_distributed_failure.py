"""Failure: when one rank dies or raises, the others exit with an error within 60 s, never hang.

The ranks are started with torchrun's environment but without torchrun's agent, which would
itself terminate the survivors as soon as one worker fails and so hide what torchacc does.
"""

import os
import signal
import time

import pytest
from distributed_launch import log, spawn

DEADLINE = 60.0


def _wait_ready(procs, out, timeout=180.0):
    end = time.time() + timeout
    while time.time() < end:
        if all(os.path.exists(os.path.join(out, f"ready-{r}")) for r in range(len(procs))):
            return
        for r, p in enumerate(procs):
            if p.poll() is not None:
                raise AssertionError(f"rank {r} exited before the job was up:\n{log(out, r)}")
        time.sleep(0.2)
    raise AssertionError("the job did not come up in time")


def _wait_exit(p, since):
    while time.time() - since < DEADLINE + 30:
        if p.poll() is not None:
            return time.time() - since
        time.sleep(0.2)
    return None


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "mode, victim, idle",
    [("raise", 1, False), ("kill", 0, False), ("kill", 1, True)],
    ids=["rank1-raises", "rank0-killed", "rank1-killed-peer-idle"],
)
def test_survivor_exits_in_time(tmp_path, mode, victim, idle):
    """rank1-raises: the survivor's collective fails at once (the raising rank leaves without
    waiting in JAX's shutdown barrier). rank0-killed: the coordinator's host is gone. Peer idle:
    the survivor is in host code, not in a collective; the runtime's heartbeat (set to 10 s here,
    20 s by default) declares the killed rank dead and terminates the survivor."""
    args = ["--mode", mode, "--victim", victim] + (["--idle"] if idle else [])
    procs = spawn("fail", tmp_path, *args, TORCHACC_HEARTBEAT_TIMEOUT=10)
    try:
        _wait_ready(procs, tmp_path)
        if mode == "kill":
            procs[victim].send_signal(signal.SIGKILL)
        died = time.time()
        if mode == "raise":
            assert _wait_exit(procs[victim], died) is not None, "the raising rank did not exit"
            died = time.time()
            assert procs[victim].returncode != 0
            text = log(tmp_path, victim)
            assert "deliberate failure" in text and "exiting now" in text, text
        survivor = procs[1 - victim]
        took = _wait_exit(survivor, died)
        assert took is not None, f"rank {1 - victim} still running {DEADLINE + 30:.0f} s later"
        text = log(tmp_path, 1 - victim)
        assert survivor.returncode != 0, text
        assert took < DEADLINE, f"rank {1 - victim} took {took:.1f} s to exit:\n{text}"
        # a clear error: the failed collective, or the runtime noticing the other rank is gone
        assert (
            f"rank {victim} has probably died" in text  # named by the coordination service
            or "another rank has probably died" in text
            or "JAX distributed service detected fatal errors" in text
        ), text
    finally:
        _kill_all(procs)
