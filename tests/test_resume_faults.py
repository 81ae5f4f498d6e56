"""Checkpoints under real signals (issue 42 parts 3-4), the suite-sized part of
tools/resume_faults.py: a ``kill -9`` in the middle of a DCP save leaves the last complete
checkpoint, which the next run finds, names and resumes from with the uninterrupted run's samples
and losses; under ``torchrun --max-restarts 1`` a rank killed by SIGKILL mid-step brings the job
back by itself from the last checkpoint, and its log says from which step."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tools"))

import resume_faults as rf  # noqa: E402

STEPS = 6

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume_faults")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run on one process: step -> (loss, sample ids)."""
    work = tmp_path_factory.mktemp("ref")
    log = str(work / "ref.log")
    rc, out = rf.run(1, str(work / "ck"), log, STEPS)
    assert rc == 0, out[-3000:]
    return rf.steps_of(log, 1)


def test_kill_9_during_a_save_keeps_the_last_checkpoint_and_resume_matches(reference, tmp_path):
    ck, log = str(tmp_path / "job"), str(tmp_path / "job.log")  # the tool's naming
    proc = rf.start(1, ck, log, STEPS)
    # the moment step 4's save directory appears: DCP is writing into it
    gone, seen = rf.kill_at(proc, log, 1, "save-write", 4, 0.0, "rank0")
    assert gone is not None, seen
    complete = rf._complete(ck)
    assert complete in ([2], [2, 4]), complete  # step 4's save was cut short (or just done)
    if complete == [2]:
        assert os.path.isdir(os.path.join(ck, ".tmp-4"))
    rc, out = rf.run(1, ck, log + ".resumed", STEPS)
    assert rc == 0, out[-3000:]
    assert f"resumed from step {complete[-1]}" in out
    if complete == [2]:  # the cut save is named as skipped
        assert "skipped incomplete ['.tmp-4']" in out, out[-2000:]
    got = rf.steps_of(log + ".resumed", 1)
    assert rf.compare(reference, got, complete[-1] + 1, STEPS, True, "resumed") == []


def test_torchrun_max_restarts_brings_the_job_back_from_the_last_checkpoint(reference, tmp_path):
    """2 processes; rank 1 SIGKILLs itself in step 3; torchrun restarts both; they resume from
    step 2 and end with the losses of the one-process run (1e-6) and its samples."""
    ck, log = str(tmp_path / "ck"), str(tmp_path / "job.log")
    rc, out = rf.run(2, ck, log, STEPS, restarts=1, RESUME_FAULT="1:3")
    assert rc == 0, rf._errors(out)
    assert "resumed from step 2 (rank 0 of 2)" in out and "resumed from step 2 (rank 1 of 2)" in out
    got = rf.steps_of(log, 2)
    assert rf.compare(reference, got, 1, STEPS, False, "restarted") == []
