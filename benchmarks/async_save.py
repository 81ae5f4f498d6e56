"""Asynchronous checkpoint saves overlapping training (issue 42): the step time while
``CheckpointManager.save_async`` writes, against a normal step, and the save's host memory.

    python benchmarks/async_save.py --model gpt2 --batch 8 --seq 1024 --steps 30 --save-every 10

GPT-2 (gallery/gpt, 124M parameters; ``--n_layer``/``--n_embd`` shrink it) trained with AdamW on
the torchacc device, one ``ta.sync(wait=True)`` per step so each step's wall time is its own. A
save of model + optimizer state (DCP, ``save_async``) starts at every ``--save-every``-th step;
the steps from that one until the save's write has finished are "during a save", the others
(after warm-up) "normal". Prints one JSON line: the median normal step, the median and the
largest step during a save, their ratio (issue 42 asks <= 1.2), the seconds a save's write took,
the bytes of this process's shards (a tied weight counted under each name) and the host memory
the process grew by during the saves (peak RSS over the pre-save level, which includes the
steps' own working memory: ``normal_step_growth_MiB`` is that of a step with no save; on a CPU
device it includes the on-device copy, Note [Asynchronous saves] in
torchacc/distributed/checkpoint.py), and where the CPU went: the process's CPU seconds per normal
step and per step during a save (all threads), the writer thread's CPU seconds per save, the
``save_async`` call's own time on the training thread. ``--sync`` measures ``save`` (the
blocking one) instead, for comparison; ``--writer-nice N`` sets ``CheckpointManager``'s
``writer_nice`` (0: the writer at the training's priority); ``--no-crc32`` turns off torch.save's
zip CRC-32s for the whole process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchacc as ta  # noqa: E402
from gallery.gpt.model import build_gpt  # noqa: E402
from torchacc.distributed.checkpoint import prime_optimizer  # noqa: E402
from torchacc.distributed.checkpoint_manager import CheckpointManager  # noqa: E402


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Samples RSS every 5 ms in a thread: the peak since ``reset``."""

    def __init__(self):
        self.peak = _rss()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def reset(self):
        self.peak = _rss()

    def stop(self):
        self._stop.set()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2")
    p.add_argument("--n_layer", type=int)
    p.add_argument("--n_embd", type=int)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sync", action="store_true", help="blocking saves, for comparison")
    p.add_argument("--dir", default=None)
    p.add_argument(
        "--writer-nice",
        type=int,
        default=None,
        help="CheckpointManager's writer_nice (default: its default; 0: the training's priority)",
    )
    p.add_argument(
        "--no-crc32",
        action="store_true",
        help="torch.save without zip CRC-32s (torch.utils.serialization.config.save."
        "compute_crc32 = False, process-wide: torch.load does not check them)",
    )
    args = p.parse_args(argv)
    if args.no_crc32:
        import torch.utils.serialization.config as serialization

        serialization.save.compute_crc32 = False
    overrides = {k: v for k, v in (("n_layer", args.n_layer), ("n_embd", args.n_embd)) if v}
    if "n_embd" in overrides:
        overrides["n_head"] = max(1, overrides["n_embd"] // 64)
    if args.seq > 1024:
        overrides["block_size"] = args.seq
    dev = ta.device()
    torch.manual_seed(0)
    model = build_gpt(args.model, **overrides).to(dev)
    opt = prime_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    vocab = model.config.vocab_size
    directory = args.dir or tempfile.mkdtemp(prefix="async_save_")
    nice = {} if args.writer_nice is None else {"writer_nice": args.writer_nice}
    mgr = CheckpointManager(directory, save_interval=args.save_every, max_to_keep=1, **nice)
    shard_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    shard_bytes += sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    g = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(dev) for _ in range(2)
    ]
    times, during, writes, grown = [], [], [], []
    peak = _Peak()
    base_rss = None

    def in_flight():
        return any(not f.done() for f in mgr._futures)

    def finished(started):
        def done(_):
            writes.append(time.perf_counter() - started)
            grown.append(peak.peak - base_rss)

        return done

    # CPU seconds: the process's per step (every thread: the step's XLA threads, the writer,
    # JAX's copy threads), the writer thread's per save, the save call on the training thread
    cpu_normal, cpu_during, writer_cpu, call_s = [], [], [], []
    write = mgr._save

    def timed_write(*a, **kw):
        c0 = time.thread_time()
        try:
            return write(*a, **kw)
        finally:
            writer_cpu.append(time.thread_time() - c0)

    mgr._save = timed_write
    normal_peaks = []  # RSS growth of a step with no save in flight: its own working memory
    for step in range(1, args.steps + 1):
        tokens = batches[step % 2]
        busy = in_flight()
        if not busy:
            step_base = _rss()
            peak.reset()
        t0 = time.perf_counter()
        c0 = sum(os.times()[:2])
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        ta.sync(wait=True)
        saving = step % args.save_every == 0 and step > args.warmup
        if not busy and step > args.warmup:
            normal_peaks.append(peak.peak - step_base)
        if saving:
            if not in_flight():
                base_rss = _rss()
                peak.reset()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            started = time.perf_counter()
            if args.sync:
                mgr.save(step, state)
                finished(started)(None)
            else:
                mgr.save_async(step, state)
                mgr._futures[-1].add_done_callback(finished(started))
            call_s.append(time.perf_counter() - started)
        dt = time.perf_counter() - t0
        cpu = sum(os.times()[:2]) - c0
        if step > args.warmup:
            is_during = busy or saving or in_flight()
            (during if is_during else times).append(dt)
            (cpu_during if is_during else cpu_normal).append(cpu)
    mgr.join()
    peak.stop()
    normal = statistics.median(times) if times else float("nan")
    result = {
        "device": str(ta.device()),
        "platform": os.environ.get("JAX_PLATFORMS", ""),
        "model": args.model,
        "overrides": overrides,
        "batch": args.batch,
        "seq": args.seq,
        "mode": "save" if args.sync else "save_async",
        "writer_nice": mgr.writer_nice,
        "crc32": not args.no_crc32,
        "normal_step_s": round(normal, 4),
        "steps_during_saves": len(during),
        "during_save_median_s": round(statistics.median(during), 4) if during else None,
        "during_save_max_s": round(max(during), 4) if during else None,
        "ratio_median": round(statistics.median(during) / normal, 3) if during else None,
        "ratio_max": round(max(during) / normal, 3) if during else None,
        "save_write_s": [round(w, 2) for w in writes],
        "local_shard_MiB": round(shard_bytes / 2**20, 1),
        "host_growth_MiB": [round(g / 2**20, 1) for g in grown],
        "normal_step_growth_MiB": round(max(normal_peaks) / 2**20, 1) if normal_peaks else None,
        "save_call_s": [round(c, 3) for c in call_s],
        "cpu_s_per_normal_step": round(statistics.median(cpu_normal), 2) if cpu_normal else None,
        "cpu_s_per_step_during_save": round(statistics.median(cpu_during), 2)
        if cpu_during
        else None,
        "writer_thread_cpu_s": [round(c, 2) for c in writer_cpu],
        "load_average": os.getloadavg()[0],
        "loss": float(loss.item()),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
