"""What the gallery trainer reports: the progress line and TensorBoard scalars of each log
interval, and the run's ``[summary]`` line, ``--output`` JSON and ``[explain]`` block. Every value
here is one the loop already has on the host (no device read; Note [Observing without syncs] in
``gallery/common/observe.py``): a new measurement (tokens/s, MFU, ...) goes here."""

from __future__ import annotations

import json
import platform
import signal

import torch

from gallery.common.checkpoint import atomic_write_bytes
from gallery.common.launchlib import torchacc_launch
from gallery.common.logger import flops_text, format_duration, log_metrics, peak_memory_gib

LAUNCH_ONLY = torchacc_launch().LAUNCH_ONLY

__all__ = ["Report", "write_json"]


def write_json(path: str, payload: dict) -> None:
    data = json.dumps(payload, indent=1, default=str).encode()
    atomic_write_bytes(path, lambda f: f.write(data))


def _flops_meter(args, door, dtype_name: str):
    """(``torchacc.metrics.FlopsWindow``, the device's peak FLOP/s or None) where torchacc compiles
    the step (Note [Step FLOPs] in torchacc/metrics.py); (None, None) on the eager path, which
    never imports torchacc. The peak: ``--peak_tflops``, else torchacc.hardware's entry for the
    JAX device kind at the step's dtype (bf16/fp16 under AMP, fp32 without); None on a CPU."""
    if not (door.compiler or door.dynamo):
        return None, None
    import torchacc
    from torchacc import hardware, metrics

    try:
        kind = torchacc.jax_device().device_kind
    except Exception:  # noqa: BLE001 - no device kind: MFU n/a, nothing else changes
        kind = ""
    dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(dtype_name, "float32")
    peak = hardware.device_peak(kind, dtype, getattr(args, "peak_tflops", None))
    return metrics.FlopsWindow(), peak


class Report:
    """The run's measurements: filled by the loop, logged per interval, summarized at the end.

    Tokens/s (language models), and where torchacc compiles the step its achieved TFLOP/s per
    device and MFU: the executed programs' FLOPs from XLA's cost analysis (read once per compile;
    per step a float add, no sync: Note [Step FLOPs] in torchacc/metrics.py) over the same time
    as samples/s."""

    def __init__(
        self, args, task, door, *, samples_per_step, total_steps, board, logger, dtype_name="fp32"
    ):
        self.args, self.task, self.door = args, task, door
        self.flops, self.peak = _flops_meter(args, door, dtype_name)
        self.steady_flops = None  # executed FLOPs when the warm-up ended (``warm``)
        self.samples_per_step, self.total_steps = samples_per_step, total_steps
        self.board, self.logger = board, logger
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.intervals: list[dict] = []
        self.compiled_steps: list[int] = []  # steps that compiled: left out of ETA / step time

    def warm(self) -> None:
        """The warm-up ended (the loop synced): the summary's steady window starts here."""
        if self.flops is not None:
            from torchacc import metrics

            self.steady_flops = metrics.executed_flops()

    def interval(self, epoch, step, interval_times, elapsed, *, optimizer, scaler, compiles):
        """The progress line (and TensorBoard scalars) of the interval ending at ``step``;
        ``interval_times``: its steps' (seconds, compiled); ``elapsed``: its wall time."""
        # Steps that compiled are left out: their time says nothing about the others.
        plain = [t for t, c in interval_times if not c]
        if plain:
            batch_time = sum(plain) / len(plain)
            eta = batch_time * (self.total_steps - step)
        else:
            batch_time, eta = elapsed / max(len(interval_times), 1), None
        sps = self.samples_per_step / batch_time if batch_time > 0 else float("nan")
        mem, mem_src = peak_memory_gib()
        scale = scaler.get_scale() if scaler is not None else None
        tokens = sps * self.task.tokens_per_sample if self.task.tokens_per_sample else None
        flops = None
        if self.flops is not None:  # the interval's steps, at its step time (as samples/s)
            flops = self.flops.take(len(interval_times), batch_time, self.peak)
        log_metrics(
            epoch,
            step,
            self.args.batch_size,
            self.losses[-1],
            batch_time,
            sps,
            mem,
            total_steps=self.total_steps,
            eta=eta,
            mem_source=mem_src,
            loss_scale=scale,
            logger=self.logger,
            tokens_per_sec=tokens,
            flops=flops,
        )
        if self.board:
            self.board.losses(self.steps, self.losses)
            self.board.interval(
                step,
                samples_per_sec=sps,
                step_time_s=batch_time,
                lr=optimizer.param_groups[0]["lr"],
                peak_mem_gib=mem,
                mem_source=mem_src,
                compiles=compiles,
                loss_scale=scale,
                tokens_per_sec=tokens,
                tflops=flops["tflops"] if flops else None,
                mfu=flops["mfu"] if flops else None,
            )
        self.intervals.append(
            {
                "step": step,
                "epoch": epoch,
                "loss": self.losses[-1],
                "batch_time": batch_time,
                "samples_per_sec": sps,
                "peak_mem_gib": mem,
                "eta_s": eta,
                "tokens_per_sec": tokens,
                "tflops_per_device": flops["tflops"] if flops else None,
                "mfu": flops["mfu"] if flops else None,
            }
        )

    def summary(self, run: dict) -> dict:
        """The run's result (``--output``'s JSON); rank 0 prints the ``[summary]`` line and the
        ``[explain]`` block. ``run``: the loop's totals and the set-up's resolved values."""
        args, task, door = self.args, self.task, self.door
        losses, warmup = self.losses, run["warmup"]
        start_step, step = run["start_step"], run["step"]
        done = step - start_step
        steady_steps = max(done - warmup, 0)
        steady_time = run["t_end"] - run["t_warm"]
        steady_sps = (
            self.samples_per_step * steady_steps / steady_time if steady_time > 0 else float("nan")
        )
        peak_mem, mem_src = peak_memory_gib()
        stop_signal, hardware, dtype_name = run["stop_signal"], run["hardware"], run["dtype_name"]
        total_time = run["t_end"] - run["t_start"]
        summary = {
            "mode": door.mode,
            "model": args.model,
            "world_size": door.world_size,
            "device": str(door.device),
            "hardware": hardware,
            "amp": f"{args.amp_level}/{dtype_name}",
            "start_step": start_step,
            "total_steps": self.total_steps,
            "steps_run": done,
            "warmup_steps": warmup,
            "first_step_time_s": run["first_step_time"],
            "compiled_steps": self.compiled_steps,
            "steady_samples_per_sec": steady_sps,
            "steady_step_time_s": steady_time / steady_steps if steady_steps > 0 else None,
            "total_time_s": total_time,
            "final_loss": losses[-1] if losses else None,
            "peak_mem_gib": peak_mem,
            "peak_mem_source": mem_src,
            "interrupted": signal.Signals(stop_signal).name if stop_signal else None,
            "save_errors": run["save_errors"],
        }
        if task.tokens_per_sample:
            summary["steady_tokens_per_sec"] = steady_sps * task.tokens_per_sample
        summary.update(self._steady_flops(steady_steps, steady_time))
        if door.compiler:  # why each compile and sync happened (the lazy path's explain report)
            from torchacc import metrics as acc_metrics

            summary["explain"] = acc_metrics.explain_summary()
        result = {
            "config": {
                **{k: v for k, v in vars(args).items() if k not in LAUNCH_ONLY},
                "mode": door.mode,
                "world_size": door.world_size,
                "device": str(door.device),
                "hardware": hardware,
                **run["config"],
                "torch": torch.__version__,
                "python": platform.python_version(),
                "host": platform.node(),
            },
            "steps": self.steps,
            "losses": losses,
            "step_times": self.step_times,
            "samples_per_sec": [
                self.samples_per_step / t if t > 0 else None for t in self.step_times
            ],
            "intervals": self.intervals,
            "summary": summary,
        }
        if door.rank == 0:
            self._print(summary, run, steady_sps, peak_mem, mem_src, total_time)
            if args.output:
                write_json(args.output, result)
        return result

    def _steady_flops(self, steady_steps: int, steady_time: float) -> dict:
        """The steady window's FLOPs per step and per device, TFLOP/s and MFU (compiled runs)."""
        if self.flops is None:
            return {}
        from torchacc import metrics

        start = self.steady_flops if self.steady_flops is not None else 0.0
        executed = metrics.executed_flops() - start
        out = {
            "step_flops": executed / steady_steps if steady_steps > 0 and executed > 0 else None,
            "steady_tflops_per_device": None,
            "mfu": None,
            "peak_tflops": self.peak / 1e12 if self.peak else None,
        }
        if out["step_flops"] and steady_time > 0:
            achieved = executed / steady_time
            out["steady_tflops_per_device"] = achieved / 1e12
            out["mfu"] = achieved / self.peak if self.peak else None
        return out

    def _print(self, summary, run, steady_sps, peak_mem, mem_src, total_time) -> None:
        args, task, door, losses = self.args, self.task, self.door, self.losses
        hardware, dtype_name = run["hardware"], run["dtype_name"]
        loss_txt = (
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps (already done)"
        )
        tok = (
            f" ({summary['steady_tokens_per_sec']:.0f} tokens/s)" if task.tokens_per_sample else ""
        )
        step_ms = (summary["steady_step_time_s"] or float("nan")) * 1000.0
        if summary.get("steady_tflops_per_device") is not None:
            flops = {"tflops": summary["steady_tflops_per_device"], "mfu": summary["mfu"]}
            tok += ", " + flops_text(flops)
        kind = hardware.split(" ")[0] if door.compiler else door.device.type
        line = (
            f"[summary] {args.model} {door.mode} x{door.world_size} {kind} {args.amp_level}/"
            f"{dtype_name} batch {args.batch_size}/proc | steps {run['start_step']}->{run['step']}"
            f" | {loss_txt} | {steady_sps:.1f} samples/s{tok}, {step_ms:.1f} ms/step after "
            f"{run['warmup']} warm-up | first step {run['first_step_time'] or 0:.2f} s | peak mem "
            f"{peak_mem:.2f} GiB ({mem_src}) | total {format_duration(total_time)} | device "
            f"{hardware}"
        )
        print(line, flush=True)
        if door.compiler:
            from torchacc import metrics as acc_metrics

            report = acc_metrics.explain_report().rstrip("\n").splitlines()
            print("\n".join(f"[explain] {ln}" for ln in report), flush=True)
