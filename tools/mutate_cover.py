"""Run a test selection once under coverage and record which tests execute which lines.

Used by tools/mutate.py (run in its scratch copy of the tree): each test runs in its own coverage
context (its pytest node id), so a mutant can be tried first against the tests that execute its
line. Lines run only at import time or only in subprocesses have no test here; the mutant runner
falls back to the whole selection for those.

    python tools/mutate_cover.py OUT.json TEST_PATH...
"""

from __future__ import annotations

import collections
import json
import os
import sys

import coverage
import pytest

_RC = """[run]
source = {source}
parallel = true
data_file = {data}/data
context = ${{MUTATE_TEST-}}
"""


class _PerTest:
    """Switches the coverage context to each test's node id and sums its phase durations."""

    def __init__(self, cov):
        self.cov = cov
        self.seconds = collections.defaultdict(float)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        os.environ["MUTATE_TEST"] = item.nodeid
        self.cov.switch_context(item.nodeid)
        yield
        self.cov.switch_context("")
        os.environ.pop("MUTATE_TEST", None)

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] += report.duration


def main(out: str, selection: list[str]) -> int:
    root = os.getcwd()
    data_dir = os.path.join(root, ".mutcov")
    os.makedirs(data_dir, exist_ok=True)
    rc_file = os.path.join(data_dir, "coveragerc")
    with open(rc_file, "w") as f:
        f.write(_RC.format(source=os.path.join(root, "torchacc"), data=data_dir))
    os.environ["COVERAGE_PROCESS_START"] = rc_file
    # torch runs a device's backward in a thread it starts in C++, which coverage cannot trace:
    # run backward on the calling thread so backward formulas show up in the map
    import torch

    torch.autograd.set_multithreading_enabled(False)
    cov = coverage.Coverage(config_file=rc_file)
    plugin = _PerTest(cov)
    cov.start()
    rc = pytest.main(["-n", "0", "-q", "-p", "no:cacheprovider", *selection], plugins=[plugin])
    cov.stop()
    cov.save()
    cov.combine()
    data = cov.get_data()
    lines = {}
    for path in data.measured_files():
        by_line = data.contexts_by_lineno(path)
        lines[os.path.relpath(path, root)] = {str(n): sorted(ctxs) for n, ctxs in by_line.items()}
    with open(out, "w") as f:
        json.dump({"rc": int(rc), "seconds": plugin.seconds, "lines": lines}, f)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
