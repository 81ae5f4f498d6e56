"""launch_single_task.py / torchacc/launch.py: flags, usage errors, mpirun mapping, in-process
worker mode, and that the eager path never imports the compiler core."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from gallery_harness import ROOT, check_metrics, child_env, load_metrics, run_launcher

from gallery.common.launchlib import torchacc_launch

launch = torchacc_launch()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--amp_level", "O2"], "invalid choice: 'O2'"),
        (["--amp_dtype", "fp8"], "invalid choice: 'fp8'"),
        (["--batch_size", "0"], "batch_size: must be >= 1"),
        (["--batch_size", "many"], "expected an integer"),
        (["--lr", "-1"], "must be a finite number > 0"),
        (["--lr", "nan"], "must be a finite number > 0"),
        (["--model", "resnet18"], "invalid choice: 'resnet18'"),
        (["--nproc_per_node", "0"], "nproc_per_node: must be >= 1"),
        (["--master_port", "70000"], "must be <= 65535"),
        (["--data", "/no/such/dir"], "neither 'mock' nor an existing directory"),
        (["--resume", "/no/such/ckpt.pt"], "does not exist"),
        (["--seq_len", "64"], "--seq_len applies to the gpt models"),
        (["--model", "gpt-tiny", "--data", "."], "mock tokens only"),
        (["--save_interval", "5"], "--save_interval needs --save_dir"),
        (["--nnodes", "2", "--node_rank", "2"], "must be < --nnodes"),
        (["--compiler-opt", "--torch_compile"], "cannot be combined"),
        (["--batch"], "unrecognized arguments: --batch"),  # no prefix matching
        (["--model", "gpt-tiny", "--seq_len", "65"], "> gpt-tiny's block size 64"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: launch_single_task.py") and message in err


def test_multinode_needs_master_addr(capsys, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(SystemExit):
        launch.parse_args(["--nnodes", "2"])
    assert "needs --master_addr" in capsys.readouterr().err
    assert launch.parse_args(["--nnodes", "2", "--master_addr", "10.0.0.1"]).nnodes == 2


@pytest.mark.timeout(60)
def test_usage_error_from_the_command_line_is_fast():
    p = subprocess.run(
        [sys.executable, str(ROOT / "launch_single_task.py"), "--amp_level=O3"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert p.returncode == 2
    assert "usage: launch_single_task.py" in p.stderr and "invalid choice: 'O3'" in p.stderr
    p = subprocess.run(
        [sys.executable, str(ROOT / "launch_single_task.py"), "--help"],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert p.returncode == 0 and "--compiler-opt" in p.stdout and "--nproc_per_node" in p.stdout


def test_defaults_and_seed_commands():
    a = launch.parse_args(
        ["--nproc_per_node=8", "--amp_level=O1", "--compiler-opt", "--batch_size=128"]
    )
    assert (a.nproc_per_node, a.amp_level, a.compiler_opt, a.batch_size) == (8, "O1", True, 128)
    d = launch.parse_args([])
    assert d.model == "resnet50" and d.data == "mock" and d.amp_dtype is None
    assert d.master_port is None and d.compiler_opt is False
    assert launch.parse_args(["--compiler_opt"]).compiler_opt  # underscore spelling too


def test_worker_argv_round_trips():
    a = launch.parse_args(
        [
            "--nproc_per_node=2",
            "--model",
            "gpt-tiny",
            "--seq_len",
            "16",
            "--compiler-opt",
            "--amp_dtype",
            "fp16",
            "--lr",
            "0.01",
            "--max_steps",
            "7",
            "--master_port",
            "1234",
        ]
    )
    w = launch.worker_argv(a)
    assert "--nproc_per_node" not in w and "--master_port" not in w
    b = launch.parse_args(w)
    for key, value in vars(a).items():
        if key not in launch.LAUNCH_ONLY:
            assert getattr(b, key) == value, key


def test_model_registry_matches_gpt_configs():
    from gallery.gpt.model import CONFIGS

    gpt_names = {k for k, v in launch.MODELS.items() if v == "gallery.gpt.main"}
    assert gpt_names == set(CONFIGS)
    from gallery.resnet50.model import CONFIGS as RESNETS

    resnet_names = {k for k, v in launch.MODELS.items() if v == "gallery.resnet50.main"}
    assert resnet_names == set(RESNETS) == {"resnet50", "resnet-tiny"}


def test_mpi_environment_mapping():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "10.1.2.3",
        "OMPI_MCA_ess_base_jobid": "123456",
    }
    out = launch.mpi_environment(env)
    assert out["RANK"] == "3" and out["WORLD_SIZE"] == "4"
    assert out["LOCAL_RANK"] == "1" and out["LOCAL_WORLD_SIZE"] == "2"
    assert out["GROUP_RANK"] == "1" and out["MASTER_ADDR"] == "10.1.2.3"
    port = int(out["MASTER_PORT"])
    assert 20000 <= port < 40000
    # Every rank of the job derives the same port; another job gets another one.
    assert launch.mpi_environment({**env, "OMPI_COMM_WORLD_RANK": "0"})["MASTER_PORT"] == str(port)
    other = launch.mpi_environment({**env, "OMPI_MCA_ess_base_jobid": "654321"})["MASTER_PORT"]
    assert other != str(port)
    assert launch.mpi_environment({**env, "MASTER_PORT": "4242"})["MASTER_PORT"] == "4242"
    # MPICH / Intel MPI
    pmi = launch.mpi_environment({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert pmi["RANK"] == "0" and pmi["LOCAL_RANK"] == "0" and pmi["MASTER_ADDR"] == "127.0.0.1"
    assert launch.mpi_environment({}) is None
    # Several nodes but nobody said where rank 0 is.
    with pytest.raises(RuntimeError, match="master_addr"):
        launch.mpi_environment({k: v for k, v in env.items() if k != "MASTER_ADDR"})


def test_free_port_is_bindable():
    import socket

    port = launch.find_free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(120)
def test_eager_path_does_not_import_the_compiler_core():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "import gallery.resnet50.main, gallery.gpt.main\n"
        "from gallery.common.launchlib import torchacc_launch\n"
        "torchacc_launch().parse_args(['--batch_size', '2'])\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m == 'torchacc' "
        "or m.startswith(('jax.', 'torchacc.')) "
        "and m not in ('torchacc.launch', 'torchacc.launch_checks', 'torchacc.launch_args', "
        "'torchacc.mpi_env', 'torchacc.launch_registry', "
        "'torchacc.distributed.data_state'))\n"
        "assert not bad, bad\n"
    ) % str(ROOT)
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120
    )
    assert p.returncode == 0, p.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mpirun_started_process_runs_in_place(tmp_path):
    """A process started by mpirun (here: its environment, one rank) trains without spawning."""
    out = tmp_path / "m.json"
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "1",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "OMPI_MCA_ess_base_jobid": str(tmp_path),
    }
    p = run_launcher(
        "--model=gpt-tiny",
        "--seq_len=16",
        "--batch_size=2",
        "--max_steps=2",
        "--amp_level=O0",
        "--log_interval=1",
        f"--output={out}",
        env=env,
    )
    assert "[launch] gpt-tiny: mpirun, 1 process(es), this is rank 0" in p.stdout
    assert "[summary] gpt-tiny eager x1" in p.stdout
    check_metrics(load_metrics(out), steps=2, world_size=1)


def test_parse_args_returns_namespace():
    assert isinstance(launch.parse_args(["--model", "gpt2"]), argparse.Namespace)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_mpirun_one_launcher_per_node_with_several_processes_each(tmp_path):
    """``mpirun -np 2 --map-by node python launch_single_task.py --nproc_per_node=2``: each MPI
    rank is a node that spawns 2 workers; the 4 workers form one job only if every launcher
    keeps its own node rank (two "node 0"s would each start a store and never meet)."""
    from distributed_launch import free_port

    out = tmp_path / "m.json"
    flags = [
        sys.executable,
        str(ROOT / "launch_single_task.py"),
        "--nproc_per_node=2",
        "--model=gpt-tiny",
        "--seq_len=8",
        "--batch_size=1",
        "--max_steps=1",
        "--amp_level=O0",
        "--log_interval=1",
        "--mock_samples=64",
        f"--output={out}",
    ]
    port = free_port()
    procs = []
    for node in range(2):
        env = child_env(
            {
                "OMPI_COMM_WORLD_RANK": str(node),
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
                "OMPI_MCA_ess_base_jobid": str(tmp_path),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        log = open(tmp_path / f"node{node}.log", "w")  # closed below
        procs.append((subprocess.Popen(flags, cwd=ROOT, env=env, stdout=log, stderr=log), log))
    try:
        codes = [p.wait(timeout=360) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = [(tmp_path / f"node{n}.log").read_text() for n in range(2)]
    assert codes == [0, 0], "\n\n".join(text[-4000:] for text in logs)
    for text in logs:
        assert "2 node(s) x 2 process(es)" in text, text[-2000:]
    assert "[summary] gpt-tiny eager x4" in logs[0]
    check_metrics(load_metrics(out), steps=1, world_size=4)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "gpt-tiny", "--tp", "2"], "--tp 2 needs --fsdp --compiler-opt"),
        (["--model", "gpt-tiny", "--fsdp", "--cp", "2"], "--cp 2 needs --fsdp --compiler-opt"),
        (["--model", "gpt-tiny", "--tp", "0"], "tp: must be >= 1"),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--tp", "4"],
            "--tp 4 does not divide gpt-tiny's 2 attention heads",
        ),
        (
            ["--model", "llama-tiny", "--fsdp", "--compiler-opt", "--cp", "2", "--seq_len", "7"],
            "--cp 2: the sequence of 7 tokens is not divisible by cp (Ulysses) = 2",
        ),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--cp", "4", "--seq_len", "12"],
            "not divisible by 2 * cp (the causal ring's zig-zag halves) = 8",
        ),
        (["--model", "gpt-tiny", "--pp", "2"], "--pp 2 needs --fsdp --compiler-opt"),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--pp", "2", "--tp", "2"]
            + ["--mesh", "1,2"],
            "--pp 2 --tp 2 --mesh 1,2: fsdp inside the pipeline's stages does not compose",
        ),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--pp", "2", "--cp", "2"]
            + ["--pp_schedule", "GPipe"],
            "--pp 2 --cp 2 --pp_schedule GPipe: context parallel inside the stages runs the 1F1B",
        ),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--pp", "2", "--tp", "4"],
            "--tp 4 does not divide gpt-tiny's 2 attention heads",
        ),
        (
            [
                "--model",
                "gpt-tiny",
                "--fsdp",
                "--compiler-opt",
                "--pp",
                "2",
                "--nproc_per_node",
                "2",
            ],
            "--pp 2: one process drives every stage for now",
        ),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--pp", "2", "--scan-layers"],
            "--pp 2 --scan-layers: the pipeline cuts between blocks",
        ),
        (
            ["--model", "gpt-tiny", "--fsdp", "--compiler-opt", "--pp", "2", "--save_dir", "d"],
            "--pp 2 --save_dir: checkpoints of the pipeline's packed stage parameters",
        ),
        (
            ["--model", "gpt-tiny", "--num_micro_batches", "2"],
            "--num_micro_batches / --pp_schedule apply to pipeline parallel: add --pp N",
        ),
    ],
)
def test_parallel_axes_flags_are_checked_before_workers_start(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        launch.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: launch_single_task.py") and message in err
    assert len(err.strip().splitlines()[-1]) < 200  # the one line that says what is wrong
