"""``import torchacc`` must not change plain PyTorch behaviour.

Each behaviour runs the same snippet in two fresh interpreters, one with ``import torchacc`` first,
and compares what they print (Note [torchacc is not torch.accelerator] in torchacc/device.py).
"""

import json
import os
from pathlib import Path

import prewarmed
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(snippet, with_torchacc, env_extra=None):
    header = "import json, warnings\nimport torch\n"
    if with_torchacc:
        header += "import torchacc\n"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        **(env_extra or {}),
    )
    proc = prewarmed.run(["-c", header + snippet], env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _same_with_and_without(snippet, env_extra=None):
    without = _run(snippet, False, env_extra)
    with_ = _run(snippet, True, env_extra)
    assert with_ == without, f"without torchacc: {without}\nwith torchacc:    {with_}"
    return with_


_DATALOADER = """
loader = torch.utils.data.DataLoader([torch.arange(3.0)] * 4, batch_size=2, pin_memory=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    batches = list(loader)
print(json.dumps({
    "values": [b.tolist() for b in batches],
    "pinned": [b.is_pinned() for b in batches],
    "warnings": sorted({str(w.message) for w in caught}),
}))
"""


def test_dataloader_pin_memory_on_cpu_as_without_torchacc():
    out = _same_with_and_without(_DATALOADER, {"CUDA_VISIBLE_DEVICES": ""})
    assert out["values"] == [[[0.0, 1.0, 2.0]] * 2] * 2


_ACCELERATOR = """
cur = torch.accelerator.current_accelerator(check_available=True)
print(json.dumps({
    "is_available": torch.accelerator.is_available(),
    "current_available": None if cur is None else str(cur),
    "cuda": torch.cuda.is_available(),
}))
"""


def test_torch_accelerator_as_without_torchacc():
    _same_with_and_without(_ACCELERATOR)


_SEED = """
torch.manual_seed(1234)
a = torch.rand(4).tolist()
g = torch.initial_seed()
torch.seed()
torch.manual_seed(1234)
b = torch.randn(3).tolist()
from jax._src import xla_bridge  # importing jax starts nothing; a started backend would show here
print(json.dumps({"rand": a, "initial": g, "randn": b, "jax_started": bool(xla_bridge._backends)}))
"""


def test_manual_seed_as_without_torchacc_and_starts_no_jax_backend():
    out = _same_with_and_without(_SEED)
    assert out["jax_started"] is False


def test_manual_seed_still_seeds_the_device():
    # the device key is built lazily from the last torch.manual_seed: same seed, same numbers
    import torch

    import torchacc

    dev = torchacc.device()
    torch.manual_seed(77)
    a = torch.rand(5, device=dev).cpu()
    torch.manual_seed(78)
    torch.manual_seed(77)
    b = torch.rand(5, device=dev).cpu()
    c = torch.rand(5, device=dev).cpu()
    assert torch.equal(a, b)
    assert not torch.equal(b, c)


_CUDA = """
torch.manual_seed(5)
x = torch.randn(64, 64, device="cuda")
y = (x @ x).sum().item()
torch.cuda.manual_seed(9)
r = torch.rand(3, device="cuda").tolist()
print(json.dumps({"available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
                  "y": y, "r": r, "dev": str(x.device)}))
"""


@pytest.mark.gpu
def test_cuda_as_without_torchacc():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch and a GPU")
    _same_with_and_without(_CUDA)
