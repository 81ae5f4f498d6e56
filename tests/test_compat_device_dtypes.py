"""torch_xla's XLA_USE_BF16 / XLA_DOWNCAST_BF16 / XLA_USE_32BIT_LONG (Note [Device dtypes] in
torchacc/lowering/dtypes.py): narrower storage on the device, torch dtypes unchanged. The flags
are read once per process, so each case runs in a fresh one (tests/device_dtypes_case.py)."""

import os

import prewarmed
import pytest

import torchacc
from torchacc.lazy.record import value_of
from torchacc.torch_xla import _XLAC

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("case", ["bf16", "downcast"])
def test_flags_narrow_device_storage_with_eager_numerics(case):
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = prewarmed.run(
        [os.path.join(REPO, "tests", "device_dtypes_case.py"), case], env=env, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0 and "device dtypes ok" in proc.stdout, proc.stderr[-4000:]


def test_without_flags_storage_is_the_torch_dtype_and_ir_text_marks_roots():
    import torch

    x = torch.tensor([1.5, 2.5], dtype=torch.float64).to(torchacc.device())
    y = x + 1
    assert str(value_of(x).array.dtype) == "float64"
    text = _XLAC._get_xla_tensors_text([y, x])
    assert text.splitlines() == [
        "IR {",
        "  %0 = f64[2] xla::device_data(), ROOT=1",
        "  %1 = f64[2] aten::add.Tensor(%0), ROOT=0",
        "}",
    ], text
