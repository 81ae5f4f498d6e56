"""The gallery trainer's saved state: what a one-file checkpoint holds, loading ``--resume`` into
a run (checked against it first), writing at the save interval (a failed write is reported and
retried), and the line an interrupted run ends with. The file format and its safe loading are
``gallery/common/checkpoint.py``'s; sharded (DCP) checkpoints are the FSDP front door's."""

from __future__ import annotations

import os
import signal

import torch

from gallery.common.checkpoint import (
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    save_failure_line,
    state_mismatch,
    state_nbytes,
    to_cpu,
)
from gallery.common.exits import exit_reported

__all__ = ["load_resume", "restore", "Saver", "interrupt_line", "unwrap"]


def unwrap(model):
    """The model under DDP and ``torch.compile``'s wrappers."""
    from torch import nn

    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            return model


def load_resume(args, task, model, rank: int, logger) -> dict:
    """The ``--resume`` checkpoint, loaded safely and checked against this run (its weights put
    in ``model``); a problem exits 2 with one line."""
    warn = logger.warning if rank == 0 else (lambda line: None)
    try:
        path, _ = resolve_checkpoint(args.resume, warn=warn)
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        raise exit_reported(2, f"error: --resume {e}", rank) from None
    trained = ckpt.get("model_name") or (ckpt.get("args") or {}).get("model")
    if trained is not None and trained != task.name:
        raise exit_reported(
            2,
            f"error: --resume {path}: checkpoint of model {trained}, this run trains {task.name}",
            rank,
        )
    diff = state_mismatch(model.state_dict(), ckpt["model"], "parameter/buffer")
    if diff:
        raise exit_reported(
            2, f"error: --resume {path}: the checkpoint does not fit {task.name}: {diff}", rank
        )
    model.load_state_dict(ckpt["model"])
    ckpt["path"] = path
    return ckpt


def resume_data_position(loader, state, path, step: int, rank: int, logger) -> None:
    """Check the checkpoint's data position (``EpochBatches.state_dict``) against this run: the
    same dataset and seed, and the batch the resumed step takes (Note [Data positions] in
    torchacc/distributed/data_state.py). A mismatch exits 2 naming the file."""
    from gallery.common.launchlib import torchacc_data_state

    DataStateError = torchacc_data_state().DataStateError

    try:
        epoch, offset = loader.load_state_dict(state, source=path)
    except DataStateError as e:
        raise exit_reported(2, f"error: --resume {e}", rank) from None
    if epoch * loader.steps_per_epoch + offset != step:
        raise exit_reported(
            2,
            f"error: --resume {path}: its data position (epoch {epoch}, batch {offset}) is not "
            f"step {step} of this run ({loader.steps_per_epoch} steps per epoch)",
            rank,
        )
    if rank == 0:
        logger.info(
            f"resumed from step {step}: epoch {epoch}, batch {offset} ({state['consumed']} "
            f"samples of the epoch consumed, re-split over {loader.sampler.num_replicas} "
            "process(es))"
        )


def restore(ckpt: dict, optimizer, scaler) -> int:
    """The rest of a loaded checkpoint (optimizer, scaler, RNG) put back; returns its step."""
    optimizer.load_state_dict(ckpt["optimizer"])
    if scaler is not None and ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt.get("rng") or {}
    if "torch" in rng:
        torch.set_rng_state(rng["torch"])
    return int(ckpt["step"])


class Saver:
    """``saver(step)``: write a checkpoint of ``step`` (rank 0; every rank for a front door with
    its own sharded format); False, after one line saying why, if it failed. ``errors`` keeps
    those lines for the summary."""

    def __init__(
        self, args, task, door, model, optimizer, scaler, steps_per_epoch, total_steps, loader=None
    ):
        self.args, self.task, self.door = args, task, door
        self.loader = loader  # EpochBatches: its position is saved with the model
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.errors: list[str] = []

    def state(self, step: int) -> dict:
        """What a one-file checkpoint holds (host copies)."""
        scaler = self.scaler
        return {
            "model": to_cpu(unwrap(self.model).state_dict()),
            "optimizer": to_cpu(self.optimizer.state_dict()),
            "scaler": to_cpu(scaler.state_dict()) if scaler is not None else None,
            "step": step,
            "epoch": step // self.steps_per_epoch,
            "rng": {"torch": torch.get_rng_state(), "scheme": "per-step reseed (step_seed)"},
            "args": vars(self.args),
            "model_name": self.task.name,
            **(
                {"data": self.loader.state_dict(*divmod(step, self.steps_per_epoch))}
                if self.loader is not None
                else {}
            ),
        }

    def __call__(self, step: int) -> bool:
        door, args, logger = self.door, self.args, self.door.logger
        if getattr(door, "manager", None) is not None:  # sharded state: DCP, every process
            data = (
                self.loader.state_dict(*divmod(step, self.steps_per_epoch)) if self.loader else None
            )
            return door.save(step, self.model, self.optimizer, self.errors, data=data)
        if door.rank != 0:
            return True
        if door.compiler:
            door.xm.mark_step()
        state = self.state(step)
        try:
            path = save_checkpoint(args.save_dir, state, step)
        except (OSError, RuntimeError) as e:  # disk full, I/O error (torch wraps some as Runtime)
            line = save_failure_line(args.save_dir, step, e, state_nbytes(state))
            total = self.total_steps
            later = min(step + args.save_interval, total) if args.save_interval else step
            if later > step:
                line += f"; retrying at step {later}"
            logger.warning(line)
            self.errors.append(line)
            return False
        logger.info(f"saved checkpoint {path}")
        return True


def interrupt_line(args, step: int, signum: int) -> str:
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
