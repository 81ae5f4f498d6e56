"""The training loop of the gallery, shaped like TorchAcc's ResNet-50 ``main.py`` recipe.

One loop serves every gallery model and both paths; :class:`Task` supplies the model, the data
and the loss. The two paths differ only where the recipe says they do (eager | torchacc):

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
import contextlib
import json
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gallery.common.checkpoint import (
    CheckpointError,
    atomic_write_bytes,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    save_failure_line,
    state_mismatch,
    state_nbytes,
    to_cpu,
)
from gallery.common.data import EpochBatches
from gallery.common.launchlib import torchacc_launch
from gallery.common.logger import (
    create_logger,
    enable_torchacc_compiler,
    enable_torchacc_kernel,
    format_duration,
    log_metrics,
    log_params,
    peak_memory_gib,
    reset_peak_memory_fn,
    set_peak_memory_fn,
)
from gallery.common.observe import RunBoard, StepProfiler

_launch = torchacc_launch()  # torchacc/launch.py, without importing the compiler core
LAUNCH_ONLY, find_free_port = _launch.LAUNCH_ONLY, _launch.find_free_port
mpi_environment, parse_args = _launch.mpi_environment, _launch.parse_args
checks = _launch.checks  # torchacc/launch_checks.py

__all__ = ["Task", "run", "train", "resolve_amp_dtype", "step_seed"]


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


def resolve_amp_dtype(args: argparse.Namespace, cuda: bool) -> torch.dtype | None:
    """None for O0; else the --amp_dtype, by default bf16 where supported (not on pre-Ampere
    GPUs such as V100, which get fp16)."""
    if args.amp_level == "O0":
        return None
    name = args.amp_dtype
    if name is None:
        name = "fp16" if cuda and not torch.cuda.is_bf16_supported() else "bf16"
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[name]


def step_seed(seed: int, rank: int, step: int) -> int:
    """The RNG seed of ``step`` on ``rank``: random ops (dropout) depend only on (seed, rank,
    step), so a resumed run draws exactly what an uninterrupted one would."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729 + 1) % (2**63 - 1)


def _unwrap(model: nn.Module) -> nn.Module:
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            return model


def _xla_peak_memory_fn(xm, device) -> Callable[[], float]:
    """Peak device bytes from ``xm.get_memory_info``, whichever torch_xla-era keys it returns."""

    def read() -> float:
        info = xm.get_memory_info(device)
        for key in ("peak_bytes_used", "bytes_used"):
            if key in info:
                return float(info[key])
        if "kb_total" in info and "kb_free" in info:
            return float(info["kb_total"] - info["kb_free"]) * 1024.0
        raise KeyError(f"unexpected xm.get_memory_info keys: {sorted(info)}")

    return read


def _write_json(path: str, payload: dict) -> None:
    data = json.dumps(payload, indent=1, default=str).encode()
    atomic_write_bytes(path, lambda f: f.write(data))


class _Reported(SystemExit):
    """Exit with ``code`` after printing why; the launcher then adds no failure box."""


def _exit_reported(code: int, line: str | None, rank: int = 0) -> _Reported:
    if line and rank == 0:
        print(line, file=sys.stderr if code == 2 else sys.stdout, flush=True)
    run_dir = os.environ.get(checks.RUN_DIR_ENV)
    if run_dir and os.path.isdir(run_dir):
        try:
            with open(os.path.join(run_dir, f"reported-rank{rank}"), "w") as f:
                f.write(str(code))
        except OSError:
            pass
    sys.stdout.flush()
    return _Reported(code)


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


def _compile_counter(compiler: bool, dynamo: bool = False) -> Callable[[], int]:
    """Programs compiled so far (torch_xla's ``UncachedCompile`` counter; compile_step's traces
    with --compile_mode=dynamo); 0 on the eager path."""
    if dynamo:
        from torchacc import metrics

        return lambda: metrics.counter_value("StepTrace") or 0
    if not compiler:
        return lambda: 0
    import torchacc.torch_xla.debug.metrics as met

    return lambda: met.counter_value("UncachedCompile") or 0


def _hardware(compiler: bool, device, local_rank: int) -> str:
    """The run's device in words: ``XLA:GPU <name>``, ``XLA:CPU``, ``cuda:0 <name>``, ``cpu``."""
    if compiler:
        import torchacc

        hw = torchacc.device_hw()
        if hw == "GPU":
            try:
                return f"XLA:GPU {torchacc.jax_device().device_kind}"
            except Exception:
                return "XLA:GPU"
        return "XLA:CPU"
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return str(device)


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
    os.environ["TORCHACC_COMPILER_OPT"] = "1" if args.compiler_opt else "0"
    if args.kernel_opt:
        os.environ["TORCHACC_KERNEL_OPT"] = "1"
    return train(task_factory(args), args)


def _dynamo_mode(args: argparse.Namespace) -> bool:
    return bool(args.compiler_opt) and getattr(args, "compile_mode", "lazy") == "dynamo"


def _compiled_step(task: Task, model: nn.Module, optimizer, scaler, autocast_cm, world_size: int):
    """The whole training step (preprocess, forward, loss, backward, gradient all-reduce,
    GradScaler, optimizer update) as one program through ``torchacc.dynamo.compile_step``; its
    first call runs eagerly, the second traces and compiles, later ones launch the program. The
    LR stays a runtime input; the all-reduce is the recipe's ``xm.all_reduce``, compiled into
    the step."""
    from torchacc.dynamo import compile_step

    xm = None
    if world_size > 1:
        import torchacc.torch_xla.core.xla_model as xm

    def train_step(inputs, target):
        if task.preprocess is not None:
            inputs = task.preprocess(inputs)
        with autocast_cm():
            loss = task.loss_fn(_forward(model, inputs), target)
        optimizer.zero_grad(set_to_none=True)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if xm is not None:
            xm.all_reduce("sum", xm._fetch_gradients(optimizer), scale=1.0 / world_size)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        return loss.detach()

    scalers = [scaler] if scaler is not None else []
    return compile_step(train_step, models=[model], optimizers=[optimizer], scalers=scalers)


def _load_resume(args, task: Task, model: nn.Module, rank: int, logger) -> dict:
    """The ``--resume`` checkpoint, loaded safely and checked against this run; a problem exits 2
    with one line."""
    warn = logger.warning if rank == 0 else (lambda line: None)
    try:
        path, _ = resolve_checkpoint(args.resume, warn=warn)
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise _exit_reported(2, f"error: --resume {e}", rank) from None
    trained = ckpt.get("model_name") or (ckpt.get("args") or {}).get("model")
    if trained is not None and trained != task.name:
        raise _exit_reported(
            2,
            f"error: --resume {path}: checkpoint of model {trained}, this run trains {task.name}",
            rank,
        )
    diff = state_mismatch(model.state_dict(), ckpt["model"], "parameter/buffer")
    if diff:
        raise _exit_reported(
            2, f"error: --resume {path}: the checkpoint does not fit {task.name}: {diff}", rank
        )
    model.load_state_dict(ckpt["model"])
    ckpt["path"] = path
    return ckpt


def _shard_fsdpv2(model, args, logger):
    """--fsdp --compiler-opt: FSDPv2 over a (data, fsdp) mesh of every device; returns
    (mesh, wrapped model) and logs each device's bytes of parameters."""
    import numpy as np

    import torchacc.torch_xla.distributed.spmd as xs
    import torchacc.torch_xla.runtime as xr
    from torchacc.distributed import sharding
    from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
    )

    n = xr.global_runtime_device_count()
    data, shards = (int(x) for x in args.mesh.split(",")) if args.mesh else (1, n)
    if data * shards != n:
        raise SystemExit(f"--mesh {data},{shards} holds {data * shards} devices; this job has {n}")
    mesh = xs.Mesh(np.arange(n), (data, shards), ("data", "fsdp"))
    wrapped = SpmdFullyShardedDataParallel(model, mesh, extra_data_axis="data")
    per_device = sharding.per_device_bytes(list(model.parameters()))
    logger.info(
        f"fsdp: mesh data={data} x fsdp={shards}; parameter bytes per device "
        f"{max(per_device.values()) if per_device else 0:,} "
        f"(unsharded {sum(p.numel() * p.element_size() for p in model.parameters()):,})"
    )
    return mesh, wrapped


def _sharded_state(model, optimizer, step):
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def _restore_sharded(args, model, optimizer, rank, group) -> int:
    """--resume DIR of sharded checkpoints (torch_xla's CheckpointManager layout, DIR/<step>):
    the newest step loaded in place, resharded to this run's layout; returns that step."""
    from torchacc.torch_xla.experimental.distributed_checkpoint import (
        CheckpointManager,
        prime_optimizer,
    )

    manager = CheckpointManager(args.resume, save_interval=1, process_group=group)
    steps = manager.all_steps()
    if not steps:
        raise _exit_reported(
            2, f"error: --resume {args.resume}: no sharded checkpoint (<step>/ directories)", rank
        )
    prime_optimizer(optimizer)
    state = _sharded_state(model, optimizer, 0)
    try:
        manager.restore(max(steps), state)
    except ValueError as e:
        raise _exit_reported(2, f"error: --resume {args.resume}: {e}", rank) from None
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def _log_sharded_memory(logger, model, optimizer):
    from torchacc.distributed import sharding

    report = sharding.memory_report(model, optimizer)
    parts = [f"{k.replace('_', ' ')} {max(v.values()) if v else 0:,}" for k, v in report.items()]
    logger.info(f"fsdp: bytes per device after step 2: {', '.join(parts)}")


def _parallel_context(args):
    import torchacc.parallel as par

    par.init()
    mode = {"semi_auto": "semi_auto_parallel", "auto": "auto_parallel"}
    par.set_auto_parallel_context(
        parallel_mode=mode.get(args.parallel_mode, args.parallel_mode),
        gradients_mean=True,  # the mean loss's gradient, as the single-device run
        device_memory_budget=getattr(args, "device_memory_budget", None),
    )


def _parallelize(model, args, logger):
    """--parallel_mode: the strategy file's layers sharded, then the mode applied (inputs split
    by batch); logs each device's bytes of parameters."""
    import torchacc.parallel as par
    from torchacc.distributed import sharding

    if args.strategy_file:
        strategies = par.load_strategy_file(args.strategy_file)
        done = par.apply_strategies(model, strategies, args.strategy_file)
        logger.info(f"parallel: {args.strategy_file} shards {len(done)} layers")
    model = par.parallelize(model)
    per_device = sharding.per_device_bytes(list(model.parameters()))
    logger.info(
        f"parallel: mode {args.parallel_mode} on {par.get_group_size()} devices; parameter "
        f"bytes per device {max(per_device.values()) if per_device else 0:,} "
        f"(unsharded {sum(p.numel() * p.element_size() for p in model.parameters()):,})"
    )
    return model


def _as_tuple(inputs) -> tuple:
    """A batch's inputs: one tensor, or a tuple of tensors (packed rows: ids, position ids)."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _to_device(inputs, device, **kwargs):
    if isinstance(inputs, tuple):
        return tuple(t.to(device, **kwargs) for t in inputs)
    return inputs.to(device, **kwargs)


def _forward(model: nn.Module, inputs):
    """``model(inputs)``, or ``model(*inputs)`` for a tuple of input tensors."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


def _shard_batch(mesh, *tensors):
    import torchacc.torch_xla.distributed.spmd as xs

    for t in tensors:
        if t.dim() and t.shape[0] % mesh.size() == 0:
            xs.mark_sharding(t, mesh, (("data", "fsdp"),) + (None,) * (t.dim() - 1))


def train(task: Task, args: argparse.Namespace) -> dict:
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    logger = create_logger(rank=rank)
    dynamo = _dynamo_mode(args)
    # --compile_mode=dynamo: tensors stay on the eager device, the step is compiled as a whole
    compiler = enable_torchacc_compiler() and not dynamo

    fsdp = bool(getattr(args, "fsdp", False))
    spmd_mesh = None  # (xs.Mesh, FSDPv2 model) with --fsdp --compiler-opt
    if compiler and fsdp:  # SPMD mode before the device is first used (torch_xla's order)
        import torchacc.torch_xla.runtime as xr

        xr.use_spmd()
    parallel = getattr(args, "parallel_mode", None) if compiler else None
    if parallel:  # torchacc.parallel: its context before the device is first used
        _parallel_context(args)
    sharded = fsdp or bool(parallel)  # XLA's partitioner reduces the gradients
    if compiler:
        # torchacc: the TorchAcc recipe's imports, unchanged but for the package name.
        import torchacc.torch_xla.core.xla_model as xm
        import torchacc.torch_xla.distributed.xla_backend  # noqa: F401  (registers "xla")
        from torchacc.torch_xla.amp import GradScaler, autocast, syncfree
    else:
        xm = autocast = GradScaler = syncfree = None

    lr = args.lr if args.lr is not None else task.default_lr
    weight_decay = args.weight_decay if args.weight_decay is not None else task.default_weight_decay

    # Same seed on every rank: the replicas start identical without a broadcast.
    torch.manual_seed(args.seed)
    model = task.build_model(args)
    dataset = task.build_dataset(args)
    n_params = sum(p.numel() for p in model.parameters())

    ckpt = None
    sharded_ckpt = bool(fsdp and compiler)  # DCP: each process writes its own shards
    if args.resume and not sharded_ckpt:
        ckpt = _load_resume(args, task, model, rank, logger)

    # ---- distributed init + device placement
    cuda = False
    if compiler:
        dist.init_process_group(backend="xla", init_method="env://")
        device = xm.xla_device()
        xm.set_replication(device, [device])
        rank, world_size = xm.get_ordinal(), xm.xrt_world_size()
        model.to(device)
        spmd_mesh = _shard_fsdpv2(model, args, logger) if fsdp else None
        if spmd_mesh is not None:
            model = spmd_mesh[1]
        if parallel:
            model = _parallelize(model, args, logger)
        xm.mark_step()
        if xm.xla_device_hw(device) == "GPU":
            set_peak_memory_fn(_xla_peak_memory_fn(xm, device), "xla")
        else:  # XLA:CPU's memory info is the machine's RAM, not this process: peak RSS instead
            reset_peak_memory_fn()
        mode = "torchacc"
    else:
        cuda = torch.cuda.is_available()
        if cuda:
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", init_method="env://", device_id=device)
            set_peak_memory_fn(lambda: torch.cuda.max_memory_allocated(device), "cuda")
        else:
            device = torch.device("cpu")
            dist.init_process_group(backend="gloo", init_method="env://")
            reset_peak_memory_fn()
        dist.barrier()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if cuda and task.channels_last:
            model = model.to(memory_format=torch.channels_last)
            torch.backends.cudnn.benchmark = True
        if cuda:  # O1: TF32 matmuls/convolutions; O0 is exact fp32 (torch's conv default is TF32)
            tf32 = args.amp_level != "O0"
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        model.to(device)
        if fsdp:  # torch's FSDP2: the eager fallback of --fsdp --compiler-opt
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(model)
        elif not dynamo:  # dynamo: the compiled step all-reduces the gradients itself
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[local_rank] if cuda else None, gradient_as_bucket_view=True
            )
        if args.torch_compile:
            model = torch.compile(model)
        mode = "eager+compile" if args.torch_compile else "eager"
        if dynamo:
            mode = "torchacc-dynamo"

    amp_dtype = resolve_amp_dtype(args, cuda)
    use_scaler = amp_dtype == torch.float16

    # ---- optimizer and scaler
    if compiler and amp_dtype is not None:
        optimizer_cls, opt_kwargs = syncfree.AdamW, {}
    else:
        fused = cuda and not dynamo  # compile_step traces AdamW's capturable foreach form
        optimizer_cls, opt_kwargs = torch.optim.AdamW, ({"fused": True} if fused else {})
    optimizer = optimizer_cls(model.parameters(), lr, weight_decay=weight_decay, **opt_kwargs)
    if not use_scaler:
        scaler = None
    elif compiler:
        scaler = GradScaler()
    else:
        scaler = torch.amp.GradScaler(device.type)

    def autocast_context_manager():
        if amp_dtype is None:
            return contextlib.nullcontext()
        if compiler:
            return autocast(device, dtype=amp_dtype)
        return torch.autocast(device.type, dtype=amp_dtype)

    compiled_step = (
        _compiled_step(task, model, optimizer, scaler, autocast_context_manager, world_size)
        if dynamo
        else None
    )

    start_step = 0
    manager = None
    if sharded_ckpt and (args.save_dir or args.resume):
        from torchacc.torch_xla.experimental.distributed_checkpoint import CheckpointManager

        group = dist.new_group(backend="gloo")  # DCP's coordination ('xla' has no gather)
        if args.save_dir:
            manager = CheckpointManager(
                args.save_dir, save_interval=1, max_to_keep=2, process_group=group
            )
        if args.resume:
            start_step = _restore_sharded(args, model, optimizer, rank, group)
    if ckpt is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
        if scaler is not None and ckpt.get("scaler"):
            scaler.load_state_dict(ckpt["scaler"])
        start_step = int(ckpt["step"])
        rng = ckpt.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        del ckpt

    # ---- data
    workers = args.workers
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        workers = max(0, min(8, (cpus or 1) // max(local_world, 1) - 1))
    loader = EpochBatches(
        dataset,
        args.batch_size,
        rank,
        world_size,
        args.seed,
        workers=workers,
        pin_memory=cuda,
    )
    steps_per_epoch = loader.steps_per_epoch
    total_steps = args.max_steps if args.max_steps is not None else args.epochs * steps_per_epoch
    steps_to_run = max(total_steps - start_step, 0)
    warmup = args.warmup_steps if args.warmup_steps is not None else min(5, steps_to_run // 2)
    warmup = min(warmup, max(steps_to_run - 1, 0))
    samples_per_step = args.batch_size * world_size
    dtype_name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    device_name = str(device)
    hardware = _hardware(compiler, device, local_rank)
    reseed = _draws_random(_unwrap(model))  # else one seed (above) is all a step needs

    err = checks.observe_errors(args, total_steps)  # --profile inside this run (epochs known)
    if err:
        raise _exit_reported(2, f"error: {err}", rank)
    board = prof = None
    if rank == 0:
        desc = task.describe(_unwrap(model)) if task.describe else task.name
        params = dict(
            mode=mode,
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
            kind = "lazy" if compiler else "dynamo" if dynamo else "eager"
            prof = StepProfiler(args.profile, args.profile_dir, kind, cuda, logger.info)

    def save(step: int) -> bool:
        """Write a checkpoint (rank 0); False, after one line saying why, if it failed."""
        if manager is not None:  # sharded state: DCP, every process writes its own shards
            xm.mark_step()
            try:
                manager.save(step, _sharded_state(model, optimizer, step), force=True)
            except (OSError, RuntimeError) as e:
                line = f"could not save the sharded checkpoint of step {step}: {e}"
                logger.warning(line)
                save_errors.append(line)
                return False
            logger.info(f"saved sharded checkpoint {os.path.join(args.save_dir, str(step))}")
            return True
        if rank != 0:
            return True
        if compiler:
            xm.mark_step()
        state = {
            "model": to_cpu(_unwrap(model).state_dict()),
            "optimizer": to_cpu(optimizer.state_dict()),
            "scaler": to_cpu(scaler.state_dict()) if scaler is not None else None,
            "step": step,
            "epoch": step // steps_per_epoch,
            "rng": {"torch": torch.get_rng_state(), "scheme": "per-step reseed (step_seed)"},
            "args": vars(args),
            "model_name": task.name,
        }
        try:
            path = save_checkpoint(args.save_dir, state, step)
        except (OSError, RuntimeError) as e:  # disk full, I/O error (torch wraps some as Runtime)
            line = save_failure_line(args.save_dir, step, e, state_nbytes(state))
            later = min(step + args.save_interval, total_steps) if args.save_interval else step
            if later > step:
                line += f"; retrying at step {later}"
            logger.warning(line)
            save_errors.append(line)
            return False
        logger.info(f"saved checkpoint {path}")
        return True

    # ---- the loop
    steps: list[int] = []
    losses: list[float] = []
    step_times: list[float] = []
    intervals: list[dict] = []
    pending: list[torch.Tensor] = []
    save_errors: list[str] = []
    saved_ok: dict[int, bool] = {}
    model.train()

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

    compile_count = _compile_counter(compiler, dynamo)
    stop = checks.StopRequest()
    agree = _StopAgreement(stop, world_size, min(args.log_interval, 10))
    previous_handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop_signal = None
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
    compiled_steps: list[int] = []  # steps that compiled a program: left out of ETA / step time
    interval_times: list[tuple[float, bool]] = []  # (seconds, compiled) of this interval's steps
    while step < total_steps and stop_signal is None:
        epoch, offset = divmod(step, steps_per_epoch)
        for inputs, target in loader.batches(epoch, offset, offset + total_steps - step):
            if reseed:
                torch.manual_seed(step_seed(args.seed, rank, step))
            if prof:
                t_last += prof.begin(step)  # starting the profiler is not the step's time
            compiles_before = compile_count()
            if compiler:
                inputs, target = _to_device(inputs, device), target.to(device)
                if fsdp:  # the batch split over the mesh's data and fsdp axes
                    _shard_batch(spmd_mesh[0], *_as_tuple(inputs), target)
            else:
                inputs = _to_device(inputs, device, non_blocking=True)
                target = target.to(device, non_blocking=True)
                if cuda and task.channels_last:
                    inputs = inputs.contiguous(memory_format=torch.channels_last)
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
                    if compiler and not sharded:  # SPMD: XLA's partitioner reduces gradients
                        gradients = xm._fetch_gradients(optimizer)
                        xm.all_reduce("sum", gradients, scale=1.0 / world_size)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    if compiler and not sharded:  # SPMD: XLA's partitioner reduces gradients
                        gradients = xm._fetch_gradients(optimizer)
                        xm.all_reduce("sum", gradients, scale=1.0 / world_size)
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
            if done == 2 and spmd_mesh is not None and rank == 0:  # optimizer state exists now
                _log_sharded_memory(logger, model, optimizer)
            if at_warm:
                t_warm = now
            if at_log and rank == 0:
                # Steps that compiled are left out: their time says nothing about the others.
                plain = [t for t, c in interval_times if not c]
                if plain:
                    batch_time = sum(plain) / len(plain)
                    eta = batch_time * (total_steps - step)
                else:
                    batch_time, eta = (now - t_interval) / max(len(interval_times), 1), None
                sps = samples_per_step / batch_time if batch_time > 0 else float("nan")
                mem, mem_src = peak_memory_gib()
                scale = scaler.get_scale() if scaler is not None else None
                log_metrics(
                    epoch,
                    step,
                    args.batch_size,
                    losses[-1],
                    batch_time,
                    sps,
                    mem,
                    total_steps=total_steps,
                    eta=eta,
                    mem_source=mem_src,
                    loss_scale=scale,
                    logger=logger,
                )
                if board:
                    board.losses(steps, losses)
                    board.interval(
                        step,
                        samples_per_sec=sps,
                        step_time_s=batch_time,
                        lr=optimizer.param_groups[0]["lr"],
                        peak_mem_gib=mem,
                        mem_source=mem_src,
                        compiles=compile_count() if compiler or dynamo else None,
                        loss_scale=scale,
                    )
                intervals.append(
                    {
                        "step": step,
                        "epoch": epoch,
                        "loss": losses[-1],
                        "batch_time": batch_time,
                        "samples_per_sec": sps,
                        "peak_mem_gib": mem,
                        "eta_s": eta,
                    }
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
    if board:
        board.losses(steps, losses)
        board.close()
    t_end = time.perf_counter()
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)

    if args.save_dir and steps_to_run > 0 and step not in saved_ok:
        if stop_signal is None or stop_signal == signal.SIGTERM:
            saved_ok[step] = save(step)

    # ---- summary
    done = step - start_step
    steady_steps = max(done - warmup, 0)
    if t_warm is None:
        t_warm = t_start
    steady_time = t_end - t_warm
    steady_sps = samples_per_step * steady_steps / steady_time if steady_time > 0 else float("nan")
    peak_mem, mem_src = peak_memory_gib()
    summary = {
        "mode": mode,
        "model": args.model,
        "world_size": world_size,
        "device": device_name,
        "hardware": hardware,
        "amp": f"{args.amp_level}/{dtype_name}",
        "start_step": start_step,
        "total_steps": total_steps,
        "steps_run": done,
        "warmup_steps": warmup,
        "first_step_time_s": first_step_time,
        "compiled_steps": compiled_steps,
        "steady_samples_per_sec": steady_sps,
        "steady_step_time_s": steady_time / steady_steps if steady_steps > 0 else None,
        "total_time_s": t_end - t_start,
        "final_loss": losses[-1] if losses else None,
        "peak_mem_gib": peak_mem,
        "peak_mem_source": mem_src,
        "interrupted": signal.Signals(stop_signal).name if stop_signal else None,
        "save_errors": save_errors,
    }
    if task.tokens_per_sample:
        summary["steady_tokens_per_sec"] = steady_sps * task.tokens_per_sample
    if compiler:  # why each compile and sync happened (the lazy path's explain report)
        from torchacc import metrics as acc_metrics

        summary["explain"] = acc_metrics.explain_summary()
    result = {
        "config": {
            **{k: v for k, v in vars(args).items() if k not in LAUNCH_ONLY},
            "mode": mode,
            "world_size": world_size,
            "device": device_name,
            "hardware": hardware,
            "amp_dtype_resolved": dtype_name,
            "grad_scaler": scaler is not None,
            "lr_resolved": lr,
            "weight_decay_resolved": weight_decay,
            "parameters": n_params,
            "steps_per_epoch": steps_per_epoch,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "host": platform.node(),
        },
        "steps": steps,
        "losses": losses,
        "step_times": step_times,
        "samples_per_sec": [samples_per_step / t if t > 0 else None for t in step_times],
        "intervals": intervals,
        "summary": summary,
    }
    if rank == 0:
        loss_txt = (
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "no steps (already done)"
        )
        tok = (
            f" ({summary['steady_tokens_per_sec']:.0f} tokens/s)" if task.tokens_per_sample else ""
        )
        step_ms = (summary["steady_step_time_s"] or float("nan")) * 1000.0
        kind = hardware.split(" ")[0] if compiler else device.type
        line = (
            f"[summary] {args.model} {mode} x{world_size} {kind} {args.amp_level}/"
            f"{dtype_name} batch {args.batch_size}/proc | steps {start_step}->{step} | {loss_txt}"
            f" | {steady_sps:.1f} samples/s{tok}, {step_ms:.1f} ms/step after {warmup} warm-up"
            f" | first step {first_step_time or 0:.2f} s | peak mem {peak_mem:.2f} GiB ({mem_src})"
            f" | total {format_duration(t_end - t_start)} | device {hardware}"
        )
        print(line, flush=True)
        if compiler:
            report = acc_metrics.explain_report().rstrip("\n").splitlines()
            print("\n".join(f"[explain] {ln}" for ln in report), flush=True)
        if args.output:
            _write_json(args.output, result)
    dist.destroy_process_group()
    sys.stdout.flush()
    if stop_signal is not None:
        raise _exit_reported(128 + stop_signal, _interrupt_line(args, step, stop_signal), rank)
    final_failed = bool(args.save_dir and steps_to_run > 0 and saved_ok.get(step) is False)
    if final_failed:
        raise _exit_reported(1, f"error: final {save_errors[-1]}", rank)
    return result


def _interrupt_line(args: argparse.Namespace, step: int, signum: int) -> str:
    """``interrupted at step N; resume with --resume DIR`` (and what DIR holds)."""
    name = signal.Signals(signum).name
    if not args.save_dir:
        return (
            f"interrupted at step {step} ({name}); no --save_dir, so nothing to resume from "
            "(add --save_dir DIR --save_interval N)"
        )
    from gallery.common.checkpoint import list_checkpoints

    found = list_checkpoints(args.save_dir) if os.path.isdir(args.save_dir) else []
    if not found:
        return f"interrupted at step {step} ({name}); no checkpoint in {args.save_dir} yet"
    newest = os.path.basename(found[0])
    return (
        f"interrupted at step {step}; resume with --resume {args.save_dir} ({name}; newest "
        f"checkpoint {newest})"
    )
