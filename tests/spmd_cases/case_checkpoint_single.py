"""Loading the checkpoint case_checkpoint.py saved on 4 devices into one device without SPMD
(run by tests/test_spmd_checkpoint.py with CPU_NUM_DEVICES=1): a model for evaluation."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from ckpt_models import assert_equal, mlp  # noqa: E402

import torchacc  # noqa: E402
from torchacc.distributed import sharding  # noqa: E402
from torchacc.torch_xla.experimental.distributed_checkpoint import CheckpointManager  # noqa: E402

DEV = torchacc.device()
CKPT = os.environ["TORCHACC_CKPT_DIR"]


def test_restore_on_one_device_without_spmd():
    assert not sharding.is_spmd()
    ref = torch.load(os.path.join(CKPT, "reference-30.pt"), weights_only=True)
    model = mlp(seed=6).to(DEV)
    state = {k: torch.zeros_like(v).to(DEV) for k, v in ref.items() if k.startswith("opt_tp.")}
    state["tp"] = model.state_dict()
    mgr = CheckpointManager(os.path.join(CKPT, "mgr"), save_interval=10)
    mgr.restore(30, state)  # a part of the checkpoint: the other keys are not read
    assert_equal(state, {k: v for k, v in ref.items() if k.startswith(("tp.", "opt_tp."))})
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), ref[f"tp.{name}"]), name
    x = torch.randn(4, 16)
    cpu = mlp(seed=6)
    cpu.load_state_dict({k[3:]: v for k, v in ref.items() if k.startswith("tp.")})
    assert torch.allclose(model(x.to(DEV)).cpu(), cpu(x), atol=1e-6)
