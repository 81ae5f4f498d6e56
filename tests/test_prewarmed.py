"""tests/prewarmed.py (Note [Pre-warmed test processes]): a forked child behaves like a fresh
``python script``: its own argv, environment, cwd, exit code, output and session."""

from __future__ import annotations

import os
import subprocess
import textwrap

import prewarmed
import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("PREWARMED_PROBE"))
    print("preloaded", "jax" in sys.modules, "torchacc" in sys.modules)
    import jax
    print("x64", jax.config.jax_enable_x64)
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
""")


def test_child_gets_its_argv_env_cwd_and_exit_code(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PREWARMED_PROBE="yes")
    p = prewarmed.run([str(script), "3"], env, str(tmp_path), timeout=60)
    assert p.returncode == 3 and p.stderr == "to stderr\n"
    assert f"argv ['3'] cwd {tmp_path} var yes" in p.stdout
    # forked from the server (torch and JAX imported), but torchacc reads its env in the child
    assert ("preloaded True False" in p.stdout) == prewarmed.enabled()
    assert not list(tmp_path.glob(".prewarmed-*"))  # the output files are gone


def test_a_variable_read_at_import_gets_its_own_server(tmp_path):
    """JAX reads JAX_ENABLE_X64 while it imports: a run with another value must not be forked
    from a server that imported JAX without it."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"}
    plain = prewarmed.run([str(script), "0"], env, str(tmp_path), timeout=60)
    x64 = prewarmed.run([str(script), "0"], dict(env, JAX_ENABLE_X64="1"), str(tmp_path), 60)
    assert "x64 False" in plain.stdout and "x64 True" in x64.stdout, (plain.stdout, x64.stdout)
    with_c = prewarmed.run(["-c", "import sys; print(sys.argv)", "a"], env, str(tmp_path), 60)
    assert with_c.returncode == 0 and with_c.stdout == "['-c', 'a']\n"


def test_timeout_kills_the_child_and_raises(tmp_path):
    (tmp_path / "sleep.py").write_text(
        "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
    )
    (tmp_path / "ok.py").write_text("print('after')\n")
    with pytest.raises(subprocess.TimeoutExpired) as e:
        prewarmed.run([str(tmp_path / "sleep.py")], dict(os.environ), str(tmp_path), timeout=3)
    assert "started" in (e.value.stdout or "")
    p = prewarmed.run([str(tmp_path / "ok.py")], dict(os.environ), str(tmp_path), timeout=60)
    assert p.returncode == 0 and p.stdout == "after\n"  # the server still serves
