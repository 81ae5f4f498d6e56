"""gallery/horovod: the seed's Horovod example on the compiler path, 2 ranks started by
torchaccrun, must *average* gradients: their parameters equal one process's on the doubled batch
(a sum would move them twice as far). A real ``mpirun`` starting torchacc.horovod ranks (the
environment they read, the job's port, averaging on CPU and on the device) is
tests/test_horovod.py::test_real_mpirun_through_a_shell_gets_one_job_port; training the gallery
under it too cost ~20 s of the suite for the same launcher code."""

import json
import subprocess
import sys

import pytest
import torch
from distributed_launch import REPO, env

ARGS = ["--max-steps", "3", "--samples", "128", "--compiler-opt"]


def _train(tmp_path, name, launcher, batch, lr):
    out = tmp_path / f"{name}.json"
    cmd = [
        *launcher,
        sys.executable,
        "-m",
        "gallery.horovod.train",
        *ARGS,
        "--batch-size",
        str(batch),
        "--lr",
        str(lr),
        "--output",
        str(out),
        "--checkpoint",
        str(tmp_path / f"{name}.pt"),
        "--log-dir",
        str(tmp_path / f"{name}-logs"),
    ]
    e = env()
    e.pop("MASTER_PORT", None)
    p = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert (tmp_path / f"{name}.pt").exists() and (tmp_path / f"{name}-logs").is_dir()
    return json.loads(out.read_text())


def _same_params(got, want):
    assert got["size"] == 2 and want["size"] == 1 and got["steps"] == want["steps"] == 3
    assert want["update_size"] > 1e-3  # training moved the parameters well beyond the tolerance
    for g, w in zip(got["params"], want["params"], strict=True):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_ranks_average_like_one_process(tmp_path):
    ref = _train(tmp_path, "one", [], 16, 0.04)
    run = [sys.executable, "-m", "torchacc.horovod.run", "-np", "2"]
    _same_params(_train(tmp_path, "torchaccrun", run, 8, 0.02), ref)
