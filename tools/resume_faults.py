"""Fault test of checkpoint/resume on real processes and real signals (issue 42).

    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/resume_faults.py [--trials 12] [--steps 8]
    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/resume_faults.py --job dp [--trials 12]

The job (``--job fsdp``, the default) is tests/spmd_cases/resume_fault_worker.py: an MLP trained
with FSDP (FSDPv2, the compiler path) over 2 processes x 2 CPU devices (torchrun), AdamW, each
process feeding its share of a global batch of 8 from a ``StatefulDistributedSampler``, a DCP
checkpoint (model, optimizer, sampler) every 2 steps through ``CheckpointManager``, sync or
``save_async`` (chosen per trial). Each trial (its own fixed seed) starts the job, waits for a
random moment -- the start of a save, the moment its ``.tmp-<step>`` directory appears (DCP
writing), or the start of a step, at a random step, after a random delay -- and sends SIGKILL to
rank 0, rank 1 or the launcher (then to the workers too: the node is gone). It checks that every
process is gone within 60 s, then resumes from a copy of the checkpoint directory twice: on the
same layout (2 x 2) and on another one (1 x 4 and 1 x 2 in turn, one process without torchrun),
and compares both with the uninterrupted runs:

- each resumed run names the step it resumed from -- the newest complete checkpoint -- and the
  incomplete saves it skipped;
- samples: each step's global batch (the samples of all ranks), the killed run's steps up to the
  checkpoint and the resumed run's after it, is the uninterrupted run's: none repeated or skipped;
- losses: bit-identical on the same layout, <= 1e-6 relative on the other one;
- final weights: bit-identical on the same layout; on the other within 2x what the uninterrupted
  runs of the two layouts differ by (reduction order);
- no process runs past 60 s after a kill, no resumed run past its timeout.

``--job dp`` is the earlier, cheaper job (tests/resume_worker.py: one device per process,
``xm.all_reduce`` of the gradients, ``ta.AsyncLoader``): 2 x 1, resumed on 2 x 1 and on 1 x 1. Its
last trial is the restart path instead: ``torchrun --max-restarts 1`` with rank 1 killing itself
(SIGKILL) in the middle of a step; the job must come back by itself from the last checkpoint.
Prints one line per trial and a summary; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import _resume_procs as rp
import torch

ROOT = rp.ROOT
WORKER = os.path.join(ROOT, "tests", "resume_worker.py")
FSDP_WORKER = os.path.join(ROOT, "tests", "spmd_cases", "resume_fault_worker.py")
# job -> (saving layout, the other layouts resumed on in turn), layouts (processes, devices each)
JOBS = {"fsdp": ((2, 2), ((1, 4), (1, 2))), "dp": ((2, 1), ((1, 1),))}


def command(world, ckpt, log, steps, restarts=0, async_save=False, devices=None):
    """The job's command line; ``devices`` (per process) picks the FSDP job, None the dp one."""
    worker = WORKER if devices is None else FSDP_WORKER
    tail = [worker, ckpt, log, "--steps", str(steps)] + (["--async_save"] if async_save else [])
    return rp.command(world, tail, restarts)


def start(world, ckpt, log, steps, restarts=0, async_save=False, devices=None, **env):
    """Start a job; its output goes to ``log.out``."""
    cmd = command(world, ckpt, log, steps, restarts, async_save, devices)
    return rp.start(cmd, rp.environment(devices, TORCHACC_CACHE_DIR="off", **env), f"{log}.out")


def run(world, ckpt, log, steps, timeout=300, **kw):
    """Run a job to its end: (return code, output; 124 past ``timeout``)."""
    return rp.finish(start(world, ckpt, log, steps, **kw), timeout)


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


def _layout(procs, devices):
    return f"{procs}x{devices}"


def check_resume(ref, layout, ckpt, log, steps, complete, incomplete, same, gap, timeout, fsdp):
    """Resume the job of ``ckpt`` (its complete checkpoints' steps, its incomplete saves) on
    ``layout`` and check it against ``ref``, the saving layout's uninterrupted run (exact when
    ``same``, else losses 1e-6 relative and weights within 2x ``gap``): (problems, wall s,
    (the largest loss relative error, the final weights' largest difference))."""
    procs, devices = layout
    devices = devices if fsdp else None
    t = time.time()
    rc, out = run(procs, ckpt, log, steps, timeout=timeout, devices=devices)
    wall = time.time() - t
    what = f"resumed on {_layout(*layout)}"
    problems = [] if rc == 0 else [f"{what}: failed ({rc}): {_errors(out)}"]
    resumed = [r["resumed"] for r in records(log, procs)[0] if "resumed" in r]
    newest = max(complete) if complete else 0
    if complete and (len(resumed) != 1 or f"resumed from step {resumed[0]}" not in out):
        problems.append(f"{what}: does not say it resumed from step {newest} ({resumed})")
    start_step = resumed[0] if resumed else 0
    if start_step != newest:
        problems.append(f"{what}: resumed from step {start_step}, the newest complete is {newest}")
    if incomplete and complete and f"skipped incomplete {incomplete}" not in out:
        problems.append(f"{what}: does not name the incomplete saves {incomplete} it skipped")
    got = steps_of(log, procs)
    problems += compare(ref[0], got, start_step + 1, steps, same, what)
    rel = [abs(got[s][0] - ref[0][s][0]) / abs(ref[0][s][0]) for s in got if s > start_step]
    w = torch.load(f"{log}.weights.pt") if os.path.exists(f"{log}.weights.pt") else None
    d = float("nan")
    if w is None:
        problems.append(f"{what}: no final weights")
    else:
        d = weights_diff(w, ref[1])
        if same and d != 0:
            problems.append(f"{what}: final weights differ from the uninterrupted run by {d:.2e}")
        if not same and d > 2 * gap:
            problems.append(
                f"{what}: final weights {d:.2e} from the saving layout's, 2x the layouts' gap "
                f"is {2 * gap:.2e}"
            )
    return problems, wall, (max(rel, default=0.0), d)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--job", choices=sorted(JOBS), default="fsdp")
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=300, help="seconds a resumed run may take")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    fsdp = args.job == "fsdp"
    saved, others = JOBS[args.job]
    world = saved[0]
    work = tempfile.mkdtemp(prefix="resume_faults_")
    t0 = time.time()
    refs = {}
    for layout in (saved, *others):
        name = _layout(*layout)
        ck, log = os.path.join(work, f"ref{name}"), os.path.join(work, f"ref{name}.log")
        devices = layout[1] if fsdp else None
        rc, out = run(layout[0], ck, log, args.steps, timeout=args.timeout, devices=devices)
        if rc != 0:
            print(out[-3000:])
            raise SystemExit(f"the uninterrupted run on {name} failed ({rc})")
        refs[layout] = (steps_of(log, layout[0]), torch.load(f"{log}.weights.pt"))
    gaps = {o: weights_diff(refs[o][1], refs[saved][1]) for o in others}
    print(
        f"uninterrupted runs ({args.job} job, {args.steps} steps) on "
        f"{', '.join(_layout(*x) for x in (saved, *others))}; largest weight difference from the "
        f"{_layout(*saved)} run: "
        + ", ".join(f"{_layout(*o)} {g:.2e}" for o, g in gaps.items())
        + f" ({time.time() - t0:.0f} s)",
        flush=True,
    )
    failures = 0
    for trial in range(args.trials):
        rng = random.Random(args.seed * 1000 + trial)
        ck, log = os.path.join(work, f"t{trial}"), os.path.join(work, f"t{trial}.log")
        async_save = rng.random() < 0.5
        other = others[trial % len(others)]
        if args.job == "dp" and trial == args.trials - 1:
            problems, desc = restart_trial(rng, ck, log, args.steps, async_save, refs[saved])
            failures += bool(problems)
            line = f"trial {trial}: {desc}: {'ok' if not problems else 'FAIL'}"
            print(line + "".join(f"\n    {x}" for x in problems), flush=True)
            continue
        moment = rng.choice(["save-begin", "save-write", "step-begin"])
        if moment.startswith("save"):
            step = rng.randrange(2, args.steps - 1, 2)
        else:
            step = rng.randrange(2, args.steps - 1)
        delay = rng.choice([0.0, rng.uniform(0, 0.02), rng.uniform(0.02, 0.15)])
        target = rng.choice(["rank0", "rank1", "launcher"])
        desc = (
            f"kill -9 {target} {delay * 1000:.0f} ms after {moment} {step}"
            f"{' (async save)' if async_save else ''}"
        )
        devices = saved[1] if fsdp else None
        proc = start(world, ck, log, args.steps, async_save=async_save, devices=devices)
        gone, seen = kill_at(proc, log, world, moment, step, delay, target)
        problems = [] if gone is not None else [seen]
        complete = _complete(ck)
        newest = max(complete) if complete else 0
        # the samples and losses the killed run took up to the checkpoint are the reference's
        problems += compare(refs[saved][0], steps_of(log, world), 1, newest, True, "killed run")
        ck_other = ck + "-other"
        if os.path.isdir(ck):
            shutil.copytree(ck, ck_other, symlinks=True)
        names = os.listdir(ck) if os.path.isdir(ck) else []
        incomplete = sorted(n for n in names if n.startswith(".tmp-"))
        walls, gaps_seen = [], []
        for layout, ckpt, suffix in ((saved, ck, ".same"), (other, ck_other, ".other")):
            same = layout == saved
            bad, wall, (rel, d) = check_resume(
                refs[saved], layout, ckpt, log + suffix, args.steps, complete, incomplete, same,
                gaps.get(layout, 0.0), args.timeout, fsdp,
            )  # fmt: skip
            problems += bad
            walls.append(f"{wall:.0f}")
            gaps_seen.append(f"losses {rel:.1e}, weights {d:.1e}")
        desc += (
            f": resumed from step {newest}" if complete else ": no complete checkpoint, from step 0"
        )
        desc += f" (skipped incomplete {incomplete})" if incomplete else ""
        desc += f" on {_layout(*saved)} and {_layout(*other)}"
        gone_s = f"; all gone {gone:.1f} s after the kill" if gone is not None else ""
        failures += bool(problems)
        line = f"trial {trial}: {desc}{gone_s}; resumes {'/'.join(walls)} s"
        line += f" ({'; '.join(gaps_seen)} from the {_layout(*saved)} run's): "
        line += "ok" if not problems else "FAIL"
        print(line + "".join(f"\n    {x}" for x in problems), flush=True)
        if not args.keep:
            shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(ck_other, ignore_errors=True)
    print(f"{args.trials - failures}/{args.trials} trials ok in {time.time() - t0:.0f} s ({work})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


def restart_trial(rng, ck, log, steps, async_save, ref):
    """``torchrun --max-restarts 1``, rank 1 SIGKILLs itself mid-step (the dp job): the job must
    come back by itself from the last checkpoint, with the uninterrupted run's samples, losses
    and weights. (problems, description)"""
    fault_step = rng.randrange(3, steps, 2)  # an odd step: mid-way between saves
    desc = f"--max-restarts 1, rank 1 SIGKILLs itself in step {fault_step}"
    desc += " (async save)" if async_save else ""
    rc, out = run(
        2, ck, log, steps, restarts=1, async_save=async_save, RESUME_FAULT=f"1:{fault_step}"
    )
    problems = [] if rc == 0 else [f"the restarted job failed ({rc}): {_errors(out)}"]
    resumed = [r["resumed"] for r in records(log, 2)[0] if "resumed" in r]
    want = fault_step - 1  # the save before the fault; an async one may not be done:
    allowed = (want, want - 2) if async_save else (want,)  # then the one before it
    if len(resumed) != 1 or resumed[0] not in allowed:
        problems.append(f"resumed from {resumed}, expected one of {list(allowed)}")
    elif f"resumed from step {resumed[0]}" not in out:
        problems.append("the log does not say which step it resumed from")
    else:
        desc += f": resumed from step {resumed[0]}"
    problems += compare(ref[0], steps_of(log, 2), 1, steps, True, "restarted run")
    w = torch.load(f"{log}.weights.pt") if os.path.exists(f"{log}.weights.pt") else None
    if w is None or weights_diff(w, ref[1]) != 0:
        problems.append("final weights missing or not the uninterrupted run's")
    return problems, desc


if __name__ == "__main__":
    sys.exit(main())
