"""``--cpu-times`` (tests/conftest.py) and tools/suite_cpu.py: the per-test CPU record the suite's
time budget is planned from."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_times_records_each_test_and_the_tool_sums_them_per_file(tmp_path):
    prefix = str(tmp_path / "cpu")
    node = "tests/test_architecture.py::test_every_module_says_what_it_owns"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:xdist", "-q", node,
         "tests/test_suite_cpu.py::test_the_tool_names_a_missing_record", f"--cpu-times={prefix}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = open(prefix + ".main").read().splitlines()
    assert [line.split("\t")[0] for line in lines] == [
        node,
        "tests/test_suite_cpu.py::test_the_tool_names_a_missing_record",
    ]
    own, kids, wall = map(float, lines[1].split("\t")[1:])
    assert kids > 0 and own >= 0 and wall >= 0  # the second test's child process is counted
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "suite_cpu.py"), prefix],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "tests/test_architecture.py" in out and "tests/test_suite_cpu.py" in out
    assert "over 2 tests" in out


def test_the_tool_names_a_missing_record(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "suite_cpu.py"), str(tmp_path / "none")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode != 0 and "--cpu-times=" in out.stderr
