"""Mutation testing for torchacc: seed one fault at a time and see whether the tests notice.

    nice -n 19 python tools/mutate.py --package amp --sample 60 --seed 0
    python tools/mutate.py --package amp --report          # kill rate and survivors so far
    python tools/mutate.py --package amp --only 'torchacc/amp/grad_scaler.py:88:...'  # re-try

Why not mutmut 3: it runs the tests once in-process and then fork()s a child per mutant; by then
JAX's runtime threads are running and every forked child hangs. This runner starts a fresh Python
for every mutant instead.

How it works (Note [Mutation runner]):
1. The tree is copied to a scratch directory (``--workdir``, default /tmp/torchacc-mutate/PKG);
   the checkout itself is never touched, so you can keep working while it runs.
2. The package's test selection (PACKAGES below) runs once under coverage with one context per
   test (tools/mutate_cover.py): it must pass, and it tells which tests execute which line.
3. Mutants (tools/mutants.py) are enumerated for the package's modules; ``--sample N`` takes a
   seeded random sample of N.
4. Each mutant is written into the copy and tried in a fresh ``python -m pytest -x`` run of the
   tests that execute its lines, fastest first (subprocesses count: the launcher and torchrun
   workers are measured too). A line run only at import time gets the whole selection; a line no
   test executes is recorded "not executed" without a run (it counts as a survivor).
   ``--confirm`` also tries every survivor on the whole selection. Killed = a test failed or
   errored (a mutant that breaks import is killed too); a run past its time limit counts as
   killed by timeout and is listed apart.
5. Results go to ``.mutation/PKG.jsonl`` in the checkout (one line per mutant, so a run can be
   stopped and resumed); ``--report`` prints the kill rate and the survivors.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutants import Mutant, mutants_of  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CORE_TESTS = [
    "tests/test_core_device.py",
    "tests/test_core_aliasing.py",
    "tests/test_core_memory.py",
    "tests/test_core_autograd_kernels.py",
    "tests/test_core_training.py",
    "tests/test_optim_fused.py",
    "tests/test_metrics_report.py",
    "tests/test_compat_xla_model.py::test_mark_step_closures_and_metrics",  # after-sync hooks
]
# lazy's own modules tested outside the core files: layer and fused kernels, debug-mode op sites,
# torch_xla's lenient float targets and activation checkpointing's device RNG state
_LAZY_TESTS = _CORE_TESTS + [
    "tests/test_core_layer_kernels.py",
    "tests/test_ops_kernels.py",
    "tests/test_core_explain.py::test_debug_names_each_read_sync_and_each_recompile",
    "tests/test_compat_torch_xla_cases.py::test_cross_entropy_and_nll_accept_float_class_targets",
    "tests/test_compat_torch_xla_api.py::test_checkpoint_replays_dropout_and_matches_plain_backward",
]
# package -> (modules to mutate, tests that should notice)
PACKAGES = {
    "lazy": (["torchacc/lazy/*.py"], _LAZY_TESTS),
    "engine": (["torchacc/engine/*.py"], _CORE_TESTS),
    "program": (["torchacc/program/*.py"], _CORE_TESTS),
    "ir": (["torchacc/ir/*.py"], _CORE_TESTS),
    "amp": (
        ["torchacc/amp/*.py", "torchacc/amp/syncfree/*.py"],
        [
            "tests/test_amp_autocast.py",
            "tests/test_amp_autocast_vs_cuda.py",
            "tests/test_amp_grad_scaler.py",
            "tests/test_syncfree.py",
            "tests/test_optim_fused.py",
        ],
    ),
    "distributed": (
        ["torchacc/distributed/*.py"],
        [
            "tests/test_distributed_collectives.py",
            "tests/test_distributed_training.py",
            "tests/test_distributed_failure.py",
        ],
    ),
    "torch_xla": (
        ["torchacc/torch_xla/**/*.py"],
        [
            "tests/test_compat_torch_xla_api.py",
            "tests/test_compat_torch_xla_cases.py",
            "tests/test_compat_xla_model.py",
            "tests/test_compat_alias.py",
            "tests/test_distributed_parallel_loader.py",
            "tests/test_metrics_report.py",
        ],
    ),
}
# the default --max-test-seconds where 15 s would leave out the tests that matter
_MAX_TEST_SECONDS = {"distributed": 0.0}
_COPY = ["torchacc", "tests", "tools", "gallery", "benchmarks", "pyproject.toml"]
_COPY += ["launch_single_task.py", "torchacc_ops", "README.md", "docs"]


def modules(package):
    found = []
    for pattern in PACKAGES[package][0]:
        found += glob.glob(os.path.join(REPO, pattern), recursive=True)
    return sorted(os.path.relpath(p, REPO) for p in found)


def all_mutants(package):
    out = []
    for path in modules(package):
        with open(os.path.join(REPO, path)) as f:
            out += mutants_of(path, f.read())
    return out


def prepare(workdir):
    """A fresh copy of the tree without bytecode caches (mutants run with bytecode writing off, so
    a stale .pyc can never stand in for a mutated module)."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc", "*.pt")
    for name in _COPY:
        src = os.path.join(REPO, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(workdir, name), ignore=ignore)
        elif os.path.exists(src):
            shutil.copy2(src, workdir)


def child_env(workdir, cache):
    env = dict(os.environ)
    env.update(
        PYTHONPATH=workdir,
        JAX_PLATFORMS="cpu",
        PYTHONDONTWRITEBYTECODE="1",
        TORCHACC_CACHE_DIR=cache,
        OMP_NUM_THREADS="1",
    )
    return env


def _tree_hash(selection):
    """Hash of what a coverage map depends on: the sources, the selected test files and the
    test helpers (the map is reused while they are unchanged)."""
    h = hashlib.sha1(" ".join(selection).encode())
    files = {os.path.join(REPO, t.split("::")[0]) for t in selection}
    for pattern in (
        "torchacc/**/*.py",
        "torchacc_ops/**/*.py",
        "gallery/**/*.py",
        "tests/[!t]*.py",
    ):
        files.update(glob.glob(os.path.join(REPO, pattern), recursive=True))
    for path in sorted(files):
        with open(path, "rb") as f:
            h.update(path.encode() + f.read())
    return h.hexdigest()[:16]


def cover(package, workdir, cache):
    """Run the selection once under coverage in the copy; returns its per-test line map."""
    selection = PACKAGES[package][1]
    saved = os.path.join(os.path.dirname(workdir), f"coverage-{_tree_hash(selection)}.json")
    if not os.path.exists(saved):
        cmd = [sys.executable, "tools/mutate_cover.py", saved, *selection]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=workdir, env=child_env(workdir, cache))
        if proc.returncode != 0:
            if os.path.exists(saved):  # never reuse the map of a failed baseline
                os.remove(saved)
            sys.exit(f"the {package} tests fail without any mutant (rc {proc.returncode})")
        print(f"baseline under coverage: {time.time() - t0:.0f} s")
    with open(saved) as f:
        data = json.load(f)
    print(f"coverage map {saved}: {len(data['seconds'])} tests")
    return data


def run_tests(nodeids, workdir, cache, limit):
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider"]
    cmd += ["--timeout", str(int(limit)), *nodeids]
    proc = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=child_env(workdir, cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=limit + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return "timeout", f"no result in {limit + 60:.0f} s"
    if proc.returncode == 0:
        return "survived", None
    if proc.returncode == 5:
        raise RuntimeError(f"no tests collected from {nodeids[:3]}...\n{output[-2000:]}")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if "Timeout" in output and not failed:
        return "timeout", output[-600:]
    return "killed", failed[0] if failed else f"rc {proc.returncode}"


def try_mutant(m: Mutant, cov, workdir, cache, confirm=False, max_seconds=None):
    path = os.path.join(workdir, m.path)
    with open(path) as f:
        original = f.read()
    lines = cov["lines"].get(m.path, {})
    contexts = set()
    for n in range(m.line, m.end_line + 1):
        contexts.update(lines.get(str(n), ()))
    if not contexts:  # e.g. a default in a multi-line ``def``: coverage reports the def line
        contexts.update(lines.get(str(m.stmt_line), ()))
    seconds = cov["seconds"]
    if max_seconds:  # leave out the slowest tests (see --max-test-seconds)
        seconds = {t: s for t, s in seconds.items() if s <= max_seconds}
    covering = (contexts - {""}) & set(seconds)
    everything = sorted(seconds, key=lambda t: seconds[t])
    if not everything:
        raise SystemExit("no tests left to run (see --max-test-seconds)")
    if "" in contexts:  # runs at import time (module-level code): every test depends on it
        phases = [("all", everything)]
    elif covering:  # fastest first: a killed mutant stops at its first failing test (-x)
        phases = [("covering", sorted(covering, key=lambda t: seconds.get(t, 0.0)))]
        if confirm and len(covering) < len(everything):
            phases.append(("all", everything))
    else:  # no test, or only tests left out by --max-test-seconds, executes these lines
        phases = []
    status, killer, phase = "not executed", None, None
    if contexts - {""} and not covering:
        killer = "only slow tests execute it"
    t0 = time.time()
    try:
        with open(path, "w") as f:
            f.write(m.apply(original))
        for phase, tests in phases:  # noqa: B007 (the last phase run is recorded)
            limit = 3 * sum(seconds.get(t, 0.0) for t in tests) + 60
            status, killer = run_tests(tests, workdir, cache, limit)
            if status != "survived":
                break
    finally:
        with open(path, "w") as f:
            f.write(original)
    return {
        "id": m.ident,
        "path": m.path,
        "line": m.line,
        "operator": m.operator,
        "original": m.original(original)[:200],
        "replacement": m.replacement[:200],
        "status": status,
        "killer": killer,
        "phase": phase,
        "tests": len(covering),
        "seconds": round(time.time() - t0, 1),
    }


def load(results):
    done = {}
    if os.path.exists(results):
        with open(results) as f:
            for line in f:
                r = json.loads(line)
                done[r["id"]] = r
    return done


def report(package, results):
    done = load(results)
    by_status = collections.Counter(r["status"] for r in done.values())
    total = len(done)
    killed = by_status["killed"] + by_status["timeout"]
    rate = 100.0 * killed / total if total else 0.0
    print(f"{package}: {killed}/{total} killed ({rate:.0f}%), {by_status['timeout']} by timeout")
    print(f"  {by_status['not executed']} of the survivors are on lines no test executes")
    for r in sorted(done.values(), key=lambda r: (r["path"], r["line"])):
        if r["status"] in ("survived", "not executed"):
            how = f"{r['status']}, {r['tests']} tests ran" if r["tests"] else r["status"]
            print(f"  {r['id']}  `{r['original']}` -> `{r['replacement']}`  ({how})")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--package", required=True, choices=sorted(PACKAGES))
    p.add_argument("--sample", type=int, default=0, help="seeded random sample of N mutants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", default=[], help="mutant id(s) to (re)try")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--report", action="store_true", help="print results so far and exit")
    p.add_argument("--fresh", action="store_true", help="forget earlier results")
    p.add_argument(
        "--confirm",
        action="store_true",
        help="try a mutant that survives the tests executing its lines on the whole selection",
    )
    p.add_argument(
        "--max-test-seconds",
        type=float,
        default=None,
        help="leave out tests that took longer in the baseline (0: keep all; default 15, but 0 "
        "for distributed, whose tests are all multi-process jobs of 15-40 s)",
    )
    p.add_argument(
        "--tests",
        nargs="+",
        help="try the mutants on these tests only, without the coverage run (checking that a new "
        "test kills a survivor)",
    )
    p.add_argument("--workdir", default=None)
    args = p.parse_args(argv)

    if args.max_test_seconds is None:
        args.max_test_seconds = _MAX_TEST_SECONDS.get(args.package, 15.0)
    results = os.path.join(REPO, ".mutation", f"{args.package}.jsonl")
    if args.report:
        return report(args.package, results)
    mutants = all_mutants(args.package)
    if args.only:
        chosen = [m for m in mutants if m.ident in args.only]
        missing = set(args.only) - {m.ident for m in chosen}
        if missing:
            sys.exit(f"no such mutant: {sorted(missing)}")
    elif args.sample:
        chosen = random.Random(args.seed).sample(mutants, min(args.sample, len(mutants)))
    else:
        chosen = mutants
    chosen.sort(key=lambda m: (m.path, m.line, m.col))
    if args.list:
        for m in chosen:
            print(m.ident, "->", m.replacement)
        print(f"{len(chosen)} of {len(mutants)} mutants")
        return
    os.makedirs(os.path.dirname(results), exist_ok=True)
    if args.fresh and os.path.exists(results):
        os.remove(results)
    done = load(results)
    todo = [m for m in chosen if args.only or m.ident not in done]
    workdir = args.workdir or os.path.join("/tmp", "torchacc-mutate", args.package)
    cache = os.path.join(os.path.dirname(workdir), "jax-cache")
    prepare(workdir)
    if args.tests:  # every mutant runs exactly these tests ("" = as if run at import time)
        lines = {str(n): [""] for m in todo for n in range(m.line, m.end_line + 1)}
        cov = {"seconds": {t: 30.0 for t in args.tests}, "lines": {m.path: lines for m in todo}}
        args.max_test_seconds = 0
    else:
        cov = cover(args.package, workdir, cache)
    print(f"{len(todo)} mutants to try ({len(chosen)} chosen of {len(mutants)})", flush=True)
    for i, m in enumerate(todo):
        r = try_mutant(m, cov, workdir, cache, args.confirm, args.max_test_seconds)
        done[r["id"]] = r
        with open(results, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in done.values())
        print(f"[{i + 1}/{len(todo)}] {r['status']:8} {r['seconds']:6.1f}s {m.ident}", flush=True)
    report(args.package, results)


if __name__ == "__main__":
    main()
