"""The launcher's ``--max_restarts`` (issue 42 part 4): a worker killed with SIGKILL mid-run
brings the job back by itself from ``--save_dir``'s newest checkpoint."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume_launcher")]


def test_launcher_max_restarts_resumes_from_the_newest_checkpoint(tmp_path):
    """``launch_single_task.py --max_restarts 1``: rank 1 of 2 killed with SIGKILL mid-run; the
    workers come back by themselves, resume from --save_dir's newest checkpoint (the log names
    its step and data position) and finish."""
    import signal
    import subprocess
    import time

    ck, out = tmp_path / "ck", tmp_path / "out.txt"
    cmd = [
        sys.executable, "launch_single_task.py", "--nproc_per_node=2", "--model=gpt-tiny",
        "--batch_size=2", "--seq_len=16", "--mock_samples=64", "--max_steps=160",
        "--amp_level=O0", f"--save_dir={ck}", "--save_interval=20", "--max_restarts=1",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."), JAX_PLATFORMS="cpu")
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=os.path.join(HERE, ".."), env=env, stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.time() + 200
        while not (ck / "checkpoint_00000040.pt").exists() and time.time() < deadline:
            time.sleep(0.02)
        workers = subprocess.run(
            ["ps", "--ppid", str(proc.pid), "-o", "pid=,args="], capture_output=True, text=True
        ).stdout.splitlines()
        rank1 = [int(w.split()[0]) for w in workers if "gallery.gpt.main" in w][-1]
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(timeout=200) == 0, out.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.read_text()
    assert f"restart 1: resuming from {ck}" in text, text[-3000:]
    resumed = [line for line in text.splitlines() if "] resumed from step " in line]
    assert len(resumed) == 1 and "samples of the epoch consumed, re-split over 2" in resumed[0]
    step = int(resumed[0].split("resumed from step ")[1].split(":")[0])
    assert step >= 40 and step % 20 == 0
    assert f"steps {step}->160" in text
