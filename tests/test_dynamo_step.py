"""torchacc.dynamo.compile_step: a whole training step (forward, backward, AdamW + LR schedule)
as one program, trained side by side with eager; recompiles only when a guard changes."""

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


@pytest.fixture(autouse=True)
def fresh():
    metrics.clear_all()


def count(name):
    return metrics.counter_value(name) or 0


def make_step(model, opt, loss_fn):
    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


def train_pair(model, batches, loss_fn, schedule):
    ref = copy.deepcopy(model)
    runs = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
        runs.append((make_step(m, opt, loss_fn), opt, schedule(opt)))
    compiled = torchacc.dynamo.compile_step(runs[0][0])
    runs[0] = (compiled,) + runs[0][1:]
    losses = []
    for x, y in batches:
        row = []
        for step, _opt, sched in runs:
            row.append(step(x, y).item())
            sched.step()
        losses.append(row)
    return compiled, ref, losses


def assert_parity(model, ref, losses, tol=1e-4):
    for i, (c, e) in enumerate(losses):
        assert abs(c - e) <= tol, f"step {i}: compiled {c} vs eager {e}"
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-4, rtol=1e-4), name
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-3)


def assert_one_program(compiled, steps):
    assert count("StepTrace") == 1 and count("StepRecompile") == 0
    assert count("DynamoCompile") == 1  # the whole step is one program
    assert count("StepExecute") == steps - 1  # the first call ran eagerly
    (prog,) = compiled._programs.values()
    assert prog.flat is not None  # Note [Flat step buffers]


def batches_for(shape_x, make_y, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape_x, generator=g), make_y(g)) for _ in range(n)]


def lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


def test_mlp_step_with_lambda_lr_is_one_program():
    torch.manual_seed(0)
    model = models.MLP()
    batches = batches_for((6, 8), lambda g: torch.randn(6, 4, generator=g), 6, 1)
    compiled, ref, losses = train_pair(model, batches, F.mse_loss, lambda_lr)
    assert_parity(model, ref, losses)
    assert_one_program(compiled, 6)
    # optimizer state and step counters are the user's tensors, updated every step
    (st,) = [compiled._world.opts[0].state[next(model.parameters())]]
    assert float(st["step"]) == 6.0


def test_cnn_with_batchnorm_and_cosine_schedule():
    torch.manual_seed(0)
    model = models.CNN()
    batches = batches_for((4, 3, 8, 8), lambda g: torch.randint(0, 5, (4,), generator=g), 5, 2)

    def cosine(opt):
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)

    compiled, ref, losses = train_pair(model, batches, F.cross_entropy, cosine)
    assert_parity(model, ref, losses)  # running stats included
    assert_one_program(compiled, 5)


def test_gpt_with_sdpa_step():
    torch.manual_seed(0)
    model = models.TinyGPT(sdpa=True)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g))
        for _ in range(4)
    ]

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    compiled, ref, losses = train_pair(model, batches, loss_fn, lambda_lr)
    assert_parity(model, ref, losses)
    assert_one_program(compiled, 4)


def test_hyperparameter_change_retraces_once(capfd, monkeypatch):
    monkeypatch.setenv("TORCHACC_DEBUG", "1")
    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torchacc.dynamo.compile_step(make_step(model, opt, F.mse_loss))
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    for _ in range(3):
        step(x, y)
    opt.param_groups[0]["weight_decay"] = 0.5
    step(x, y)
    step(x, y)
    assert count("StepTrace") == 2 and count("StepRecompile") == 1
    assert "hyper-parameter changed" in capfd.readouterr().err


def test_scheduler_inside_the_step_is_refused():
    model = models.MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)

    def step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        sched.step()

    compiled = torchacc.dynamo.compile_step(step)
    compiled(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="scheduler.step\\(\\) outside"):
        compiled(torch.randn(2, 8))


def test_torchacc_compile_is_compile_step_and_import_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, torchacc\n"
        "light = 'torchacc.dynamo' not in sys.modules\n"
        "from torchacc.dynamo import compile_step\n"
        "print(light, torchacc.compile is compile_step)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "True"]


def test_state_tensor_repointed_with_data_keeps_training():
    """``p.data = ...`` after tracing (what ``module.to()`` does) leaves the flat buffers: the
    step notices (data pointers) and keeps updating the user's tensor, still one trace."""
    torch.manual_seed(0)
    model = models.MLP()
    batches = batches_for((6, 8), lambda g: torch.randn(6, 4, generator=g), 6, 4)
    ref = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    compiled = torchacc.dynamo.compile_step(make_step(model, opts[0], F.mse_loss))
    eager = make_step(ref, opts[1], F.mse_loss)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == 3:
            for m in (model, ref):
                w = next(m.parameters())
                w.data = w.data.clone()
        losses.append((compiled(x, y).item(), eager(x, y).item()))
    assert_parity(model, ref, losses)
    assert count("StepTrace") == 1 and count("StepRecompile") == 0


def test_cpu_write_back_adopts_the_program_outputs():
    """Note [Adopting output buffers]: no copy per step; the flat buffer takes over the output's
    memory, its views (parameters, optimizer state, .grad) follow, and that output is the next
    call's zero-copy input."""
    from torchacc.dynamo import bridge

    torch.manual_seed(0)
    model = models.MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torchacc.dynamo.compile_step(make_step(model, opt, F.mse_loss))
    x, y = torch.randn(3, 8), torch.randn(3, 4)
    for _ in range(3):
        step(x, y)
    (prog,) = step._programs.values()
    flat = prog.flat.flat_tensors[0]
    w = next(model.parameters())
    before, w_before = flat.data_ptr(), w.detach().clone()
    step(x, y)
    assert flat.data_ptr() != before  # adopted, not copied into
    assert w.data_ptr() - flat.data_ptr() == w.storage_offset() * w.element_size()
    assert not torch.equal(w, w_before)  # the parameter (a view) sees the update
    assert bridge._views[id(flat)][2].unsafe_buffer_pointer() == flat.data_ptr()
    assert prog.flat.valid(step._world)
