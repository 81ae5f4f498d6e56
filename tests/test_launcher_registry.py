"""The launcher finds models through its registry (torchacc/launch_registry.py), not by importing
the gallery: a provider module of one's own adds names, ``--model MODULE:FUNCTION`` runs a
function of one's own in every worker, a script path runs a script; and a flag value checkable
before workers start (``--mesh`` against the job's devices) is refused there in one line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from gallery_harness import ROOT, child_env, run_launcher

from gallery.common.launchlib import torchacc_launch

launch = torchacc_launch()

_USER_CODE = """
import json, os, sys

def main(argv):
    out = os.environ["USER_OUT"] + "." + os.environ["RANK"]
    with open(out, "w") as f:
        json.dump({"argv": argv, "world": os.environ["WORLD_SIZE"],
                   "compiler": os.environ.get("TORCHACC_COMPILER_OPT"),
                   "jax": "jax" in sys.modules}, f)

def torchacc_models():
    return [dict(name="my-net", worker="user_train:main", inputs="tokens", shards=False)]

if __name__ == "__main__":
    main(sys.argv[1:])
"""


@pytest.fixture
def user_code(tmp_path):
    (tmp_path / "user_train.py").write_text(_USER_CODE)
    return tmp_path


def _results(prefix, n):
    return [json.loads((prefix.parent / f"{prefix.name}.{r}").read_text()) for r in range(n)]


def test_no_launcher_module_imports_the_gallery():
    found = []
    for path in sorted((ROOT / "torchacc").glob("launch*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [
                f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "gallery"
            ]
    assert found == []


def test_gallery_registers_its_models():
    from gallery.gpt.model import CONFIGS

    registry = launch.registry
    assert registry.lookup("gpt-tiny").block_size() == CONFIGS["gpt-tiny"].block_size
    assert registry.lookup("resnet50").inputs == "images" and not registry.lookup("resnet50").shards
    entry = registry.lookup("my_pkg.train:main")  # not registered: a MODULE:FUNCTION entry
    assert entry.worker == "my_pkg.train:main" and entry.inputs == "tokens"
    with pytest.raises(KeyError):
        registry.lookup("my_pkg.train")


def test_a_provider_of_ones_own_adds_names(user_code):
    code = (
        "from gallery.common.launchlib import torchacc_launch\n"
        "l = torchacc_launch()\n"
        "a = l.parse_args(['--model', 'my-net', '--seq_len', '9'])\n"
        "print(l.MODELS['my-net'], a.seq_len, 'gpt-tiny' in l.MODELS)\n"
    )
    env = child_env({"TORCHACC_MODEL_PROVIDERS": "user_train"})
    env["PYTHONPATH"] = f"{user_code}:{env['PYTHONPATH']}"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["user_train:main", "9", "True"]
    env["TORCHACC_MODEL_PROVIDERS"] = "no_such_provider"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode != 0 and "cannot import provider 'no_such_provider'" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_model_function_of_ones_own_runs_in_every_worker(user_code):
    out = user_code / "out"
    env = {"USER_OUT": str(out), "PYTHONPATH": f"{user_code}:{ROOT}"}
    p = subprocess.run(
        [sys.executable, str(ROOT / "launch_single_task.py"), "--nproc_per_node=2",
         "--model=user_train:main", "--batch_size=3", "--max_steps=2"],
        cwd=user_code, env=child_env(env), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    runs = _results(out, 2)
    for r in runs:
        assert r["world"] == "2" and r["compiler"] == "0" and not r["jax"]
        assert "--batch_size" in r["argv"] and r["argv"][r["argv"].index("--max_steps") + 1] == "2"
        assert launch.parse_args(r["argv"]).batch_size == 3  # the training flags, parseable


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_script_runs_with_its_own_flags(user_code):
    out = user_code / "out"
    env = {"USER_OUT": str(out)}
    p = subprocess.run(
        [sys.executable, "-m", "torchacc.launch", "--nproc_per_node=2", "--compiler-opt",
         "user_train.py", "--lr", "3", "x"],
        cwd=user_code, env=child_env(env), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    for r in _results(out, 2):
        assert r == {"argv": ["--lr", "3", "x"], "world": "2", "compiler": "1", "jax": False}


def test_script_flags_are_not_the_launchers(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit):
        launch.parse_args(["--batch_size=4", str(script), "--lr", "1"])
    assert "--batch_size is a flag of the launcher's models" in capsys.readouterr().err
    a = launch.parse_args(["--nproc_per_node=2", str(script), "--batch_size", "1"])
    assert a.script == str(script) and a.script_args == ["--batch_size", "1"]
    assert "script" not in launch.worker_argv(a) and a.model == "resnet50"
    with pytest.raises(SystemExit):
        launch.parse_args([str(tmp_path / "missing.py")])
    assert "missing.py: no such script" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_mesh_that_does_not_hold_the_jobs_devices_is_refused_before_start():
    p = run_launcher(
        "--model=gpt-tiny", "--fsdp", "--compiler-opt", "--mesh=2,2", "--max_steps=1",
        env={"CPU_NUM_DEVICES": "1", "TORCHACC_DEVICE": "cpu"}, expect_rc=2, timeout=120,
    )  # fmt: skip
    lines = p.stderr.strip().splitlines()
    assert lines == ["launch_single_task.py: error: --mesh 2,2 holds 4 devices; this job has 1"], (
        p.stderr
    )
    assert "[launch]" not in p.stdout  # no worker was started


def test_without_a_provider_scripts_and_entries_still_launch(tmp_path, capsys, monkeypatch):
    """A pip install has no gallery: the registry is empty, the default --model is refused in
    one line only when it would be used, and a script or MODULE:FUNCTION still parses."""
    registry = launch.registry
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(registry, "_loaded", True)
    script = tmp_path / "train.py"
    script.write_text("")
    assert launch.parse_args([str(script), "--x"]).script_args == ["--x"]
    assert launch.parse_args(["--model", "pkg.mod:main"]).model == "pkg.mod:main"
    with pytest.raises(SystemExit):
        launch.parse_args([])
    err = capsys.readouterr().err
    assert "--model resnet50: no such model here (registered: none)" in err


def test_mesh_counts_the_tp_cp_pp_axes(monkeypatch):
    """``--mesh DATA,FSDP`` times ``--tp`` x ``--cp`` x ``--pp`` must hold the job's devices
    (e.g. ``--mesh 2,1 --pp 2 --tp 2`` on 8); a wrong product names every axis."""
    from argparse import Namespace

    from torchacc import launch

    monkeypatch.setenv("CPU_NUM_DEVICES", "8")
    monkeypatch.setenv("TORCHACC_DEVICE", "cpu")
    a = dict(fsdp=True, compiler_opt=True, nnodes=1, tp=2, cp=1, pp=2)
    assert launch._mesh_error(Namespace(mesh="2,1", **a), nproc=1) is None
    err = launch._mesh_error(Namespace(mesh="1,1", **a), nproc=1)
    assert err == "--mesh 1,1 x --tp 2 x --pp 2 holds 4 devices; this job has 8", err
