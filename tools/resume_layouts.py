"""Resume on another layout, multi-process (issue 42 part 5): an FSDP run saved on 2 processes x 2
devices resumes on other layouts with the uninterrupted run's losses.

    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/resume_layouts.py [--layouts 1x4,4x1,1x2,1x1]
    PYTHONPATH=. JAX_PLATFORMS=cpu python tools/resume_layouts.py --eager [--layouts 2x1,1x1]

The job is tests/spmd_cases/resume_mp_worker.py (FSDPv2 on the compiler path, an MLP, AdamW, a
``StatefulDistributedSampler`` per process feeding its share of a global batch of 8, a DCP
checkpoint every 2 steps through ``CheckpointManager``). The 2 x 2 job (torchrun) runs 6 steps and
saves, then resumes its own step-2 checkpoint, once without and once with dropout. Each target
layout P x D (torchrun with P processes of D CPU devices each; P = 1 runs without torchrun) runs 6
uninterrupted steps and then resumes the 2 x 2 run's step-2 checkpoint. Checked:

- same layout: losses and final weights bit-identical to the uninterrupted run, also with dropout
  (the RNG streams restored);
- another layout: every loss within 1e-6 relative of the 2 x 2 run's; the final weights no
  further from the 2 x 2 run's than 2x what the uninterrupted run on that layout is;
- every layout: each step's global batch (the union of the processes' sample ids) is the 2 x 2
  run's, none repeated or skipped (the global order kept and re-split).

``--eager``: the eager fallback instead (tests/resume_eager_worker.py: ``ta.accelerate(backend=
'eager')``, torch's FSDP2 on CPU gloo, one process per device): saved by 4 processes as HSDP (dp 2
x fsdp 2), resumed on 2 processes (FSDP2) and on 1 (the plain model), the same checks.

Prints one line per layout and exits 1 if a check failed. tests/test_resume_layouts.py runs the
1 x 4 and 4 x 1 targets, and the eager 4 -> 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import _resume_procs as rp

ROOT = rp.ROOT
WORKER = os.path.join(ROOT, "tests", "spmd_cases", "resume_mp_worker.py")
SOURCE = (2, 2)
EAGER_WORKER = os.path.join(ROOT, "tests", "resume_eager_worker.py")
EAGER_SOURCE = (4, 1)


def launch(workdir, role, procs, devices, timeout=400, worker=WORKER):
    """Run ``worker`` as ``procs`` processes of ``devices`` CPU devices; (returncode, output)."""
    extra = {"TORCHACC_DISTRIBUTED": "0"} if worker == EAGER_WORKER else {}  # torch's own gloo job
    env = rp.environment(devices, **extra)
    proc = rp.start(rp.command(procs, [worker, str(workdir), role]), env)
    return rp.finish(proc, timeout)


def results(workdir, role, procs, devices):
    """The runs of a finished job: run -> {"losses", "seen" (step -> sorted global batch),
    "weights"} (rank 0's losses and weights, every rank's sample ids)."""
    ranks = [
        json.load(open(os.path.join(workdir, f"{role}.{procs}x{devices}.{r}.json")))
        for r in range(procs)
    ]
    out = {}
    for name, run in ranks[0]["runs"].items():
        seen = {
            int(step): sorted(i for rk in ranks for i in rk["runs"][name]["seen"][step])
            for step in run["seen"]
        }
        losses = {int(step): loss for step, loss in run["losses"].items()}
        out[name] = {"losses": losses, "seen": seen, "weights": run["weights"]}
    return out


def weight_gap(a, b):
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k]))


def check_source(src):
    """Problems of the saving layout's own resumes (bit-identical), as strings."""
    bad = []
    for ref, same in (("ref", "same"), ("ref_dropout", "same_dropout")):
        r, s = src[ref], src[same]
        if sorted(s["losses"]) != [3, 4, 5, 6]:
            bad.append(f"{same}: steps {sorted(s['losses'])}")
        for step, loss in s["losses"].items():
            if loss != r["losses"][step]:
                bad.append(f"{same}: step {step} loss {loss!r} != {r['losses'][step]!r}")
            if s["seen"][step] != r["seen"][step]:
                bad.append(f"{same}: step {step} took other samples")
        if weight_gap(r["weights"], s["weights"]) != 0.0:
            bad.append(f"{same}: weights differ by {weight_gap(r['weights'], s['weights'])}")
    if src["ref"]["losses"] == src["ref_dropout"]["losses"]:
        bad.append("dropout changed no loss: the dropout runs test nothing")
    return bad


def check_target(src, tgt):
    """Problems of a resume on another layout, and (worst loss rel. error, weight gap of the
    resumed run, weight gap of the uninterrupted run on that layout)."""
    ref, alone, resumed = src["ref"], tgt["alone"], tgt["resumed"]
    bad = []
    if sorted(resumed["losses"]) != [3, 4, 5, 6]:
        bad.append(f"resumed: steps {sorted(resumed['losses'])}")
    worst = 0.0
    for name, run in (("alone", alone), ("resumed", resumed)):
        for step, loss in run["losses"].items():
            if run["seen"][step] != ref["seen"][step]:
                bad.append(f"{name}: step {step} took {run['seen'][step]}, not {ref['seen'][step]}")
            if name == "resumed":
                rel = abs(loss - ref["losses"][step]) / abs(ref["losses"][step])
                worst = max(worst, rel)
                if rel > 1e-6:
                    bad.append(f"resumed: step {step} loss {loss!r} vs {ref['losses'][step]!r}")
    gap, own = (
        weight_gap(ref["weights"], resumed["weights"]),
        weight_gap(ref["weights"], alone["weights"]),
    )
    if gap > 2 * own:
        bad.append(f"resumed: weights {gap:.3g} from the saved run's (its own layout: {own:.3g})")
    return bad, (worst, gap, own)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default=None, help="targets, PROCSxDEVICES (default: all)")
    p.add_argument("--eager", action="store_true", help="the eager fallback (torch FSDP2/HSDP)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = p.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="resume_layouts-")
    os.makedirs(workdir, exist_ok=True)
    worker, source = (EAGER_WORKER, EAGER_SOURCE) if args.eager else (WORKER, SOURCE)
    name = "x".join(map(str, source))
    layouts = args.layouts or ("2x1,1x1" if args.eager else "1x4,4x1,1x2,1x1")
    t0 = time.time()
    rc, out = launch(workdir, "source", *source, worker=worker)
    if rc != 0:
        print(out[-4000:])
        print(f"{name} source job failed (exit {rc})")
        return 1
    src = results(workdir, "source", *source)
    bad = check_source(src)
    print(f"{name} -> {name}: {'ok' if not bad else 'FAIL ' + '; '.join(bad)} (bit-identical, "
          f"with and without dropout; {time.time() - t0:.0f} s)")  # fmt: skip
    failed = bool(bad)
    for layout in layouts.split(","):
        procs, devices = (int(x) for x in layout.split("x"))
        t = time.time()
        rc, out = launch(workdir, "target", procs, devices, worker=worker)
        if rc != 0:
            print(out[-4000:])
            print(f"{name} -> {layout}: FAIL (exit {rc})")
            failed = True
            continue
        bad, (worst, gap, own) = check_target(src, results(workdir, "target", procs, devices))
        failed = failed or bool(bad)
        print(
            f"{name} -> {layout}: {'ok' if not bad else 'FAIL ' + '; '.join(bad)} (losses <= "
            f"{worst:.2g} relative; weights {gap:.2g} from the {name} run's, the uninterrupted "
            f"{layout} run {own:.2g}; {time.time() - t:.0f} s)"
        )
    print(f"total {time.time() - t0:.0f} s; {'FAILED' if failed else 'all ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
