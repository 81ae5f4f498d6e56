"""Data-parallel parity: 2 processes x batch b end with the parameters of 1 process x batch 2b."""

import pytest
import torch
from distributed_launch import load, report, single, torchrun

STEPS, BATCH = 5, 4


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_processes_match_one_process_with_twice_the_batch(tmp_path):
    one = single("train", tmp_path, "--batch", 2 * BATCH, "--steps", STEPS)
    assert one.returncode == 0, report(one)
    two = torchrun("train", tmp_path, "--batch", BATCH, "--steps", STEPS)
    assert two.returncode == 0, report(two)
    ref, r0, r1 = (
        load(tmp_path, "train-1", 0),
        load(tmp_path, "train-2", 0),
        load(tmp_path, "train-2", 1),
    )
    apis = {
        "sgd": "xm.all_reduce",
        "adamw": "dist.all_reduce",
        "xm.optimizer_step": "xm.optimizer_step",
        "xm.reduce_gradients": "xm.reduce_gradients",
    }
    assert set(ref) == set(r0) == set(apis)
    for recipe, api in apis.items():
        assert r0[recipe]["api"] == api
        for name, want in ref[recipe]["params"].items():
            want = torch.tensor(want)
            got0, got1 = (
                torch.tensor(r0[recipe]["params"][name]),
                torch.tensor(r1[recipe]["params"][name]),
            )
            assert torch.equal(got0, got1), f"{recipe} {name}: ranks differ"
            torch.testing.assert_close(
                got0, want, rtol=1e-5, atol=1e-7, msg=lambda m, r=recipe, n=name: f"{r} {n}: {m}"
            )
        # the global loss is the mean of the two ranks' losses
        mean = [
            (a + b) / 2 for a, b in zip(r0[recipe]["losses"], r1[recipe]["losses"], strict=True)
        ]
        torch.testing.assert_close(
            torch.tensor(mean), torch.tensor(ref[recipe]["losses"]), rtol=1e-5, atol=1e-6
        )
