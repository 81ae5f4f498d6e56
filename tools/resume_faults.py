"""Fault test of checkpoint/resume on real processes and real signals (issue 42).

    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/resume_faults.py [--trials 10] [--steps 10]

A job is tests/resume_worker.py: a tiny MLP trained data-parallel on ``--world`` processes
(torchrun, one torchacc device each), a DCP checkpoint (model, AdamW, loader) every 2 steps.
Each trial (its own fixed seed) starts the job, waits for a random moment -- the start of a save
(sync or ``--async_save``), the moment its ``.tmp-<step>`` directory appears (DCP writing), or
the start of a step, at a random step, after a random delay -- and sends SIGKILL to
rank 0, rank 1 or the launcher (then to the workers too: the node is gone). It checks that every
process is gone within 60 s, then resumes from the same checkpoint directory on the same layout
or on one process, and compares with the uninterrupted runs of both layouts:

- the resumed run names the step it resumed from and the incomplete saves it skipped;
- each step's global batch (the samples of all ranks) is the uninterrupted run's: none repeated
  or skipped;
- losses: bit-identical on the same layout, <= 1e-6 relative on the other;
- final weights: bit-identical on the same layout; on the other within what the two
  uninterrupted layouts differ by (x2);
- no process runs past 60 s after a kill, no resumed run past its timeout.

The last trial is the restart path instead: ``torchrun --max-restarts 1`` with rank 1 killing
itself (SIGKILL) in the middle of a step; the job must come back by itself from the last
checkpoint. Prints one line per trial and a summary; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "resume_worker.py")


def _free_port():
    """A port free together with the next one (torchacc's JAX coordinator listens there)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")


def command(world, ckpt, log, steps, restarts=0, async_save=False):
    tail = [WORKER, ckpt, log, "--steps", str(steps)] + (["--async_save"] if async_save else [])
    if world == 1 and restarts == 0:
        return [sys.executable, *tail]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        f"--max-restarts={restarts}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        *tail,
    ]


def _env(**extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TORCHACC_CACHE_DIR="off")
    env.update(extra)
    return env


def start(world, ckpt, log, steps, restarts=0, async_save=False, **env):
    """Start a job; its output goes to ``log.out`` (a pipe nobody reads could block it)."""
    cmd = command(world, ckpt, log, steps, restarts, async_save)
    out = open(f"{log}.out", "w")
    proc = subprocess.Popen(
        cmd,
        env=_env(**env),
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    proc.output = lambda: open(f"{log}.out").read()
    return proc


def run(world, ckpt, log, steps, timeout=300, **kw):
    """Run a job to its end: (return code, output)."""
    proc = start(world, ckpt, log, steps, **kw)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return 124, proc.output()
    return proc.returncode, proc.output()


def records(log, world):
    """Per rank, the JSON lines of ``log.<rank>`` (all attempts, in order)."""
    out = {}
    for r in range(world):
        path = f"{log}.{r}"
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        out[r] = [json.loads(x) for x in lines if x.strip()]
    return out


def steps_of(log, world):
    """step -> (loss, sorted global sample ids): the last record of each step of every rank."""
    by_step = {}
    for r, recs in records(log, world).items():
        for rec in recs:
            if "loss" in rec:
                by_step.setdefault(rec["step"], {})[r] = rec
    return {
        s: (recs[0]["loss"], sorted(i for rec in recs.values() for i in rec["ids"]))
        for s, recs in by_step.items()
    }


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_at(proc, log, world, moment, step, delay, target, timeout=240):
    """Wait for ``moment`` (``save-begin``/``step-begin``) of ``step`` on rank 0, sleep
    ``delay``, SIGKILL ``target``; (seconds until every process was gone, what was seen)."""
    deadline = time.time() + timeout
    ckpt = os.path.join(os.path.dirname(log), os.path.basename(log).split(".")[0])
    while time.time() < deadline:
        if moment == "save-write":  # the save's directory exists: DCP is writing into it
            if os.path.isdir(os.path.join(ckpt, f".tmp-{step}")):
                break
            time.sleep(0.002)
            continue
        recs = records(log, world)
        if any(r.get("event") == moment and r.get("step") == step for r in recs[0]):
            break
        if proc.poll() is not None:
            out = proc.output()
            return None, f"the job ended ({proc.returncode}) before the moment: {_errors(out)}"
        time.sleep(0.01)
    else:
        return None, "the moment never came"
    time.sleep(delay)
    recs = records(log, world)
    pids = [next(r["pid"] for r in recs[k] if "pid" in r) for k in range(world)]
    killed_at = time.time()
    if target == "launcher":
        os.kill(proc.pid, signal.SIGKILL)
        for pid in pids:  # the node is gone: its workers with it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    else:
        os.kill(pids[int(target[-1])], signal.SIGKILL)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None, "HANG: the job was still running 60 s after the kill"
    while any(_alive(p) for p in pids) and time.time() - killed_at < 60:
        time.sleep(0.1)
    if any(_alive(p) for p in pids):
        return None, "HANG: a worker outlived the kill by 60 s"
    return time.time() - killed_at, "ok"


def _complete(ck):
    """Steps of the complete checkpoints in ``ck`` (CheckpointManager's rule)."""
    if not os.path.isdir(ck):
        return []
    return sorted(
        int(n)
        for n in os.listdir(ck)
        if n.isdigit() and os.path.exists(os.path.join(ck, n, ".manager_metadata"))
    )


def _errors(out):
    """The lines of a job's output that say what went wrong."""
    keys = ("Error", "error", "rank", "Traceback", "resumed")
    lines = [x for x in out.splitlines() if any(k in x for k in keys) and "Gloo" not in x]
    return "\n      ".join(lines[:25])


def compare(ref, got, first, last, exact, what):
    """Problems of steps ``first..last`` of ``got`` against ``ref`` (step -> (loss, ids))."""
    problems = []
    for s in range(first, last + 1):
        if s not in got:
            problems.append(f"{what}: step {s} missing")
            continue
        (rl, rids), (gl, gids) = ref[s], got[s]
        if rids != gids:
            problems.append(f"{what}: step {s} took samples {gids[:4]}.. not {rids[:4]}..")
        if exact and rl != gl:
            problems.append(f"{what}: step {s} loss {gl!r} != {rl!r}")
        if not exact and abs(gl - rl) > 1e-6 * abs(rl):
            problems.append(f"{what}: step {s} loss {gl!r} vs {rl!r}: rel {abs(gl - rl) / rl:.2e}")
    return problems


def weights_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="resume_faults_")
    t0 = time.time()
    refs = {}
    for world in sorted({args.world, 1}):
        ck, log = os.path.join(work, f"ref{world}"), os.path.join(work, f"ref{world}.log")
        rc, out = run(world, ck, log, args.steps)
        if rc != 0:
            print(out[-3000:])
            raise SystemExit(f"reference run on {world} process(es) failed ({rc})")
        refs[world] = (steps_of(log, world), torch.load(f"{log}.weights.pt"))
    layout_gap = weights_diff(refs[1][1], refs[args.world][1])
    print(
        f"references: {args.world} and 1 process(es), {args.steps} steps; largest weight "
        f"difference between the two layouts {layout_gap:.2e} ({time.time() - t0:.0f} s)"
    )
    failures, lines = 0, []
    for trial in range(args.trials):
        rng = random.Random(args.seed * 1000 + trial)
        ck, log = os.path.join(work, f"t{trial}"), os.path.join(work, f"t{trial}.log")
        restart = trial == args.trials - 1
        resume_world = args.world if trial % 2 == 0 or restart else 1
        async_save = rng.random() < 0.5
        problems, desc = [], ""
        if restart:
            fault_step = rng.randrange(3, args.steps, 2)  # an odd step: mid-way between saves
            desc = f"--max-restarts 1, rank 1 SIGKILLs itself in step {fault_step}"
            desc += " (async save)" if async_save else ""
            rc, out = run(
                args.world,
                ck,
                log,
                args.steps,
                restarts=1,
                async_save=async_save,
                RESUME_FAULT=f"1:{fault_step}",
            )
            if rc != 0:
                problems.append(f"the restarted job failed ({rc}): {_errors(out)}")
            resumed = [r["resumed"] for r in records(log, args.world)[0] if "resumed" in r]
            want = fault_step - 1  # the save before the fault; an async one may not be done:
            allowed = (want, want - 2) if async_save else (want,)  # then the one before it
            if len(resumed) != 1 or resumed[0] not in allowed:
                problems.append(f"resumed from {resumed}, expected one of {list(allowed)}")
            elif f"resumed from step {resumed[0]}" not in out:
                problems.append("the log does not say which step it resumed from")
            else:
                desc += f": resumed from step {resumed[0]}"
            gone = None
        else:
            moment = rng.choice(["save-begin", "save-write", "step-begin"])
            step = (
                rng.randrange(2, args.steps - 1, 2)
                if moment.startswith("save")
                else (rng.randrange(2, args.steps - 1))
            )
            delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0.02, 0.15)])
            target = rng.choice(
                ["rank0", "rank1", "launcher"][: args.world + 1 if args.world > 1 else 1]
            )
            desc = (
                f"kill -9 {target} {delay * 1000:.0f} ms after {moment} {step}"
                f"{' (async save)' if async_save else ''}, resume on {resume_world}"
            )
            proc = start(args.world, ck, log, args.steps, async_save=async_save)
            gone, seen = kill_at(proc, log, args.world, moment, step, delay, target)
            if gone is None:
                problems.append(seen)
            complete = _complete(ck)
            rc, out = run(resume_world, ck, log + ".resumed", args.steps)
            if rc != 0:
                problems.append(f"the resumed run failed ({rc}): {_errors(out)}")
            resumed = [
                r["resumed"] for r in records(log + ".resumed", resume_world)[0] if "resumed" in r
            ]
            if len(resumed) != 1 or f"resumed from step {resumed[0]}" not in out:
                resumed = [0]
            if resumed[0] != (max(complete) if complete else 0):
                problems.append(
                    f"resumed from step {resumed[0]}, the newest complete is {complete}"
                )
            desc += f": resumed from step {resumed[0]}"
            skipped = (
                [n for n in os.listdir(ck) if n.startswith(".tmp-")] if os.path.isdir(ck) else []
            )
            if skipped:
                desc += f", skipped incomplete {skipped}"
        res_world = resume_world
        res_log = log if restart else log + ".resumed"
        first = (resumed[0] if resumed else 0) + 1
        got = steps_of(res_log, res_world)
        # the uninterrupted run is the saving layout's: exact on it, 1e-6 relative on another
        same = res_world == args.world
        problems += compare(refs[args.world][0], got, first, args.steps, same, "resumed run")
        w = torch.load(f"{res_log}.weights.pt") if os.path.exists(f"{res_log}.weights.pt") else None
        if w is None:
            problems.append("no final weights")
        else:
            d = weights_diff(w, refs[args.world][1])
            if res_world == args.world and d != 0:
                problems.append(f"final weights differ from the uninterrupted run by {d:.2e}")
            if res_world != args.world and d > 2 * layout_gap + 1e-7:
                problems.append(
                    f"final weights {d:.2e} from the saving layout's, gap {layout_gap:.2e}"
                )
        status = "ok" if not problems else "FAIL"
        failures += bool(problems)
        gone_s = f", all gone {gone:.1f} s after the kill" if gone is not None else ""
        line = f"trial {trial}: {desc}{gone_s}: {status}"
        print(line + "".join(f"\n    {x}" for x in problems), flush=True)
        lines.append(line)
        shutil.rmtree(ck, ignore_errors=True)
    print(f"{args.trials - failures}/{args.trials} trials ok in {time.time() - t0:.0f} s ({work})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
