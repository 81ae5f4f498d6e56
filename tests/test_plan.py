"""torchacc.plan: the planned step against a real torchacc SPMD step on 4 CPU devices, the analytic
state bytes, and bad input (docs/plan.md).

The real step (tests/plan_real_worker.py) and the plans run in fresh processes (the device count
must be set before JAX starts): one process for every real step, one planner worker for every
plan of the file (the cases, the depth extrapolation, the search's candidates, ResNet), side by
side on the two cores.

Note [State keeps its parameter's layout]
A plan lays each gradient and optimizer moment out like its parameter, and so does the real step:
the engine gives a result the step creates (a gradient, a moment made at the first step) the
layout of the state it is updated with (Note [A new result's layout] in
torchacc/sharding/layout.py), so the real step marks only the parameters. (The engine's former
rule, the first sharded argument of the same shape and dtype, gave o_proj's gradient q_proj's
layout under tp and left a replicated norm weight's gradient to XLA, which split it over tp; the
real step had to mark every gradient and moment itself.)
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys

import pytest

import torchacc.plan as tp
from torchacc import launch_registry as registry
from torchacc.plan import compile as pc
from torchacc.plan.__main__ import main as plan_main

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# (model, mesh) run for real and planned: the gallery GPT (its CPU config) and LLaMA-tiny (2 key/
# value heads: tp 2, with dp 2 on the other two devices)
CASES = [
    ("llama-tiny", {"dp": 4}),
    ("llama-tiny", {"fsdp": 4}),
    ("llama-tiny", {"dp": 2, "tp": 2}),
    ("gpt-tiny", {"fsdp": 4}),
    # ta.accelerate's dist.sp (Ulysses) against the plan's (dp=2 x cp=2 agrees as closely,
    # benchmarks/RESULTS.md, but costs the suite another ~10 CPU-s)
    ("llama-tiny", {"fsdp": 2, "cp": 2}),
]
# pipeline parallel: ta.dist.PipelineParallel (1F1B, MICRO micro-batches) of LLaMA-tiny with 4
# layers and an fx-traceable forward (tests/plan_test_models.py), 2 and 4 stages
PP_CASES = [("llama-tiny-4l", {"dp": 2, "pp": 2}), ("llama-tiny-4l", {"pp": 4})]
MICRO = 4
BATCH, SEQ = 8, 64
# the module's fixtures (one planner worker, one real-steps process) are its cost: one xdist
# worker runs every test here, so they start once in the suite, not once per worker
# (a loaded box stretches the first test's fixture setup past the suite's 300 s default)
pytestmark = [pytest.mark.xdist_group("plan"), pytest.mark.timeout(900)]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def real_proc(tmp_path_factory):
    """The real steps' process, started first so that it runs beside the planner's (2 cores)."""
    req = [
        {"model": m, "batch_size": BATCH, "seq_len": SEQ, "mesh": mesh, "optimizer": "adamw",
         "microbatches": MICRO}
        for m, mesh in CASES + PP_CASES
    ]  # fmt: skip
    log = open(tmp_path_factory.mktemp("plan") / "real.log", "w+")  # (a pipe could fill)
    env = _env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", JAX_PLATFORMS="cpu")
    env[registry.PROVIDER_ENV] = "plan_test_models"  # llama-tiny-4l
    env["PYTHONPATH"] = HERE + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "plan_real_worker.py"), json.dumps(req)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=REPO,
    )
    proc.log = log
    yield proc
    log.close()
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def real_steps(real_proc, all_plans):
    out, _ = real_proc.communicate(timeout=600)
    real_proc.log.seek(0)
    assert real_proc.returncode == 0, real_proc.log.read()[-4000:]
    steps = [json.loads(x[len("PLAN_REAL ") :]) for x in out.splitlines() if "PLAN_REAL" in x]
    assert len(steps) == len(CASES) + len(PP_CASES), out[-2000:]
    return steps


SEARCH = ("gpt-tiny", 4, 8, 64, "64MiB", "fp32", "adamw", False, False, "h100-sxm", 8, 2)


@pytest.fixture(scope="module")
def all_plans(real_proc, monkeypatch_module):
    """Every plan of the file in one worker process: the CASES, gpt-tiny-4l compiled
    whole and extrapolated from 1 and 2 layers, the search's candidates, ResNet-tiny."""
    prepared = [
        tp._prepare(m, BATCH, SEQ, mesh, "fp32", "adamw", False, False, "h100-sxm", 4, 8, None,
                    None, False)
        for m, mesh in CASES
    ]  # fmt: skip
    search = tp._search_jobs(*SEARCH)
    prepared += search
    resnet = ("resnet-tiny", 8, None, "fsdp=4", "bf16", "sgd", False, False, "h100-sxm", 4, 8)
    prepared.append(tp._prepare(*resnet, None, None, False))
    # gpt-tiny-4l: tests/plan_test_models.py, a provider of the registry, seen by the worker too
    monkeypatch_module.setenv(registry.PROVIDER_ENV, "plan_test_models")
    monkeypatch_module.setenv("PYTHONPATH", HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch_module.setattr(registry, "_plan_registered", {})
    monkeypatch_module.setattr(registry, "_plan_loaded", False)
    mini = ("gpt-tiny-4l", BATCH, SEQ, "fsdp=4", "bf16", "adamw", False, False, "h100-sxm", 4, 8)
    prepared.append(tp._prepare(*mini, None, None, True))
    for m, mesh in PP_CASES:  # (4 layers <= FULL_DEPTH_MAX: compiled whole)
        prepared.append(
            tp._prepare(m, BATCH, SEQ, mesh, "fp32", "adamw", False, False, "h100-sxm", 4, 8,
                        None, MICRO, True)
        )  # fmt: skip
    monkeypatch_module.setattr(tp, "FULL_DEPTH_MAX", 1)
    prepared.append(tp._prepare(*mini, None, None, False))
    plans = tp._run(prepared, progress=lambda line: None)
    n = len(CASES) + len(search)
    return {
        "cases": plans[: len(CASES)],
        "search": plans[len(CASES) : n],
        "resnet": plans[n],
        "whole": plans[n + 1],
        "pp": plans[n + 2 : n + 2 + len(PP_CASES)],
        "extrapolated": plans[n + 2 + len(PP_CASES)],
    }


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def plans(all_plans):
    return all_plans["cases"]


def _per_axis(colls):
    t = collections.Counter()
    for _op, nbytes, axes, *_ in colls:
        t["+".join(axes)] += nbytes
    return dict(t)


IDS = [f"{m}-{'-'.join(f'{a}{n}' for a, n in x.items())}" for m, x in CASES]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_planned_state_bytes_are_exact(i, real_steps, plans):
    """Parameters, gradients and optimizer state: the analytic count (padding included) and
    the real run's device bytes."""
    real, p = real_steps[i], plans[i]
    spec = tp.resolve(CASES[i][0])
    model = spec.build(None, False)
    mesh = {a: CASES[i][1].get(a, 1) for a in pc.AXES}
    analytic = sum(
        pc.shard_bytes(tuple(q.shape), pc.param_spec(n, tuple(q.shape), mesh), mesh, 4)
        for n, q in model.named_parameters()
    )
    assert p.parameters == analytic == real["parameters"]
    assert p.gradients == analytic and p.optimizer_state == 2 * analytic
    assert p.n_params == sum(q.numel() for q in model.parameters())
    assert p.gradients == real["gradients"] and p.optimizer_state == real["optimizer_state"]


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_planned_bytes_per_device_within_10_percent(i, real_steps, plans):
    real, p = real_steps[i], plans[i]
    total = real["argument"] + real["output"] - real["alias"] + real["temp"]
    assert abs(p.total - total) <= 0.10 * total, (p.total, total)


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=IDS)
def test_planned_collectives_are_the_real_steps(i, real_steps, plans):
    """Bytes per mesh axis of the real step's compiled program (up to its scalar reductions:
    a few bytes of loss and count all-reduces)."""
    real, p = real_steps[i], plans[i]
    got, want = p.collective_bytes, _per_axis(real["collectives"])
    assert got.keys() == want.keys() and all(abs(got[a] - want[a]) <= 256 for a in want), (
        got,
        want,
    )


@pytest.mark.slow
def test_depth_extrapolation_matches_the_whole_model(all_plans):
    whole, extra = all_plans["whole"], all_plans["extrapolated"]
    assert whole.extrapolated_from is None and extra.extrapolated_from == [1, 2]
    for field in ("parameters", "gradients", "optimizer_state", "n_params"):
        assert getattr(extra, field) == getattr(whole, field), field
    assert extra.collective_bytes.keys() == whole.collective_bytes.keys()
    for axis, nbytes in whole.collective_bytes.items():
        assert abs(extra.collective_bytes[axis] - nbytes) <= 0.02 * nbytes, axis
    assert abs(extra.flops - whole.flops) <= 0.02 * whole.flops
    assert abs(extra.total - whole.total) <= 0.10 * whole.total, (extra.total, whole.total)


def test_padding_is_counted():
    mesh = {"dp": 1, "fsdp": 3, "cp": 1, "tp": 1}
    spec = pc.param_spec("layers.0.mlp.up_proj.weight", (176, 64), mesh)
    assert spec == ("fsdp", None)
    assert pc.shard_bytes((176, 64), spec, mesh, 4) == math.ceil(176 / 3) * 64 * 4


def test_help_says_batch_size_is_global(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "GLOBAL batch of one optimizer step" in text
    assert "llama-7b" in text and "resnet50" in text  # the registry's models


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(mesh="fsdp=2,tp=2", devices=8), "has 4 devices"),
        (dict(mesh="tp=3"), "tp=3 does not divide llama-tiny's 4 heads"),
        (dict(mesh="pp=4"), "pp=4 does not divide llama-tiny's 2 layers"),
        (dict(mesh="tp=4"), "tp=4 does not divide llama-tiny's 2 key/value heads"),
        (dict(mesh="pp=2,tp=2"), "pp=2 with tp=2, cp=1: pipeline parallel"),
        (
            dict(model="resnet-tiny", mesh="pp=2"),
            "resnet-tiny: only dp and fsdp layouts are planned",
        ),
        (dict(mesh="dp=2,pp=2", microbatches=0), "microbatches 0 must be a positive"),
        (dict(mesh="dp=2,pp=2", batch_size=6), "batch_size 6"),
        (dict(mesh="fsdp=2,cp=2", seq_len=62), "cp=2 needs seq_len divisible by 2 x cp = 4"),
        (dict(model="resnet-tiny", mesh="tp=4"), "resnet-tiny: only dp and fsdp layouts"),
        (dict(model="llama-99b"), "unknown model 'llama-99b'"),
        (dict(device="h900"), "unknown accelerator 'h900'"),
        (dict(memory="eighty gigs"), "memory 'eighty gigs' is not a size"),
        (dict(mesh="fsdp=two"), "fsdp='two'"),
        (dict(mesh="zz=2"), "mesh axis 'zz'"),
        (dict(batch_size=6, mesh="fsdp=4"), "batch_size 6"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, needle):
    args = dict(model="llama-tiny", batch_size=8, seq_len=64, mesh="fsdp=4")
    args.update(kwargs)
    with pytest.raises(tp.PlanError) as e:
        tp.plan(**args, progress=lambda line: None)
    assert needle in str(e.value)


def test_not_enough_host_memory_says_so(monkeypatch):
    monkeypatch.setenv("TORCHACC_PLAN_HOST_MEMORY", "200MiB")
    with pytest.raises(tp.PlanError) as e:
        tp.plan("llama-7b", 64, 4096, "fsdp=64", progress=lambda line: None)
    msg = str(e.value)
    assert "needs about" in msg and "GiB of host memory" in msg and "0.2 GiB available" in msg


def test_cli_error_is_one_line(capsys):
    argv = ["--model", "llama-tiny", "--batch_size", "8", "--mesh", "fsdp=3", "--devices", "4"]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith("torchacc.plan: error: mesh dp=1,fsdp=3")
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_search_candidates_respect_the_model():
    spec = tp.resolve("llama-7b")
    cands = tp.candidate_layouts(spec, 64, 64, 4096, 8)
    assert {"dp": 1, "fsdp": 64, "tp": 1, "pp": 1, "cp": 1} in cands
    for m in cands:
        assert math.prod(m.values()) == 64
        assert m["tp"] <= 8 and 32 % m["tp"] == 0 and 32 % m["pp"] == 0
        assert 64 % (m["dp"] * m["fsdp"]) == 0


@pytest.mark.slow
def test_search_ranks_the_layouts_that_fit(all_plans):
    plans = tp._rank(all_plans["search"])
    assert len(plans) == 2 and all(p.fits for p in plans)
    assert plans[0].step_time <= plans[1].step_time
    assert all(math.prod(p.mesh.values()) == 4 for p in plans)
    assert len({tuple(p.mesh.items()) for p in plans}) == 2


@pytest.mark.slow
def test_resnet_plans(all_plans):
    """ResNet-tiny (ResNet-50's blocks, BatchNorm's running statistics updated by the step):
    it plans (no op left without a rule), state bytes exact, traffic on the fsdp axis only."""
    p = all_plans["resnet"]
    model = tp.resolve("resnet-tiny").build(None, False)
    mesh = {a: 4 if a == "fsdp" else 1 for a in pc.AXES}
    analytic = sum(
        pc.shard_bytes(tuple(q.shape), pc.param_spec(n, tuple(q.shape), mesh), mesh, 4)
        for n, q in model.named_parameters()
    )
    assert p.parameters == p.gradients == p.optimizer_state == analytic  # SGD: one buffer
    assert p.n_params == sum(q.numel() for q in model.parameters())
    assert set(p.collective_bytes) == {"fsdp"} and p.collective_bytes["fsdp"] > 0
    assert p.flops > 0 and p.total > 3 * analytic


PP_IDS = [f"{m}-{'-'.join(f'{a}{n}' for a, n in x.items())}" for m, x in PP_CASES]


def _stage_row_bytes(model, layers, pp, fsdp):
    """Bytes of one device's packed row: the widest stage's parameters (its blocks; the
    embedding on the first stage, the final norm and head on the last), padded to fsdp, split
    over fsdp: fp32, nothing shared (LLaMA's head is not tied)."""
    per = [0] * pp
    for name, q in model.named_parameters():
        if name.startswith("layers."):
            per[int(name.split(".")[1]) // (layers // pp)] += q.numel()
        else:
            per[0 if name.startswith("embed") else pp - 1] += q.numel()
    return -(-max(per) // fsdp) * fsdp * 4 // fsdp


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(PP_CASES)), ids=PP_IDS)
def test_pipeline_plan_is_the_real_pipelined_step(i, real_steps, all_plans, monkeypatch):
    """pp > 1 (Note [What the planner compiles under pp]): state bytes exact (the packed row of
    the widest stage, against a count by hand and the real run's), total within 10%, and the
    collective bytes per axis (the pp sends included) the real ta.dist.PipelineParallel step's."""
    real, p = real_steps[len(CASES) + i], all_plans["pp"][i]
    model_name, mesh = PP_CASES[i]
    monkeypatch.setenv(registry.PROVIDER_ENV, "plan_test_models")
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setattr(registry, "_plan_registered", {})
    monkeypatch.setattr(registry, "_plan_loaded", False)
    spec = tp.resolve(model_name)
    row = _stage_row_bytes(spec.build(None, False), spec.n_layer, mesh["pp"], mesh.get("fsdp", 1))
    assert p.parameters == row == real["parameters"]
    assert p.gradients == row == real["gradients"]
    assert p.optimizer_state == 2 * row == real["optimizer_state"]
    assert p.mesh["pp"] == mesh["pp"] and p.microbatches == MICRO
    total = real["argument"] + real["output"] - real["alias"] + real["temp"]
    assert abs(p.total - total) <= 0.10 * total, (p.total, total)
    got, want = p.collective_bytes, _per_axis(real["collectives"])
    assert want.get("pp", 0) > 0, want  # the stages' boundary sends
    assert abs(got.get("pp", 0) - want["pp"]) <= 8, (got, want)  # (+ the loss' scalar psums)
    assert got.keys() == want.keys() and all(abs(got[a] - want[a]) <= 256 for a in want), (
        got,
        want,
    )


def test_search_offers_pp_only_for_a_pipelinable_model(monkeypatch):
    """pp layouts (at most 4 stages, never with tp or cp: ta.dist.PipelineParallel composes
    with dp and fsdp) for a model torch.fx can cut, the gallery's GPT and LLaMA included; none
    for a model without repeated blocks."""
    monkeypatch.setenv(registry.PROVIDER_ENV, "plan_test_models")
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setattr(registry, "_plan_registered", {})
    monkeypatch.setattr(registry, "_plan_loaded", False)
    cands = tp.candidate_layouts(tp.resolve("llama-tiny-4l"), 8, 16, 64, 8)
    pps = {m["pp"] for m in cands}
    assert pps == {1, 2, 4}, pps
    assert all(m["tp"] == m["cp"] == 1 for m in cands if m["pp"] > 1)
    assert {m["pp"] for m in tp.candidate_layouts(tp.resolve("gpt-tiny"), 8, 16, 64, 8)} == {1, 2}
    assert {m["pp"] for m in tp.candidate_layouts(tp.resolve("resnet-tiny"), 8, 16, 64, 8)} == {1}
