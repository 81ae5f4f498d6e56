"""gallery/gpt: the GPT-2 model, mock tokens, eager runs, and resume == uninterrupted."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import eager_device_type
from gallery_harness import (
    check_metrics,
    load_metrics,
    needs_processes,
    read_tensorboard,
    run_launcher,
    run_module,
)

from gallery.gpt.data import MockTokens
from gallery.gpt.model import CONFIGS, GPT2_NUM_PARAMS, build_gpt, num_params


def test_gpt2_is_124m():
    with torch.device("meta"):
        model = build_gpt("gpt2")
    assert num_params(model) == GPT2_NUM_PARAMS == 124_439_808
    assert model.lm_head.weight is model.wte.weight
    assert {"gpt2", "gpt2-medium", "gpt-tiny"} <= set(CONFIGS)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_gpt("gpt-tiny").eval()
    x = torch.randint(0, 512, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % 512
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (1, 12, 512)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_mock_tokens():
    a = MockTokens(512, 16, num_samples=100, seed=3, corpus_tokens=4096)
    b = MockTokens(512, 16, num_samples=100, seed=3, corpus_tokens=4096)
    x, y = a.get_batch(torch.tensor([0, 5, 99]))
    x2, y2 = b.get_batch(torch.tensor([0, 5, 99]))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert int(x.max()) < 512 and len(a) == 100
    assert torch.equal(a[5][0], x[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_tiny_eager_one_process_bf16(tmp_path):
    out = tmp_path / "m.json"
    p = run_launcher(
        "--model=gpt-tiny",
        "--seq_len=16",
        "--batch_size=4",
        "--max_steps=3",
        "--log_interval=2",
        "--amp_level=O1",
        f"--output={out}",
    )
    summary = f"[summary] gpt-tiny eager x1 {eager_device_type()} O1/bf16"
    assert summary in p.stdout and "tokens/s" in p.stdout
    m = load_metrics(out)
    check_metrics(m, steps=3, world_size=1)
    assert m["config"]["amp_dtype_resolved"] == "bf16" and not m["config"]["grad_scaler"]
    assert [i["step"] for i in m["intervals"]] == [2, 3]
    assert m["summary"]["steady_tokens_per_sec"] == pytest.approx(
        m["summary"]["steady_samples_per_sec"] * 16
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_processes(2)
def test_gpt_tiny_eager_two_processes_fp16_scaler(tmp_path):
    """Also the eager path of --tensorboard (rank 0's scalars count both processes) and
    --profile (torch.profiler, one ProfilerStep region per captured step)."""
    out, tb = tmp_path / "m.json", tmp_path / "tb"
    p = run_launcher(
        "--nproc_per_node=2",
        "--model=gpt-tiny",
        "--seq_len=16",
        "--batch_size=2",
        "--max_steps=3",
        "--log_interval=2",
        "--amp_level=O1",
        "--amp_dtype=fp16",
        f"--output={out}",
        f"--tensorboard={tb}",
        "--profile=1:3",
    )
    m = load_metrics(out)
    check_metrics(m, steps=3, world_size=2)
    assert m["config"]["amp_dtype_resolved"] == "fp16" and m["config"]["grad_scaler"]
    assert "(scale 65536) | " in p.stdout  # the progress line shows the loss scale
    scalars, _ = read_tensorboard(tb)  # one event file: rank 0 writes
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(m["losses"], rel=1e-6)
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3]
    sps = [(i["step"], i["samples_per_sec"]) for i in m["intervals"]]
    assert scalars["train/samples_per_sec"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in sps]
    for (_, v), i in zip(scalars["train/samples_per_sec"], m["intervals"]):
        assert v == pytest.approx(2 * 2 / i["batch_time"], rel=1e-6)  # both processes' samples
    assert scalars["amp/loss_scale"] == [(2, 65536.0), (3, 65536.0)]
    assert "compile/count" not in scalars  # the compiler path's
    (trace,) = tb.glob("*.pt.trace.json")
    assert f"profile of steps 2..3 (torch.profiler): {trace}" in p.stdout
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "ProfilerStep#1" not in names
    assert {"aten::embedding", "c10d::allreduce_", "Optimizer.step#AdamW.step"} <= names


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_equals_uninterrupted(tmp_path):
    """4 steps straight == 2 steps, checkpoint, resume to 4 (fp16 + GradScaler state too)."""
    common = [
        "--model=gpt-tiny",
        "--seq_len=16",
        "--batch_size=2",
        "--amp_level=O1",
        "--amp_dtype=fp16",
        "--log_interval=1",
        "--mock_samples=6",
    ]  # 3 steps/epoch
    full, first, second = tmp_path / "full.json", tmp_path / "a.json", tmp_path / "b.json"
    ck = tmp_path / "ckpt"
    run_module("gallery.gpt.main", *common, "--max_steps=4", f"--output={full}")
    run_module(
        "gallery.gpt.main", *common, "--max_steps=2", f"--save_dir={ck}", f"--output={first}"
    )
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint_00000002.pt"]
    p = run_module(
        "gallery.gpt.main", *common, "--max_steps=4", f"--resume={ck}", f"--output={second}"
    )
    assert "steps 2->4" in p.stdout
    f, a, b = load_metrics(full), load_metrics(first), load_metrics(second)
    check_metrics(b, steps=2, world_size=1, start=2)
    assert a["steps"] + b["steps"] == f["steps"] == [0, 1, 2, 3]
    # the run crosses an epoch boundary after step 3. CPU math is deterministic: exact equality;
    # CUDA's embedding backward accumulates with atomics (run-to-run order differs): fp16-close
    if eager_device_type() == "cpu":
        assert a["losses"] + b["losses"] == f["losses"]
    else:
        assert a["losses"] + b["losses"] == pytest.approx(f["losses"], rel=1e-3)


@pytest.mark.parametrize(
    "name",
    [
        "gpt-tiny",
        "llama-tiny",
        "llama-tiny packed",
        "gpt-tiny kernels",
        "llama-tiny packed kernels",
    ],
)
def test_gallery_models_split_into_pipeline_stages_like_eager(name):
    """The gallery's GPT-2 and LLaMA (also with --kernel-opt's torchacc_ops) trace with torch.fx
    as the pipeline's splitter does (the length and position-id checks and the kernels are call
    nodes, not control flow on a traced value), cut evenly before their blocks: the stages run
    one after another on the host give the eager model's logits exactly, and a sequence past the
    block size is still the ValueError."""
    from gallery.common.frontdoors.pipeline import BatchInputs, even_split_points
    from gallery.llama.model import build_llama
    from torchacc.pipeline.stages import Stages

    torch.manual_seed(0)
    packed, kernels = "packed" in name, "kernels" in name
    gpt = name.startswith("gpt")
    model = build_gpt("gpt-tiny", kernels) if gpt else build_llama("llama-tiny", kernels)
    wrapped = BatchInputs(model, 2 if packed else 1)
    points = even_split_points(wrapped, 2)
    assert points == ["model.h.1" if gpt else "model.layers.1"]
    split = Stages(wrapped, points)
    idx = torch.randint(0, 512, (2, 16))
    inputs = {"idx": idx}
    if packed:
        inputs["position_ids"] = torch.cat([torch.arange(5), torch.arange(11)]).repeat(2, 1)
    handed = split.run(0, {}, inputs)
    values = dict(zip(split.boundaries[0], handed))
    logits = split.run(1, values, inputs)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(*inputs.values()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="sequence length 65 > block_size 64"):
        split.run(0, {}, {"idx": torch.zeros(1, 65, dtype=torch.long)})
    with pytest.raises(ValueError, match="2 pipeline stages need at least 2 blocks"):
        even_split_points(BatchInputs(build_gpt("gpt-tiny", n_layer=1), 1), 2)
