"""An unchanged HuggingFace Trainer script (gallery/hf_trainer/train.py) on torchacc.

Runs the script through ``python -m torchacc.run_torch_xla`` (transformers and accelerate take
their torch_xla paths, backed by torchacc) and as plain eager PyTorch, for a tiny GPT-2 and a tiny
BERT: 20 steps each with ``save_strategy="steps"``, then evaluate and save. Checks per-step loss
parity, that the torchacc-trained model reloads and evaluates in eager PyTorch, that checkpoints
hold the device RNG state, and that torch_xla's metrics show the compiles being reused.
"""

import json
import os
from pathlib import Path

import prewarmed
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "gallery/hf_trainer/train.py"
STEPS = 20
MODELS = ["gpt2", "bert"]
# transformers' default optimizer on an accelerator: torch.optim.AdamW(fused=True), one fused node
# per parameter group on torchacc (torchacc/lowering/optim.py), the CPU fused kernel on eager
OPTIMS = ["adamw_torch_fused"]
# both tests read the one module fixture: on one xdist worker it runs once (not once per worker)
pytestmark = pytest.mark.xdist_group("hf_trainer")


def _run(args, timeout=900):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        TRANSFORMERS_VERBOSITY="error",
    )
    proc = prewarmed.run([*args], env=env, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module", params=OPTIMS)
def runs(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"hf_{request.param}")
    common = ["--model", *MODELS, "--max_steps", str(STEPS), "--optim", request.param]
    acc, eager = base / "torchacc", base / "eager"
    _run(["-m", "torchacc.run_torch_xla", SCRIPT, "--output_dir", str(acc), *common])
    _run([SCRIPT, "--output_dir", str(eager), "--compare", str(acc), *common])
    return acc, eager


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_trainer_on_torchacc_matches_eager(runs, model):
    acc, eager = runs
    ours = json.loads((acc / model / "results.json").read_text())
    ref = json.loads((eager / model / "results.json").read_text())
    cmp = json.loads((eager / model / "compare.json").read_text())
    assert ours["device"] == "xla:0" and ref["device"] == "cpu"  # run_torch_xla names it xla
    assert len(ours["losses"]) == len(ref["losses"]) == STEPS
    assert cmp["max_loss_diff"] <= 2e-3, (ours["losses"], ref["losses"])
    assert abs(ours["eval_loss"] - ref["eval_loss"]) <= 2e-3
    # the model torchacc trained and saved reloads in plain eager PyTorch and evaluates the same
    assert abs(cmp["reloaded_eval_loss"] - ours["eval_loss"]) <= 2e-3
    # save_strategy="steps": checkpoints with the device RNG state (xm.get_rng_state)
    import torch

    for step in (10, 20):
        ckpt = acc / model / f"checkpoint-{step}"
        assert (ckpt / "model.safetensors").exists() and (ckpt / "optimizer.pt").exists()
        rng = torch.load(ckpt / "rng_state.pth", weights_only=False)
        assert isinstance(rng["xla"], int)
    # torch_xla metrics: a few compiles, then every training step reuses the compiled step
    counters = ours["xla_metrics"]["counters"]
    compiles = (counters.get("UncachedCompile") or 0) + (counters.get("PersistentCacheHit") or 0)
    assert 1 <= compiles <= 12, counters
    assert counters["CachedCompile"] >= STEPS - 2, counters
    assert counters["MarkStep"] >= STEPS, counters
    assert "CompileTime" in ours["xla_metrics"]["report"]
