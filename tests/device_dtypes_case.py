"""Run by tests/test_compat_device_dtypes.py in a fresh process (torch_xla's dtype flags are read
once per process): ``python tests/device_dtypes_case.py bf16|downcast``."""

import os
import sys

import torch
import torch.nn as nn

import torchacc
from torchacc.lazy.record import value_of
from torchacc.torch_xla import _XLAC

DEV = torchacc.device()


def stored(t):
    return str(value_of(t).array.dtype)


def bf16_rounded(t):
    return torch.equal(t, t.to(torch.bfloat16).to(t.dtype))


def use_bf16():
    os.environ["XLA_USE_BF16"] = "1"
    os.environ["XLA_USE_32BIT_LONG"] = "1"
    host = torch.tensor([1.1, 2.3, 3.7], dtype=torch.float64)
    x = host.to(DEV)
    assert x.dtype == torch.float64 and stored(x) == "bfloat16", stored(x)
    y = x * 3 + 0.1
    assert "bf16[3] xla::device_data()" in _XLAC._get_xla_tensors_text([y])
    got = y.cpu()
    assert got.dtype == torch.float64 and bf16_rounded(got)
    want = (host.to(torch.bfloat16) * 3 + 0.1).to(torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    # int64 stored as int32; values round-trip
    i = torch.arange(5, dtype=torch.int64).to(DEV) * 7
    torchacc.sync()
    assert i.dtype == torch.int64 and stored(i) == "int32", stored(i)
    assert torch.equal(i.cpu(), torch.arange(5) * 7) and i.cpu().dtype == torch.int64
    # a float32 training step: every stored array is bf16, numerics of a bf16 eager model
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).to(DEV)
    model.load_state_dict(ref.state_dict())
    ref = ref.to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    xb, yb = torch.randn(3, 4), torch.randn(3, 2)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.mse_loss(model(xb.to(DEV)), yb.to(DEV)).backward()
        opt.step()
        torchacc.sync()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(xb.to(torch.bfloat16)), yb.to(torch.bfloat16)).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.dtype == torch.float32 and stored(p) == "bfloat16", stored(p)
        got = p.cpu()
        assert bf16_rounded(got)
        torch.testing.assert_close(got, q.float(), rtol=2e-2, atol=2e-2)


def downcast():
    os.environ["XLA_DOWNCAST_BF16"] = "1"
    x = torch.tensor([1.1, 2.3], dtype=torch.float64).to(DEV)
    f = torch.tensor([1.1, 2.3], dtype=torch.float32).to(DEV)
    assert stored(x) == "float32" and stored(f) == "bfloat16", (stored(x), stored(f))
    z = (x * 2).cpu()
    assert z.dtype == torch.float64
    torch.testing.assert_close(z, torch.tensor([2.2, 4.6], dtype=torch.float64).float().double())
    # read once, at the first int64 upload: setting the flag afterwards changes nothing
    i = torch.arange(3).to(DEV)
    os.environ["XLA_USE_32BIT_LONG"] = "1"
    j = torch.arange(3).to(DEV)
    assert stored(i) == stored(j) == "int64"


{"bf16": use_bf16, "downcast": downcast}[sys.argv[1]]()
print("device dtypes ok")
