"""The training loop of the gallery, shaped like TorchAcc's ResNet-50 ``main.py`` recipe.

One loop serves every gallery model and every front door; :class:`Task` supplies the model, the
data and the loss, and a front door (``gallery/common/frontdoors/``: eager DDP, the compiler
path, FSDP, parallel modes, the whole-step compile) sets up the rest through the hooks of Note
[Front door hooks] in ``frontdoors/base.py``. Saved state is ``saving.py``'s, what is logged and
summarized ``report.py``'s. The two main paths differ only where the recipe says they do
(eager | torchacc):

- process group: ``nccl`` on GPU / ``gloo`` on CPU  |  ``xla``
  (``import torchacc.torch_xla.distributed.xla_backend``)
- device: ``cuda:LOCAL_RANK`` or CPU  |  ``xm.xla_device()`` +
  ``xm.set_replication(device, [device])``
- model: DDP (channels_last + cudnn.benchmark for CNNs on GPU)  |  ``model.to(device)``;
  ``xm.mark_step()``
- optimizer: ``torch.optim.AdamW`` (fused on CUDA)  |  ``syncfree.AdamW`` under AMP, else AdamW
- AMP O1: ``torch.autocast`` (+ ``torch.amp.GradScaler`` for fp16)  |  ``autocast(device,
  dtype=...)`` (+ ``GradScaler()`` for fp16) from ``torchacc.torch_xla.amp``
- gradients: DDP all-reduce during backward  |  ``xm._fetch_gradients(optimizer)`` +
  ``xm.all_reduce('sum', grads, scale=1.0 / world_size)``
- end of step: nothing  |  ``xm.mark_step()``

Losses stay on the device and are read once per ``--log_interval`` steps (one host sync per
interval on either path), which is also when the progress line is printed.

Faults end with one line, never a traceback (Note [Worker lifetime] in
``torchacc/launch_checks.py``): a bad path flag or ``--resume`` checkpoint exits 2; SIGINT/SIGTERM
after the first step stop every rank at the same step (:class:`_StopAgreement`), SIGTERM saves a
checkpoint first, ``--output`` is written, exit 130/143; a checkpoint that cannot be written (disk
full) is reported with the bytes needed and free and retried at the next interval, and the run
exits 1 if its final save failed. A worker that stopped for a reason it printed leaves a marker in
the launcher's run directory so the launcher adds no failure box of its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gallery.common import frontdoors
from gallery.common.exits import Reported as _Reported  # noqa: F401  (the old names)
from gallery.common.exits import exit_reported as _exit_reported
from gallery.common.frontdoors.base import resolve_amp_dtype
from gallery.common.frontdoors.compiler import xla_peak_memory_fn as _xla_peak_memory_fn  # noqa: F401
from gallery.common.frontdoors.dynamo import forward as _forward
from gallery.common.launchlib import torchacc_launch
from gallery.common.logger import create_logger, enable_torchacc_kernel, log_params
from gallery.common.observe import RunBoard, StepProfiler
from gallery.common.report import Report
from gallery.common.saving import (
    Saver,
    interrupt_line,
    load_resume,
    restore,
    resume_data_position,
)
from gallery.common.saving import unwrap as _unwrap

_launch = torchacc_launch()  # torchacc/launch.py, without importing the compiler core
LAUNCH_ONLY, find_free_port = _launch.LAUNCH_ONLY, _launch.find_free_port
mpi_environment, parse_args = _launch.mpi_environment, _launch.parse_args
checks = _launch.checks  # torchacc/launch_checks.py

__all__ = ["Task", "run", "train", "resolve_amp_dtype", "step_seed"]

_load_resume = load_resume  # the old name


@dataclass
class Task:
    """What a gallery model plugs into the shared loop."""

    name: str
    build_model: Callable[[argparse.Namespace], nn.Module]
    build_dataset: Callable[[argparse.Namespace], object]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    default_lr: float
    default_weight_decay: float
    # Applied to the input batch on the device (e.g. uint8 images -> normalized float).
    preprocess: Callable[[torch.Tensor], torch.Tensor] | None = None
    channels_last: bool = False  # a CNN: channels_last + cudnn.benchmark on the eager GPU path
    tokens_per_sample: int | None = None  # language models: also report tokens/s
    describe: Callable[[nn.Module], str] | None = None


# ----------------------------------------------------------------------------- helpers
def _ensure_distributed_env() -> None:
    """Let a worker also run alone (``python -m gallery.resnet50.main``) or under mpirun."""
    mpi = mpi_environment()
    if mpi is not None and "RANK" not in os.environ:
        os.environ.update(mpi)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise RuntimeError("MASTER_PORT is not set; start the workers with the launcher")
        os.environ["MASTER_PORT"] = str(find_free_port())


def step_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of ``step`` on ``rank``: random ops (dropout) depend only on (seed, rank,
    step), so a resumed run draws exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 1) % (2**63 - 1)


def _draws_random(model: nn.Module) -> bool:
    """Whether a training step draws random numbers (dropout with p > 0)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        p = getattr(m, "dropout", None)
        if isinstance(p, float) and p > 0:
            return True
    return False


class _StopAgreement:
    """Every ``period`` steps the ranks tell each other whether any was asked to stop (through the
    process group's store: a few host round trips, no device sync), so all stop at the same step.

    Signals reach every rank at about the same time (the terminal's Ctrl-C reaches the process
    group, torchrun forwards what it gets), but a rank may be a step ahead; stopping where each
    one heard its signal would leave the others blocked in a collective."""

    def __init__(self, stop, world_size: int, period: int):
        self.stop, self.world, self.period = stop, world_size, max(1, period)
        self.store = None
        if world_size > 1:
            store = dist.distributed_c10d._get_default_store()
            self.store = dist.PrefixStore("torchacc-stop", store)
        self._last = None

    def __call__(self, step: int) -> int | None:
        """The signal to stop with after ``step`` steps, or None to go on."""
        if self.store is None:
            return self.stop.signum
        if step % self.period:
            return None
        mine, key, store = self.stop.signum, str(step), self.store
        store.add(f"{key}/term", 1 if mine == signal.SIGTERM else 0)
        store.add(f"{key}/int", 1 if mine is not None and mine != signal.SIGTERM else 0)
        if store.add(f"{key}/n", 1) == self.world:
            store.set(f"{key}/go", "1")
        store.wait([f"{key}/go"])
        term, intr = store.add(f"{key}/term", 0), store.add(f"{key}/int", 0)
        if self._last is not None and dist.get_rank() == 0:
            for part in ("term", "int", "n", "go"):
                store.delete_key(f"{self._last}/{part}")
        self._last = key
        if term:
            return signal.SIGTERM
        return signal.SIGINT if intr else None


# ----------------------------------------------------------------------------- entry points
def run(task_factory: Callable[[argparse.Namespace], Task], argv: list[str] | None = None) -> dict:
    """Parse the launcher's flags, build the task and train. Returns the metrics (rank 0)."""
    args = parse_args(argv)
    checks.guard_worker()
    rank = int(os.environ.get("RANK", "0"))
    errors = checks.path_errors(args)
    if errors:
        raise _exit_reported(2, f"error: {errors[0]}", rank)
    err = checks.observe_errors(args)
    if err:
        raise _exit_reported(2, f"error: {err}", rank)
    _ensure_distributed_env()
    _resume_after_restart(args, rank)
    os.environ["TORCHACC_COMPILER_OPT"] = "1" if args.compiler_opt else "0"
    if args.kernel_opt:
        os.environ["TORCHACC_KERNEL_OPT"] = "1"
    return train(task_factory(args), args)


def _resume_after_restart(args: argparse.Namespace, rank: int) -> None:
    """A worker restarted by torchrun (``--max_restarts``) resumes from ``--save_dir``'s newest
    checkpoint when it has one (and no ``--resume`` was given), and says so."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or args.resume or not args.save_dir or not os.path.isdir(args.save_dir):
        return
    from gallery.common.checkpoint import list_checkpoints

    sharded = [n for n in os.listdir(args.save_dir) if n.isdigit()]
    if list_checkpoints(args.save_dir) or sharded:
        args.resume = args.save_dir
        if rank == 0:
            print(f"restart {attempt}: resuming from {args.save_dir}", flush=True)


def _default_workers(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return args.workers
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, (cpus or 1) // max(local_world, 1) - 1))


def train(task: Task, args: argparse.Namespace) -> dict:
    logger = create_logger(rank=int(os.environ["RANK"]))
    door = frontdoors.select(args, logger)  # Note [Front door hooks] in frontdoors/base.py
    lr = args.lr if args.lr is not None else task.default_lr
    weight_decay = args.weight_decay if args.weight_decay is not None else task.default_weight_decay

    # Same seed on every rank: the replicas start identical without a broadcast.
    torch.manual_seed(args.seed)
    model = task.build_model(args)
    dataset = task.build_dataset(args)
    n_params = sum(p.numel() for p in model.parameters())
    ckpt = None
    if args.resume and not door.own_checkpoints:  # sharded DCP: open_checkpoints resumes
        ckpt = load_resume(args, task, model, door.rank, logger)

    model = door.place(model, task)
    rank, world_size = door.rank, door.world_size
    amp_dtype = resolve_amp_dtype(args, door.cuda)
    optimizer = door.optimizer(model, lr, weight_decay, amp_dtype)
    scaler = door.grad_scaler(amp_dtype)
    autocast_context_manager = door.autocast(amp_dtype)
    compiled_step = door.compiled_step(task, model, optimizer, scaler, autocast_context_manager)
    start_step = door.open_checkpoints(model, optimizer) or 0
    data_state = ckpt_path = None
    if ckpt is not None:
        start_step = restore(ckpt, optimizer, scaler)
        data_state, ckpt_path = ckpt.get("data"), ckpt.get("path")
        del ckpt
    elif getattr(door, "resumed_data", None) is not None:  # a sharded checkpoint's position
        data_state, ckpt_path = door.resumed_data

    # ---- data
    loader = door.loader(dataset, _default_workers(args))
    steps_per_epoch = loader.steps_per_epoch
    if data_state is not None:  # the saved data position, checked against this run's data
        resume_data_position(loader, data_state, ckpt_path, start_step, rank, logger)
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * steps_per_epoch
    steps_to_run = max(total_steps - start_step, 0)
    warmup = args.warmup_steps if args.warmup_steps is not None else min(5, steps_to_run // 2)
    warmup = min(warmup, max(steps_to_run - 1, 0))
    samples_per_step = args.batch_size * world_size
    dtype_name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    device_name = str(door.device)
    hardware = door.hardware()
    reseed = _draws_random(_unwrap(model))  # else one seed (above) is all a step needs

    err = checks.observe_errors(args, total_steps)  # --profile inside this run (epochs known)
    if err:
        raise _exit_reported(2, f"error: {err}", rank)
    board = prof = None
    if rank == 0:
        desc = task.describe(_unwrap(model)) if task.describe else task.name
        optimizer_cls = door.optimizer_cls
        params = dict(
            mode=door.mode,
            device=device_name if hardware == device_name else f"{device_name} ({hardware})",
            world_size=world_size,
            amp=f"{args.amp_level}/{dtype_name}" + ("+GradScaler" if scaler is not None else ""),
            optimizer=optimizer_cls.__module__ + "." + optimizer_cls.__name__,
            lr_resolved=lr,
            weight_decay_resolved=weight_decay,
            steps_per_epoch=steps_per_epoch,
            total_steps=total_steps,
            start_step=start_step,
            parameters=f"{n_params:,}",
            kernel_opt=enable_torchacc_kernel(),
            model_desc=desc,
        )
        flags = {k: v for k, v in vars(args).items() if k not in LAUNCH_ONLY}
        log_params(flags, logger, **params)
        if args.tensorboard:  # Note [Observing without syncs] in gallery/common/observe.py
            board = RunBoard(args.tensorboard, {**flags, **params})
            logger.info(f"TensorBoard scalars: {args.tensorboard} (tensorboard --logdir DIR)")
        if args.profile:
            kind = "lazy" if door.compiler else "dynamo" if door.dynamo else "eager"
            prof = StepProfiler(args.profile, args.profile_dir, kind, door.cuda, logger.info)

    save = Saver(
        args, task, door, model, optimizer, scaler, steps_per_epoch, total_steps, loader=loader
    )
    report = Report(
        args,
        task,
        door,
        samples_per_step=samples_per_step,
        total_steps=total_steps,
        board=board,
        logger=logger,
        dtype_name=dtype_name,
    )
    model.train()
    loop = _loop(
        args, task, door, model, optimizer, scaler, autocast_context_manager, compiled_step,
        loader, report, save, prof, start_step, total_steps, steps_per_epoch, warmup, reseed,
    )  # fmt: skip
    step, stop_signal, saved_ok = loop["step"], loop["stop_signal"], loop["saved_ok"]

    if args.save_dir and steps_to_run > 0 and step not in saved_ok:
        if stop_signal is None or stop_signal == signal.SIGTERM:
            saved_ok[step] = save(step)

    # ---- summary
    result = report.summary(
        {
            **loop,
            "start_step": start_step,
            "warmup": warmup,
            "hardware": hardware,
            "dtype_name": dtype_name,
            "save_errors": save.errors,
            "config": {
                "amp_dtype_resolved": dtype_name,
                "grad_scaler": scaler is not None,
                "lr_resolved": lr,
                "weight_decay_resolved": weight_decay,
                "parameters": n_params,
                "steps_per_epoch": steps_per_epoch,
            },
        }
    )
    dist.destroy_process_group()
    sys.stdout.flush()
    if stop_signal is not None:
        raise _exit_reported(128 + stop_signal, interrupt_line(args, step, stop_signal), rank)
    final_failed = bool(args.save_dir and steps_to_run > 0 and saved_ok.get(step) is False)
    if final_failed:
        raise _exit_reported(1, f"error: final {save.errors[-1]}", rank)
    return result


def _loop(
    args, task, door, model, optimizer, scaler, autocast_context_manager, compiled_step,
    loader, report, save, prof, start_step, total_steps, steps_per_epoch, warmup, reseed,
) -> dict:  # fmt: skip
    """The steps from ``start_step`` to ``total_steps`` (or a stop signal): the step's own time
    only (profiler starts and stops left out), the loss read from the device once per log
    interval; returns the loop's totals for the summary."""
    rank, world_size, compiler, dynamo = door.rank, door.world_size, door.compiler, door.dynamo
    xm = getattr(door, "xm", None)
    steps, losses, step_times = report.steps, report.losses, report.step_times
    compiled_steps = report.compiled_steps
    pending: list[torch.Tensor] = []
    saved_ok: dict[int, bool] = {}
    logger = door.logger

    def fetch_losses() -> None:
        # The only device->host read of the loop: once per log interval.
        if not pending:
            return
        if compiler:
            values = [float(t.cpu()) for t in pending]
        else:
            values = torch.stack(pending).float().cpu().tolist()
        losses.extend(values)
        pending.clear()

    compile_count = door.compile_counter()
    stop = checks.StopRequest()
    agree = _StopAgreement(stop, world_size, min(args.log_interval, 10))
    previous_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop_signal = None
    steps_to_run = max(total_steps - start_step, 0)
    compiles_first = compiler or args.torch_compile
    if rank == 0 and dynamo and steps_to_run > 0:
        logger.info(
            f"torchacc-dynamo: step {start_step + 1} runs eagerly, step {start_step + 2} traces "
            "and compiles the whole step into one program, later steps launch it"
        )
    elif rank == 0 and compiles_first and steps_to_run > 0:
        logger.info(
            f"step {start_step + 1}: tracing and compiling the training step (the first step "
            "compiles; later steps reuse it)"
        )

    step = start_step
    t_start = time.perf_counter()
    t_last = t_interval = t_start
    t_warm = None
    t_first = None  # when the first step (with its compile) was done
    first_step_time = None
    interval_times: list[tuple[float, bool]] = []  # (seconds, compiled) of this interval's steps
    while step < total_steps and stop_signal is None:
        epoch, offset = divmod(step, steps_per_epoch)
        for inputs, target in loader.batches(epoch, offset, offset + total_steps - step):
            if reseed:
                torch.manual_seed(step_seed(args.seed, rank, step))
            if prof:
                t_last += prof.begin(step)  # starting the profiler is not the step's time
            compiles_before = compile_count()
            inputs, target = door.to_device(inputs, target, task.channels_last)
            if compiled_step is not None:
                loss = compiled_step(inputs, target)
            else:
                if task.preprocess is not None:
                    inputs = task.preprocess(inputs)

                with autocast_context_manager():
                    output = _forward(model, inputs)
                    loss = task.loss_fn(output, target)

                optimizer.zero_grad(set_to_none=True)
                if scaler is not None:
                    scaler.scale(loss).backward()
                    door.reduce_gradients(optimizer)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    door.reduce_gradients(optimizer)
                    optimizer.step()
                if compiler and not (prof and prof.marks_step(step)):
                    xm.mark_step()
            if prof:
                prof.end(step)  # closes the step's region (xp.StepTrace's exit: mark_step)

            pending.append(loss.detach())
            steps.append(step)
            step += 1
            done = step - start_step
            at_log = step % args.log_interval == 0 or step == total_steps
            at_warm = done == warmup
            if at_log or at_warm or done == 1:
                fetch_losses()  # synchronizes with the device
            now = time.perf_counter()
            step_times.append(now - t_last)
            compiled = done == 1 or compile_count() > compiles_before
            interval_times.append((now - t_last, compiled))
            if compiled:
                compiled_steps.append(step)
                if done > 1 and rank == 0:
                    logger.info(f"step {step} compiled a new program ({now - t_last:.2f} s)")
            t_last = now
            if done == 1:
                first_step_time = now - t_start
                t_first = now
                stop.install()  # start-up is over: signals now stop at a step boundary
                if rank == 0 and compiles_first:
                    logger.info(
                        f"first step done in {first_step_time:.2f} s (trace + compile + run); "
                        "step times and ETA count the steps after it"
                    )
            door.after_step(done, model, optimizer)
            if at_warm:
                t_warm = now
                report.warm()
            if at_log and rank == 0:
                report.interval(
                    epoch,
                    step,
                    interval_times,
                    now - t_interval,
                    optimizer=optimizer,
                    scaler=scaler,
                    compiles=compile_count() if compiler or dynamo else None,
                )
            if at_log:
                t_interval = now
                interval_times.clear()
            if prof:
                t_last += prof.after(step)  # nor is stopping it and writing the trace
            if args.save_dir and args.save_interval and step % args.save_interval == 0:
                saved_ok[step] = save(step)
            if t_first is not None:
                stop_signal = agree(step)
                if stop_signal is not None:
                    break
    fetch_losses()
    if prof:
        prof.finish()  # an interrupted run still writes what it captured
    if report.board:
        report.board.losses(steps, losses)
        report.board.close()
    t_end = time.perf_counter()
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)
    return {
        "step": step,
        "stop_signal": stop_signal,
        "saved_ok": saved_ok,
        "t_start": t_start,
        "t_warm": t_start if t_warm is None else t_warm,
        "t_end": t_end,
        "first_step_time": first_step_time,
    }
