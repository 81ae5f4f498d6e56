"""Paired before/after host cost of a training step: two source trees, interleaved blocks.

``--base`` and ``--head`` are two checkouts of this repository (``git worktree add --detach DIR
COMMIT``). One worker process per tree runs that tree's torchacc (``PYTHONPATH=TREE``); both start
together, warm up, then measure blocks of ``--steps`` steps in turn, A B B A A B ... (``--pairs``
blocks each), seconds apart, so a shared machine's load hits both alike (one process per tree
because each start costs a minute of CPU on a loaded 2-core box). Both run the same model code:
the gallery ResNet-50 / GPT-2 of *this* file's tree, loaded by path, at host_cost.py's narrow sizes
(a model edit between the trees is not a frontend change).

Frontends (after 3 warm-up steps):

- ``lazy``: the per-op lazy frontend, host_cost.py's seed-recipe step (batch upload, bf16 autocast,
  forward, backward, ``xm._fetch_gradients`` + ``xm.all_reduce``, ``syncfree.AdamW``, zero_grad,
  ``xm.mark_step()``), then ``xm.wait_device_ops()`` outside the timed region;
- ``trace_once``: a steady ``torchacc.dynamo.compile_step`` call (forward, backward, AdamW).

Host cost of a step = CPU time of the calling thread (``time.thread_time``) over the step minus
the CPU time spent inside the compiled program's call (XLA:CPU runs programs partly in the calling
thread; that is device work here); CPU time, unlike wall time, does not count the time the box's
other jobs hold the cores. Wall time is reported the same way. Per block the median over its
steps; per pair the ratio head / base; reported: median ratio, min / max and a bootstrap 95%
interval over the pairs. ``--ops`` instead prints, per tree, the op names of one lazy step's
program (known steps off, so the graph is walked) and of the nodes recorded, and their difference;
``--calls`` the Python calls per lazy step by function (cProfile), a count load does not move.
``--gallery DIR`` picks the gallery folder whose models both trees run.

Usage: python benchmarks/host_cost_ab.py --base DIR [--head DIR] [--pairs 12] [--steps 10]
       [--frontends lazy,trace_once] [--models resnet50-narrow,gpt2-narrow] [--json out.json]
       python benchmarks/host_cost_ab.py --base DIR --ops [--gallery DIR]
       python benchmarks/host_cost_ab.py --base DIR --calls [--steps 5]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GALLERY = os.environ.get("HOST_COST_AB_GALLERY") or os.path.join(ROOT, "gallery")
MODELS = ("resnet50-narrow", "gpt2-narrow")
FRONTENDS = ("lazy", "trace_once")


# --- child side: runs with PYTHONPATH=TREE ----------------------------------------------------


def _load(name, path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(name):
    import torch

    torch.manual_seed(0)
    if name == "resnet50-narrow":
        mod = _load("ab_resnet", os.path.join(GALLERY, "resnet50", "model.py"))
        return mod.ResNet((3, 4, 6, 3), num_classes=10, width=4)
    if name == "gpt2-narrow":
        mod = _load("ab_gpt", os.path.join(GALLERY, "gpt", "model.py"))
        return mod.build_gpt("gpt2", n_embd=64, n_head=4, vocab_size=512, block_size=16)
    raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")


def batch(name):
    import torch

    g = torch.Generator().manual_seed(0)
    if name == "resnet50-narrow":
        return torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 10, (2,), generator=g)
    return torch.randint(0, 512, (2, 16), generator=g), torch.randint(0, 512, (2, 16), generator=g)


def loss_of(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))


class _Timed:
    """Wraps a compiled program: accumulates the calling thread's CPU and wall time inside it."""

    cpu = 0.0
    wall = 0.0

    def __init__(self, exe):
        self.exe = exe

    def __call__(self, *args):
        c, w = time.thread_time(), time.perf_counter()
        try:
            return self.exe(*args)
        finally:
            _Timed.cpu += time.thread_time() - c
            _Timed.wall += time.perf_counter() - w


def _install_lazy_timer():
    from torchacc.engine import execute

    launch = execute._launch

    def _launch(exe, *args):
        return launch(_Timed(exe), *args)

    execute._launch = _launch


def _lazy(name):
    import torch

    import torchacc
    import torchacc.torch_xla.core.xla_model as xm
    from torchacc import metrics
    from torchacc.torch_xla.amp import autocast, syncfree

    dev = torchacc.device()
    model = build(name).to(dev)
    opt = syncfree.AdamW(model.parameters(), lr=1e-3)
    x, y = batch(name)

    def step():
        xd, yd = x.to(dev), y.to(dev)
        with autocast(dev, dtype=torch.bfloat16):
            loss = loss_of(model(xd), yd)
        loss.backward()
        xm.all_reduce("sum", xm._fetch_gradients(opt), scale=1.0 / xm.xrt_world_size())
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
        xm.mark_step()
        xm.wait_device_ops()

    def measure(steps):
        ops0 = metrics.counter_value("RecordedOps") or 0
        syncs0 = metrics.counter_value("MarkStep") or 0
        rows = []
        for _ in range(steps):
            _Timed.cpu = _Timed.wall = 0.0
            c0, w0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
            step()
            c1, w1 = time.thread_time(), time.perf_counter()
            xm.mark_step()
            c2, w2, p2 = time.thread_time(), time.perf_counter(), time.process_time()
            rows.append((c1 - c0, c2 - c1, _Timed.cpu, w1 - w0, w2 - w1, _Timed.wall, p2 - p0))
            xm.wait_device_ops()  # outside the timed region
        syncs = (metrics.counter_value("MarkStep") or 0) - syncs0
        return rows, ((metrics.counter_value("RecordedOps") or 0) - ops0) / max(syncs, 1)

    return measure


def _trace_once(name):
    import torch

    import torchacc.dynamo

    model = build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch(name)

    def body(x, y):
        opt.zero_grad()
        loss = loss_of(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = torchacc.dynamo.compile_step(body)
    for _ in range(3):
        step(x, y)
    progs = list(step._programs.values())
    flat = getattr(progs[0], "flat", None) if len(progs) == 1 else None
    if flat is None or flat.exe is None:
        raise RuntimeError(f"{name}: compile_step did not build one flat-buffer program")
    flat.exe = _Timed(flat.exe)

    def measure(steps):
        rows = []
        for _ in range(steps):
            _Timed.cpu = _Timed.wall = 0.0
            c0, w0, p0 = time.thread_time(), time.perf_counter(), time.process_time()
            step(x, y)
            c1, w1, p1 = time.thread_time(), time.perf_counter(), time.process_time()
            rows.append((c1 - c0, 0.0, _Timed.cpu, w1 - w0, 0.0, _Timed.wall, p1 - p0))
        return rows, None

    return measure


def child(args):
    """A worker: sets every (frontend, model) up, says READY, then measures a block of
    ``--steps`` steps of each per line read from stdin (one RESULT line per block)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch

    import torchacc

    torch.set_num_threads(1)
    benches = []
    for frontend in args.frontends.split(","):
        if frontend == "lazy":
            _install_lazy_timer()
        for name in args.models.split(","):
            fn = _lazy if frontend == "lazy" else _trace_once
            benches.append((frontend, name, fn(name)))
    print("READY " + os.path.dirname(os.path.abspath(torchacc.__file__)), flush=True)
    for _ in sys.stdin:
        result = []
        for frontend, name, measure in benches:
            rows, ops = measure(args.steps)
            med = [statistics.median(col) for col in zip(*rows)]
            result.append(
                {
                    "frontend": frontend,
                    "model": name,
                    "host_cpu_ms": statistics.median(r[0] + r[1] - r[2] for r in rows) * 1e3,
                    "host_cpu_min_ms": min(r[0] + r[1] - r[2] for r in rows) * 1e3,
                    "host_wall_ms": statistics.median(r[3] + r[4] - r[5] for r in rows) * 1e3,
                    "record_cpu_ms": med[0] * 1e3,
                    "mark_step_cpu_ms": med[1] * 1e3,
                    "program_call_cpu_ms": med[2] * 1e3,
                    "process_cpu_ms": med[6] * 1e3,
                    "ops_per_step": ops,
                }
            )
        print("RESULT " + json.dumps(result), flush=True)


def child_ops(args):
    """Op names of one lazy step's program (graph walked: known steps off) and recorded nodes."""
    os.environ["TORCHACC_KNOWN_STEPS"] = "0"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch

    import torchacc
    import torchacc.torch_xla.core.xla_model as xm
    from torchacc import metrics
    from torchacc import program as compiler
    from torchacc.torch_xla.amp import autocast, syncfree

    torch.set_num_threads(1)
    graphs = []
    graph_cls = compiler.Graph

    class Graph(graph_cls):
        __slots__ = ()

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            graphs.append(collections.Counter(n.op.rule.name for n in self.order))

    compiler.Graph = Graph
    dev = torchacc.device()
    out = {}
    for name in args.models.split(","):
        model = build(name).to(dev)
        opt = syncfree.AdamW(model.parameters(), lr=1e-3)
        x, y = batch(name)
        for i in range(3):
            if i == 2:
                graphs.clear()
                metrics.clear_counters()
            xd, yd = x.to(dev), y.to(dev)
            with autocast(dev, dtype=torch.bfloat16):
                loss = loss_of(model(xd), yd)
            loss.backward()
            xm.all_reduce("sum", xm._fetch_gradients(opt), scale=1.0 / xm.xrt_world_size())
            opt.step()
            opt.zero_grad(set_to_none=True)
            xm.mark_step()
            xm.wait_device_ops()
        program = sum(graphs, collections.Counter())
        recorded = {
            k[len("xla::") :]: metrics.counter_value(k)
            for k in metrics.counter_names()
            if k.startswith("xla::")
        }
        out[name] = {"program": dict(program), "recorded": recorded}
    print("RESULT " + json.dumps(out), flush=True)


def child_calls(args):
    """Python calls per lazy step, by function (cProfile over ``--steps`` steps after warm-up):
    a count that, unlike time, the box's load does not move."""
    import cProfile
    import pstats

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch

    torch.set_num_threads(1)
    out = {}
    for name in args.models.split(","):
        measure = _lazy(name)
        prof = cProfile.Profile()
        prof.enable()
        measure(args.steps)
        prof.disable()
        stats = pstats.Stats(prof).stats
        calls = collections.Counter()
        for (path, _line, func), (_cc, nc, *_) in stats.items():
            where = path.split("/torchacc/")[-1] if "/torchacc/" in path else path
            calls[f"{where}:{func}"] += nc / args.steps
        out[name] = dict(calls)
    print("RESULT " + json.dumps(out), flush=True)


# --- parent side ------------------------------------------------------------------------------


def run_child(tree, argv, env_extra=None):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
    env.update(env_extra or {})
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *argv],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.abspath(tree),
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["process_s"] = time.perf_counter() - start
            return result
    raise RuntimeError(f"child on {tree} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")


class Worker:
    """A child process on ``tree`` (``PYTHONPATH=tree``) that measures a block per request."""

    def __init__(self, tree, argv):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), JAX_PLATFORMS="cpu")
        self.tree = tree
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv],
            env=env,
            cwd=os.path.abspath(tree),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _line(self, prefix):
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"worker on {self.tree} exited ({self.proc.wait()})")

    def ready(self):
        return self._line("READY ")

    def block(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self._line("RESULT "))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def bootstrap(ratios, n=2000, seed=0):
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choice(ratios) for _ in ratios) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def compare_calls(args):
    argv = ["--child-calls", "--models", args.models, "--steps", str(args.steps)]
    res = {t: run_child(getattr(args, t), argv) for t in ("base", "head")}
    for name in args.models.split(","):
        a, b = res["base"][name], res["head"][name]
        print(
            f"\n{name}: Python calls per step base {sum(a.values()):.0f} head {sum(b.values()):.0f}"
        )
        diff = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:40]:
            if abs(diff[k]) >= 0.5:
                print(f"  {k:70s} {a.get(k, 0):8.1f} -> {b.get(k, 0):8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def compare_ops(args):
    argv = ["--child-ops", "--models", args.models]
    res = {t: run_child(getattr(args, t), argv) for t in ("base", "head")}
    for name in args.models.split(","):
        for kind in ("program", "recorded"):
            a, b = res["base"][name][kind], res["head"][name][kind]
            print(f"\n{name}: {kind} ops base {sum(a.values())} head {sum(b.values())}")
            for op in sorted(set(a) | set(b)):
                if a.get(op, 0) != b.get(op, 0):
                    print(f"  {op:40s} {a.get(op, 0):5d} -> {b.get(op, 0):5d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base")
    ap.add_argument("--head", default=ROOT)
    ap.add_argument("--pairs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--frontends", default=",".join(FRONTENDS))
    ap.add_argument("--gallery", help="the gallery/ folder whose models both trees run")
    ap.add_argument("--json")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-ops", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calls", action="store_true")
    ap.add_argument("--child-calls", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.child_ops:
        return child_ops(args)
    if args.child_calls:
        return child_calls(args)
    if args.gallery:  # (the children inherit it)
        os.environ["HOST_COST_AB_GALLERY"] = os.path.abspath(args.gallery)
    if not args.base:
        ap.error("--base DIR is required")
    if args.ops:
        return compare_ops(args)
    if args.calls:
        return compare_calls(args)
    argv = ["--child", "--steps", str(args.steps), "--models", args.models]
    argv += ["--frontends", args.frontends]
    workers = {t: Worker(getattr(args, t), argv) for t in ("base", "head")}
    where = {t: w.ready() for t, w in workers.items()}
    runs = {"base": [], "head": []}
    for i in range(args.pairs):
        for tree in ("base", "head") if i % 2 == 0 else ("head", "base"):  # ABBA: no order bias
            r = workers[tree].block()
            runs[tree].append(r)
            brief = ", ".join(f"{x['frontend']}/{x['model']} {x['host_cpu_ms']:.2f}" for x in r)
            print(f"pair {i + 1} {tree}: host CPU ms {brief}", flush=True)
    for w in workers.values():
        w.close()
    if args.json:  # the raw blocks first
        with open(args.json, "w") as f:
            json.dump({"runs": runs}, f, indent=1)
    print(f"\nbase {where['base']}  head {where['head']}")
    print(
        "| frontend | model | ops/step base -> head | host CPU ms base | head | ratio median "
        "[min, max] (95% bootstrap) | host wall ms base | head | wall ratio median [min, max] | "
        "fastest step CPU ms base | head | fastest-step ratio median [min, max] |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    for j, row in enumerate(runs["base"][0]):
        a = [r[j] for r in runs["base"]]
        b = [r[j] for r in runs["head"]]
        cpu = [y["host_cpu_ms"] / x["host_cpu_ms"] for x, y in zip(a, b)]
        wall = [y["host_wall_ms"] / x["host_wall_ms"] for x, y in zip(a, b)]
        low = [y["host_cpu_min_ms"] / x["host_cpu_min_ms"] for x, y in zip(a, b)]
        lo, hi = bootstrap(cpu)
        s = {
            "frontend": row["frontend"],
            "model": row["model"],
            "ops": (a[0]["ops_per_step"], b[0]["ops_per_step"]),
            "cpu": (
                statistics.median(x["host_cpu_ms"] for x in a),
                statistics.median(x["host_cpu_ms"] for x in b),
            ),
            "wall": (
                statistics.median(x["host_wall_ms"] for x in a),
                statistics.median(x["host_wall_ms"] for x in b),
            ),
            "ratio": statistics.median(cpu),
            "ratio_min_max": (min(cpu), max(cpu)),
            "ratio_ci95": (lo, hi),
            "fastest_step_cpu": (
                min(x["host_cpu_min_ms"] for x in a),
                min(x["host_cpu_min_ms"] for x in b),
            ),
            "fastest_step_ratio": statistics.median(low),
            "fastest_step_ratio_min_max": (min(low), max(low)),
            "wall_ratio": statistics.median(wall),
            "wall_ratio_min_max": (min(wall), max(wall)),
        }
        summary.append(s)
        ops = "-" if s["ops"][0] is None else f"{s['ops'][0]:.0f} -> {s['ops'][1]:.0f}"
        print(
            f"| {s['frontend']} | {s['model']} | {ops} | {s['cpu'][0]:.2f} | {s['cpu'][1]:.2f} | "
            f"{s['ratio']:.3f} [{min(cpu):.3f}, {max(cpu):.3f}] ({lo:.3f}-{hi:.3f}) | "
            f"{s['wall'][0]:.2f} | {s['wall'][1]:.2f} | {s['wall_ratio']:.3f} "
            f"[{min(wall):.3f}, {max(wall):.3f}] | {s['fastest_step_cpu'][0]:.2f} | "
            f"{s['fastest_step_cpu'][1]:.2f} | {s['fastest_step_ratio']:.3f} "
            f"[{min(low):.3f}, {max(low):.3f}] |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
