"""What AlibabaPAI/torchacc's own training scripts (its tests/standalone/*.py) rely on, beyond
``ta.accelerate``: ``f"{loss}"`` of a device scalar, ``torch.cuda.amp.autocast`` around device code,
and the ``ta.*`` names (``ta.lazy_device``, ``ta.dist.local_rank``, ``ta.amp.GradScaler``,
``torchacc.utils``...)."""

import logging
import re
import warnings

import prewarmed
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


# --------------------------------------------------------------------------------------------
# torch.cuda.amp.autocast / torch.autocast('cuda') around device code


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)


def test_cuda_autocast_casts_device_tensors_like_autocast_on_the_device():
    a, b = _data()
    da, db = a.to(ta.device()), b.to(ta.device())
    ref_mm = a.bfloat16() @ b.bfloat16()  # CUDA's policy: matmul low, layer_norm float32
    ref_ln = torch.nn.functional.layer_norm(ref_mm.float(), (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region = torch.cuda.amp.autocast(dtype=torch.bfloat16)
    # torch's deprecation of torch.cuda.amp.autocast only: no "CUDA is not available. Disabling"
    assert [w.category for w in caught] == [FutureWarning], [str(w.message) for w in caught]
    with region:
        mm = da @ db
        ln = torch.nn.functional.layer_norm(mm, (8,))
    assert (mm.dtype, ln.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(mm.cpu(), ref_mm, rtol=0, atol=0)
    torch.testing.assert_close(ln.cpu(), ref_ln, rtol=1e-5, atol=1e-5)
    assert (da @ db).dtype == torch.float32  # off again after the region


def test_torch_autocast_cuda_default_dtype_nesting_and_restore():
    a, b = _data()
    da, db = a.to(ta.device()), b.to(ta.device())
    with torch.autocast("cuda"):  # CUDA's default low dtype: float16
        assert (da @ db).dtype == torch.float16
        with torch.autocast("cuda", enabled=False):
            assert (da @ db).dtype == torch.float32
        assert (da @ db).dtype == torch.float16
    with ta.amp.autocast(dtype=torch.float16):  # an outer torchacc region comes back intact
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert (da @ db).dtype == torch.bfloat16
        assert (da @ db).dtype == torch.float16
        assert torch.get_autocast_dtype("torchacc") == torch.float16
    assert not torch.is_autocast_enabled("torchacc")


def test_cuda_autocast_region_left_by_an_exception_restores_the_state():
    da = torch.ones(2, 2).to(ta.device())
    with pytest.raises(RuntimeError, match="boom"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            raise RuntimeError("boom")
    assert not torch.is_autocast_enabled("torchacc")
    assert (da @ da).dtype == torch.float32


def test_cuda_autocast_training_step_matches_eager_autocast():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    ref = [p.detach().clone().requires_grad_() for p in model.parameters()]
    dmodel = model.to(ta.device())

    @torch.autocast("cuda", dtype=torch.bfloat16)  # the decorator form
    def loss_fn(m, inp, tgt):
        return torch.nn.functional.cross_entropy(m(inp), tgt)

    loss = loss_fn(dmodel, x.to(ta.device()), y.to(ta.device()))
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.relu(torch.nn.functional.linear(x, ref[0], ref[1]))
        ref_loss = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(h, ref[2], ref[3]), y
        )
    ref_loss.backward()
    assert loss.dtype == ref_loss.dtype == torch.float32
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-2, atol=1e-2)
    for p, r in zip(dmodel.parameters(), ref):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------------------------
# the ta.* namespace TorchAcc's scripts use


def test_device_helpers():
    assert ta.lazy_device() == ta.device()
    assert ta.is_lazy_device(ta.lazy_device()) and ta.is_lazy_device("torchacc:0")
    assert not ta.is_lazy_device("cpu")
    t = torch.ones(2)
    assert not ta.is_lazy_tensor(t) and ta.is_lazy_tensor(t.to(ta.lazy_device()))


def test_fetch_gradients_lists_the_grads_in_optimizer_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)).to(ta.device())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert ta.fetch_gradients(optimizer) == []
    model(torch.ones(4, 3).to(ta.device())).sum().backward()
    model[1].bias.grad = None
    grads = ta.fetch_gradients(optimizer)
    expected = [model[0].weight.grad, model[0].bias.grad, model[1].weight.grad]
    assert len(grads) == 3
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.cpu(), e.cpu())
        g.mul_(2)  # .grad.data: scaling it in place (the scripts' all-reduce) changes the grad
        torch.testing.assert_close(e.cpu(), g.cpu())


def test_dist_ranks_in_one_process(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert (ta.dist.rank(), ta.dist.world_size(), ta.dist.local_rank()) == (0, 1, 0)
    assert ta.dist.BACKEND_NAME == "lazy"
    assert "LAZY" in torch.distributed.Backend._plugins  # init_process_group(backend="lazy")


def test_grad_scaler_takes_torchacc_s_arguments():
    scaler = ta.amp.GradScaler(2.0**10, growth_interval=3, use_zero_grad=False)
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (1024.0, 3)
    default = ta.amp.GradScaler()
    assert (default.get_scale(), default.get_growth_factor()) == (2.0**16, 2.0)


def _linears(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def test_gradient_checkpoint_by_class_name_matches_eager():
    from torchacc.utils import checkpoint

    ref, model = _linears(1), _linears(1)
    x = torch.randn(3, 6)
    assert checkpoint.gradient_checkpoint(model, {"Linear"}) is model  # on the CPU still
    assert all("forward" in vars(m) for m in model if isinstance(m, torch.nn.Linear))
    model.to(ta.device())
    model(x.to(ta.device())).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), r.grad, rtol=1e-5, atol=1e-6)


def test_gradient_checkpoint_names_a_missing_class():
    from torchacc.utils import checkpoint

    model = _linears(2)
    with pytest.raises(ValueError, match=r"\['Block'\].*Sequential.*'Linear'"):
        checkpoint.gradient_checkpoint(model, {"Linear", "Block"})
    assert not any("forward" in vars(m) for m in model)  # nothing half-applied


def test_logger():
    import io

    logger = ta.utils.logger
    assert logger.name == "TorchAcc" and logger.level == logging.INFO
    stream = io.StringIO()
    old = logger.handlers[0].setStream(stream)
    try:
        logger.info("step: 1, loss: %s", f"{torch.tensor(0.25).to(ta.device())}")
        logger.debug("not shown at INFO")
    finally:
        logger.handlers[0].setStream(old)
    assert re.fullmatch(r"\[\d{4}-.+ - INFO\] step: 1, loss: 0\.25\n", stream.getvalue())


def _eager_reference(steps=2, world=2):
    """The worker's training, on the CPU: per-rank grads under bf16 autocast, averaged."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batches = []
    for rank in range(world):
        g = torch.Generator().manual_seed(100 + rank)
        batches.append((torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)))
    losses = [[] for _ in range(world)]
    for _ in range(steps):
        grads = []
        for rank, (x, y) in enumerate(batches):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            losses[rank].append(loss.item())
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= 0.1 * (grads[0][i] + grads[1][i]) / world
    return losses, model[0].weight.detach().flatten()[:4]


def test_torchacc_style_script_under_torchrun(tmp_path):
    import json
    import subprocess
    import sys

    from tests.distributed_launch import REPO, env, free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(free_port()), f"{REPO}/tests/torchacc_compat_worker.py"]
    proc = subprocess.run(
        cmd, env=env(COMPAT_OUT=tmp_path), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    losses, weight = _eager_reference()
    assert [(r["rank"], r["local_rank"], r["world"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert {r["backend"] for r in ranks} == {"lazy"} and {r["low"] for r in ranks} == {
        "torch.bfloat16"
    }
    for r in ranks:
        got = [float(line.removeprefix("loss: ")) for line in r["lines"]]
        assert all(line.startswith("loss: ") and "E" in line for line in r["lines"])
        torch.testing.assert_close(got, losses[r["rank"]], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(torch.tensor(r["weight"]), weight, rtol=2e-2, atol=2e-2)


def test_dist_init_process_group_checks_an_existing_group(monkeypatch):
    import torch.distributed as td

    monkeypatch.setattr(td, "is_initialized", lambda: True)
    monkeypatch.setattr(td, "get_backend", lambda group=None: "xla")
    ta.dist.init_process_group(ta.Config())  # the lazy backend's group under torchacc's name
    monkeypatch.setattr(td, "get_backend", lambda group=None: "gloo")
    with pytest.raises(ValueError, match=r"backend 'gloo', but config.backend='lazy' needs 'lazy'"):
        ta.dist.init_process_group(ta.Config())
    eager = ta.Config()
    eager.backend = "eager"
    ta.dist.init_process_group(eager)  # gloo: what the eager backend uses without CUDA


def test_syncfree_optimizers_under_ta():
    assert ta.syncfree is ta.amp.syncfree
    assert {"SGD", "Adam", "AdamW"} <= set(dir(ta.syncfree))


def test_cuda_autocast_mirroring_can_be_switched_off():

    from tests.distributed_launch import env

    code = (
        "import warnings, torch, torchacc as ta\n"
        "a = torch.ones(2, 2).to(ta.device())\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
        "        print((a @ a).dtype, any('Disabling autocast' in str(x.message) for x in w))\n"
    )
    out = prewarmed.run(["-c", code], env=env(TORCHACC_PATCH_TORCH_AUTOCAST="0"), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["torch.float32", "True"]  # torch's own behaviour, untouched
