"""What a gallery run shows besides its log: TensorBoard scalars (``--tensorboard DIR``) and a
profile of chosen steps (``--profile START:STOP``), both written by rank 0 only.

:class:`RunBoard` writes, through ``torch.utils.tensorboard`` (needs the ``tensorboard`` package)
or else ``tensorboardX``: ``train/loss`` (one point per step), ``train/samples_per_sec`` (all
processes, as the progress line), ``train/step_time_ms``, ``train/lr``, ``memory/peak_bytes`` (its
source as the text ``memory/peak_bytes_source``), ``compile/count`` and ``compile/seconds`` (the
compiler path), ``amp/loss_scale`` (with a GradScaler), ``train/tokens_per_sec`` (language models),
``perf/tflops_per_device`` and ``perf/mfu`` (the compiler path: the step program's FLOPs from XLA's
cost analysis, Note [Step FLOPs] in torchacc/metrics.py; MFU only where the device's peak is
known), and the run's flags as hparams once.

:class:`StepProfiler` captures the steps START+1..STOP (the log's step numbers): on the compiler
path with ``jax.profiler`` (``xp.start_trace``, one ``xp.StepTrace("train_step")`` per step), on
the eager path with ``torch.profiler`` (one ``ProfilerStep#N`` region per step).

Note [Observing without syncs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Nothing here reads the device. The trainer hands over values it already has on the host when it
prints a progress line: the losses it fetched for that line (one fetch per ``--log_interval``, so
``train/loss`` gets every step's point at each line), the interval's step time and samples/s, the
peak-memory reading, host counters (compiles) and the loss scale that the line prints. So
``--tensorboard`` adds no ``TransferFromDevice`` and no wait to a step. The profiler is different
by nature: it waits for the device once, after the last captured step, so that the trace holds
that step's execution.
"""

from __future__ import annotations

import glob
import os
import sys
import time

__all__ = ["RunBoard", "StepProfiler", "compile_seconds", "open_writer"]

_GIB = float(1 << 30)


def open_writer(logdir: str):
    """A TensorBoard ``SummaryWriter`` on ``logdir``: torch's, else tensorboardX's."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise RuntimeError(
                f"--tensorboard {logdir}: needs the tensorboard package (pip install "
                "tensorboard) or tensorboardX; neither is installed"
            ) from None
    return SummaryWriter(log_dir=logdir)


def _hparams_summaries(flags: dict, metric_tags: list[str]):
    try:
        from torch.utils.tensorboard.summary import hparams
    except ImportError:
        from tensorboardX.summary import hparams
    return hparams(flags, dict.fromkeys(metric_tags, 0.0))


def compile_seconds() -> float:
    """Seconds spent in XLA compiles so far (torchacc's ``CompileTime`` and
    ``DynamoCompileTime`` timings; a host-side sum)."""
    metrics = sys.modules.get("torchacc.metrics")
    if metrics is None:
        return 0.0
    total = 0.0
    for name in ("CompileTime", "DynamoCompileTime"):
        data = metrics.metric_data(name)
        if data:
            total += data[1]
    return total


def _hparam_value(value):
    if isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


class RunBoard:
    """Rank 0's TensorBoard run; see the module docstring for the tags."""

    METRICS = ["train/loss", "train/samples_per_sec", "train/step_time_ms"]

    def __init__(self, logdir: str, flags: dict):
        self.logdir = logdir
        self.writer = open_writer(logdir)
        self._losses_written = 0
        self._mem_source = None
        clean = {k: _hparam_value(v) for k, v in sorted(flags.items()) if v is not None}
        file_writer = self.writer._get_file_writer()
        for summary in _hparams_summaries(clean, self.METRICS):
            file_writer.add_summary(summary)

    def losses(self, steps: list[int], losses: list[float]) -> None:
        """Write the fetched losses not written yet; ``steps[i]`` is the 0-based index of the
        step of ``losses[i]``, its point is at step ``steps[i] + 1`` (steps done, as the log)."""
        for i in range(self._losses_written, len(losses)):
            self.writer.add_scalar("train/loss", losses[i], steps[i] + 1)
        self._losses_written = len(losses)

    def interval(
        self,
        step: int,
        *,
        samples_per_sec: float,
        step_time_s: float,
        lr,
        peak_mem_gib: float,
        mem_source: str,
        compiles: int | None = None,
        loss_scale: float | None = None,
        tokens_per_sec: float | None = None,
        tflops: float | None = None,
        mfu: float | None = None,
    ) -> None:
        """The values of the progress line printed after ``step`` steps; ``tflops`` is achieved
        TFLOP/s per device, ``mfu`` a fraction of the device's peak (None: not shown)."""
        add = self.writer.add_scalar
        add("train/samples_per_sec", samples_per_sec, step)
        add("train/step_time_ms", step_time_s * 1000.0, step)
        if isinstance(lr, (int, float)):  # a tensor LR would be a device read: left out
            add("train/lr", float(lr), step)
        add("memory/peak_bytes", peak_mem_gib * _GIB, step)
        if mem_source != self._mem_source:
            self.writer.add_text("memory/peak_bytes_source", mem_source, step)
            self._mem_source = mem_source
        if compiles is not None:
            add("compile/count", compiles, step)
            add("compile/seconds", compile_seconds(), step)
        if loss_scale is not None:
            add("amp/loss_scale", loss_scale, step)
        if tokens_per_sec is not None:
            add("train/tokens_per_sec", tokens_per_sec, step)
        if tflops is not None:
            add("perf/tflops_per_device", tflops, step)
        if mfu is not None:
            add("perf/mfu", mfu, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class StepProfiler:
    """``--profile START:STOP`` on rank 0: ``begin(i)`` before step index ``i`` (0-based),
    ``end(i)`` after its work was issued, ``after(done)`` once ``done`` steps are complete.
    ``begin`` and ``after`` return the seconds spent starting / stopping the profiler, which the
    trainer keeps out of the step times.

    ``path`` is ``"lazy"`` (``--compiler-opt``: ``xp.StepTrace``, whose exit runs the step's
    ``mark_step``: :meth:`marks_step` tells the trainer to leave its own out), ``"dynamo"``
    (``jax.profiler.StepTraceAnnotation``; the step is one compiled call) or ``"eager"``
    (``torch.profiler``)."""

    def __init__(self, window: str, profile_dir: str, path: str, cuda: bool, log):
        start, _, stop = window.partition(":")
        self.start, self.stop = int(start), int(stop)
        self.dir, self.path, self.cuda, self.log = os.path.abspath(profile_dir), path, cuda, log
        self._torch = None
        self._region = None
        self.running = False
        self.where: str | None = None

    def _in_window(self, index: int) -> bool:
        return self.start <= index < self.stop

    def marks_step(self, index: int) -> bool:
        return self.path == "lazy" and self._in_window(index)

    def begin(self, index: int) -> float:
        if not self._in_window(index):
            return 0.0
        t0 = time.perf_counter()
        if not self.running:
            self._start()
        spent = time.perf_counter() - t0
        n = index + 1
        if self.path == "lazy":
            from torchacc.torch_xla.debug import profiler as xp

            self._region = xp.StepTrace("train_step", step_num=n)
        elif self.path == "dynamo":
            import jax

            self._region = jax.profiler.StepTraceAnnotation("train_step", step_num=n)
        else:
            import torch

            self._region = torch.profiler.record_function(f"ProfilerStep#{n}")
        self._region.__enter__()
        return spent

    def end(self, index: int) -> None:
        if self._region is not None:
            region, self._region = self._region, None
            region.__exit__(None, None, None)  # lazy: xp.StepTrace's exit marks the step

    def after(self, done: int) -> float:
        if not (self.running and done >= self.stop):
            return 0.0
        t0 = time.perf_counter()
        self.finish()
        return time.perf_counter() - t0

    def _start(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        if self.path == "eager":
            import torch

            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._torch = torch.profiler.profile(activities=acts, record_shapes=False)
            self._torch.__enter__()
        else:
            from torchacc.torch_xla.debug import profiler as xp

            self._t0 = time.time()
            xp.start_trace(self.dir, create_perfetto_trace=True)
        self.running = True
        self.log(f"profiling steps {self.start + 1}..{self.stop} ({self._tool()})")

    def _tool(self) -> str:
        return "torch.profiler" if self.path == "eager" else "jax.profiler"

    def finish(self) -> None:
        """Stop (after waiting for the device) and say where the trace is; idempotent."""
        if not self.running:
            return
        self.end(-1)
        self.running = False
        if self.path == "eager":
            import torch

            if self.cuda:
                torch.cuda.synchronize()
            self._torch.__exit__(None, None, None)
            name = f"{os.uname().nodename}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json"
            self.where = os.path.join(self.dir, name)
            self._torch.export_chrome_trace(self.where)
            how = "open it in https://ui.perfetto.dev or chrome://tracing"
        else:
            import torchacc
            from torchacc.torch_xla.debug import profiler as xp

            torchacc.wait_device_ops()  # the last captured step's execution is in the trace
            xp.stop_trace()
            runs = glob.glob(os.path.join(self.dir, "plugins", "profile", "*"))
            runs = [r for r in runs if os.path.getmtime(r) >= self._t0 - 1] or runs
            self.where = max(runs, key=os.path.getmtime) if runs else self.dir
            how = (
                f"open it with `tensorboard --logdir {self.dir}` (Profile tab; pip install "
                "tensorboard-plugin-profile) or load its perfetto_trace.json.gz in "
                "https://ui.perfetto.dev"
            )
        self.log(f"profile of steps {self.start + 1}..{self.stop} ({self._tool()}): {self.where}")
        self.log(f"  {how}")
