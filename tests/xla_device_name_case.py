"""Run by tests/test_compat_xla_device.py in a fresh process with TORCHACC_DEVICE_TYPE=xla (the
device's name is fixed once per process; Note [The device's name] in torchacc/lazy/device.py)."""

import copy
import io

import torch
import torch.nn as nn

import torchacc
import torchacc.torch_xla as torch_xla
import torchacc.torch_xla.core.xla_model as xm
from torchacc.torch_xla import _XLAC

dev = torchacc.device()
assert dev == torch.device("xla", 0) == torch_xla.device() == xm.xla_device(), dev
x = torch.tensor([1.0, -2.0, 3.0], device="xla")
assert x.device == torch.device("xla:0") and x.device.type == "xla" and xm.is_xla_tensor(x)
assert torch.zeros(2, device=torch.device("xla")).device == dev
for make in (
    lambda: torch.zeros(2, device="xla:3"),
    lambda: torch.empty(2, device=torch.device("xla", 1)),
    lambda: torch.tensor([1.0], device="xla:3"),
    lambda: x.to("xla:2"),
):
    try:
        make()
        raise AssertionError("another device index was accepted")
    except ValueError as e:
        assert "no such device" in str(e) and "'xla:0'" in str(e), e
assert repr(x) == "tensor([ 1., -2.,  3.], device='xla:0')", repr(x)
assert "xla::device_data()" in _XLAC._get_xla_tensors_text([x * 2])
# deepcopy stays on the device; torch.save stores the CPU value (torchacc's rule, as xm.save)
y = copy.deepcopy(x)
assert y.device == dev and torch.equal(y.cpu(), x.cpu()), y
buf = io.BytesIO()
torch.save({"x": x}, buf)
buf.seek(0)
z = torch.load(buf)["x"]
assert z.device.type == "cpu" and torch.equal(z, x.cpu()), z
# training matches eager
torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
model = copy.deepcopy(ref).to("xla")
assert all(p.device == dev for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
data = torch.randn(5, 3)
for _ in range(2):
    for m, o, d in ((model, opt, data.to("xla")), (ref, ref_opt, data)):
        o.zero_grad()
        m(d).square().mean().backward()
        o.step()
    torch_xla.sync()
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.cpu(), q.detach(), rtol=1e-5, atol=1e-6)
with torch.autocast("xla"):
    assert model(data.to(dev)).dtype == torch.bfloat16
# the device named torchacc has a known bug here: after a factory reached torch's XLA key
# (device="xla"), an stft backward failed in torch's autograd engine; named xla, no XLA key
torch.arange(4.0, device="xla")
sig = torch.randn(32)
dsig = sig.to("xla").requires_grad_(True)
window = torch.hann_window(8)
torch.stft(dsig, 8, window=window.to("xla"), return_complex=True).abs().sum().backward()
csig = sig.clone().requires_grad_(True)
torch.stft(csig, 8, window=window, return_complex=True).abs().sum().backward()
torch.testing.assert_close(dsig.grad.cpu(), csig.grad, rtol=1e-4, atol=1e-5)
print("xla device name ok")
