"""``torchacc.compile_step`` with fp16 autocast and a GradScaler: the inf/NaN check, the skipped
optimizer step and the scale update happen inside the one compiled program (no host sync) and
match eager PyTorch step for step, a forced overflow step included (Note [GradScaler in a
compiled step])."""

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F

import torchacc.dynamo
from torchacc import metrics

sys.path.insert(0, os.path.dirname(__file__))
import models  # noqa: E402

OVERFLOW = 3  # the step whose batch overflows fp16 (its gradients are inf/NaN)


@pytest.fixture(autouse=True)
def fresh():
    metrics.clear_all()


def count(name):
    return metrics.counter_value(name) or 0


def make_step(model, opt, scaler, device):
    def step(x, y):
        opt.zero_grad()
        with torch.autocast(device, dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    return step


def batches(n, device):
    g = torch.Generator().manual_seed(5)
    out = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]
    out[OVERFLOW][0][0, 0] = 1e30  # inf in fp16: NaN loss, inf/NaN gradients
    return [(x.to(device), y.to(device)) for x, y in out]


def new_scaler(cls, device):
    # growth every 2 good steps, so the run grows, backs off on the overflow and grows again
    return cls(
        device, init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.25, growth_interval=2
    )


def train(scaler_cls, device="cpu", n=7):
    torch.manual_seed(0)
    model = models.MLP().to(device)
    ref = copy.deepcopy(model)
    runs = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        scaler = new_scaler(scaler_cls, device)
        runs.append((make_step(m, opt, scaler, device), opt, scaler))
    compiled = torchacc.dynamo.compile_step(runs[0][0])
    rows = []
    for x, y in batches(n, device):
        row = []
        for step, opt, scaler in ((compiled,) + runs[0][1:], runs[1]):
            loss = step(x, y)
            st = opt.state[opt.param_groups[0]["params"][0]]
            row.append(
                (loss.item(), scaler.get_scale(), int(scaler._growth_tracker), float(st["step"]))
            )
        rows.append(row)
    return compiled, model, ref, rows


def _torchacc_scaler(*args, **kwargs):
    from torchacc.amp import GradScaler

    return GradScaler(*args, **kwargs)


@pytest.mark.parametrize(
    "scaler_cls", [torch.amp.GradScaler, _torchacc_scaler], ids=["torch.amp", "torchacc.amp"]
)
def test_fp16_grad_scaler_matches_eager_with_an_overflow_step(scaler_cls):
    check(*train(scaler_cls))


@pytest.mark.gpu
def test_fp16_grad_scaler_on_cuda_matches_eager():
    """The same on CUDA tensors (zero-copy to XLA:GPU through DLPack)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import jax

    try:
        jax.devices("gpu")
    except RuntimeError:
        pytest.skip("JAX sees no GPU")
    check(*train(torch.amp.GradScaler, "cuda"))


def check(compiled, model, ref, rows):
    scales = []
    for i, (c, e) in enumerate(rows):
        # loss (NaN on the overflow step), scale, growth tracker, AdamW's step counter
        assert c[1:] == e[1:], (i, rows)
        if i == OVERFLOW:
            assert c[0] != c[0] and e[0] != e[0]  # NaN
        else:
            assert abs(c[0] - e[0]) <= 1e-3 * max(1.0, abs(e[0])), (i, rows)
        scales.append(c[1])
    # grew, backed off on the overflow (and skipped AdamW: its step counter did not advance)
    assert scales[OVERFLOW] == scales[OVERFLOW - 1] * 0.25 and scales[1] == 2.0**11
    assert rows[OVERFLOW][0][3] == rows[OVERFLOW - 1][0][3]
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=name)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # one program, traced once; the overflow step did not retrace or read anything on the host
    assert count("StepTrace") == 1 and count("StepRecompile") == 0
    assert count("DynamoCompile") == 1 and count("StepExecute") == len(rows) - 1
