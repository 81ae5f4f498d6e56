"""What AlibabaPAI/torchacc's own training scripts (its tests/standalone/*.py) rely on, beyond
``ta.accelerate``: ``f"{loss}"`` of a device scalar, ``torch.cuda.amp.autocast`` around device code,
and the ``ta.*`` names (``ta.lazy_device``, ``ta.dist.local_rank``, ``ta.amp.GradScaler``,
``torchacc.utils``...)."""

import pytest
import torch

import torchacc as ta
from torchacc import metrics


def _reads():
    return metrics.counter_value("TransferFromDevice") or 0


# --------------------------------------------------------------------------------------------
# formatting a 0-dim device tensor


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(0.123456),
        torch.tensor(-7),
        torch.tensor(True),
        torch.tensor(1.5, dtype=torch.bfloat16),
    ],
    ids=["float32", "int64", "bool", "bfloat16"],
)
@pytest.mark.parametrize("spec", ["", ".4f", "E", ">12.3e"])
def test_format_of_a_scalar_matches_plain_torch(value, spec):
    t = value.to(ta.device())
    ta.sync()
    before = _reads()
    assert format(t, spec) == format(value, spec)
    assert _reads() == before + 1  # one counted host read, as .item()


def test_fstring_of_a_loss_formats_the_number():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = (x * x).sum()
    dx = x.detach().to(ta.device()).requires_grad_()
    dloss = (dx * dx).sum()
    assert f"step: 1, loss: {dloss}" == f"step: 1, loss: {loss}" == "step: 1, loss: 14.0"
    assert f"{dloss:E}" == f"{loss:E}"
    # str/repr stay torch's (the tensor, with its device), as for a plain CUDA tensor
    assert str(dloss).startswith("tensor(14., device='torchacc:0'")


def test_format_of_a_non_scalar_is_torch_s():
    v = torch.tensor([1.0, 2.0])
    t = v.to(ta.device())
    assert f"{t}" == str(t) == "tensor([1., 2.], device='torchacc:0')"
    with pytest.raises(TypeError, match="unsupported format string"):
        format(v, ".4f")
    with pytest.raises(TypeError, match="unsupported format string"):
        format(t, ".4f")
