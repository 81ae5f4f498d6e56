"""tests/test_compat_xla_device.py's xla-string case, in a process of its own."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchacc  # noqa: E402
import torchacc.torch_xla  # noqa: E402, F401  (maps the 'xla' device strings)


def main():
    dev = torchacc.device()
    torch.manual_seed(0)
    host = torch.randn(3, 4)
    model = torch.nn.Linear(4, 2)
    eager_out = model(host) * 2 + torch.arange(2.0)
    made = {
        "tensor": torch.tensor([[1.0, 2.0]], device="xla"),
        "as_tensor": torch.as_tensor([3, 4], device="xla:0"),
        "asarray": torch.asarray([5.0], device=torch.device("xla")),
        "to": host.to("xla"),
        "to_kw": host.to(device="xla:0", dtype=torch.float16),
        "new_tensor": host.new_tensor([6.0], device="xla"),
        "zeros": torch.zeros(2, 3, device="xla"),
        "full": torch.full((2,), 7.0, device="xla:0"),
        "arange": torch.arange(5, device="xla"),
        "eye": torch.eye(3, device=torch.device("xla", 0)),
        "zeros_like": torch.zeros_like(host, device="xla"),
        "rand": torch.rand(4, device="xla"),
    }
    for name, t in made.items():
        assert t.device == dev, name
    model = model.to("xla")  # Module.to goes through Tensor.to
    assert model.weight.device == dev
    out = model(made["to"]) * 2 + torch.arange(2.0, device="xla")
    torchacc.sync()
    torch.testing.assert_close(out.cpu(), eager_out)
    torch.testing.assert_close(made["to_kw"].cpu(), host.half())
    assert made["tensor"].cpu().tolist() == [[1.0, 2.0]]
    assert made["as_tensor"].cpu().tolist() == [3, 4] and made["as_tensor"].dtype == torch.int64
    assert made["asarray"].cpu().tolist() == [5.0]
    assert made["new_tensor"].cpu().tolist() == [6.0]
    assert made["full"].cpu().tolist() == [7.0, 7.0]
    assert made["arange"].cpu().tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(made["eye"].cpu(), torch.eye(3))
    assert made["zeros"].cpu().abs().sum().item() == 0
    rand = made["rand"].cpu()
    assert ((rand >= 0) & (rand < 1)).all() and rand.unique().numel() == 4
    # other devices are untouched
    assert host.to("cpu") is host and torch.tensor([1.0]).device.type == "cpu"


if __name__ == "__main__":
    main()
    print("xla strings ok")
