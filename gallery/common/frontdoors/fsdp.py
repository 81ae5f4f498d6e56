"""The fully sharded front doors (``--fsdp``): FSDPv2 through XLA's SPMD partitioner over a
(data, fsdp, tp, cp) mesh of every device with ``--compiler-opt`` (``--tp``: Megatron's
column->row pairs, ``--cp``: the sequence split with attention as the context-parallel region;
sharded DCP checkpoints: each process writes its own shards, a resume reshards to this run's
layout), else torch's FSDP2 (``fully_shard``) on the eager device."""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from gallery.common.exits import exit_reported
from gallery.common.frontdoors.compiler import Compiler
from gallery.common.frontdoors.eager import Eager

__all__ = ["FSDPv2", "EagerFSDP"]


def _as_tuple(inputs) -> tuple:
    """A batch's inputs: one tensor, or a tuple of tensors (packed rows: ids, position ids)."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def sharded_state(model, optimizer, step, data=None):
    """What a sharded checkpoint holds; ``data``: the loader's position (``EpochBatches``'s state,
    stored as one JSON string: the same on every process, and its keys need no template)."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
    if data is not None:
        state["data"] = json.dumps(data)
    return state


class FSDPv2(Compiler):
    sharded = True
    batch_axes = ("data", "fsdp")  # the mesh axes the batch is split over
    own_checkpoints = True  # sharded DCP checkpoints, DIR/<step>/

    def start(self) -> None:
        import torchacc.torch_xla.runtime as xr

        xr.use_spmd()  # SPMD mode before the device is first used (torch_xla's order)
        self.mesh = None
        self.manager = None
        self.resumed_data = None  # (the loader position, the checkpoint) after a --resume

    def shard(self, model):
        """FSDPv2 over a (data, fsdp, tp, cp) mesh of every device, Megatron pairs on tp and
        context parallel on cp first; logs the mesh and each device's parameter bytes."""
        import numpy as np

        import torchacc.torch_xla.distributed.spmd as xs
        import torchacc.torch_xla.runtime as xr
        from torchacc.context_parallel import model as cp_model
        from torchacc.distributed import sharding
        from torchacc.sharding import recipes
        from torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel import (
            SpmdFullyShardedDataParallel,
        )

        args, n = self.args, xr.global_runtime_device_count()
        tp, cp = getattr(args, "tp", 1), getattr(args, "cp", 1)
        rest = n // (tp * cp) if n % (tp * cp) == 0 else 0
        data, shards = (int(x) for x in args.mesh.split(",")) if args.mesh else (1, rest)
        if data * shards * tp * cp != n:
            line = (
                f"--mesh {data},{shards} x --tp {tp} x --cp {cp} holds {data * shards * tp * cp} "
                f"devices; this job has {n}"
                if args.mesh
                else f"--tp {tp} x --cp {cp} = {tp * cp} does not divide this job's {n} devices"
            )
            raise exit_reported(2, f"error: {line}", self.rank)
        names = ("data", "fsdp", "tp", "cp")
        self.mesh = xs.Mesh(np.arange(n), (data, shards, tp, cp), names)
        self.cp = cp
        jmesh = self.mesh.get_jax_mesh()
        try:
            if tp > 1:  # Megatron column->row pairs; FSDP shards the rest (and these on fsdp)
                recipes.tensor_parallel(model, jmesh, "tp", "fsdp" if shards > 1 else None)
        except ValueError as e:
            raise exit_reported(2, f"error: --tp {tp}: {e}", self.rank) from None
        if cp > 1:  # the model's attention as the ring / Ulysses region over cp
            cp_model.parallelize(
                model, jmesh, "cp", ("data", "fsdp"), "tp" if tp > 1 else None, call="--cp"
            )

        def shard_output(out, mesh):  # logits by batch (and by sequence over cp)
            real = out[0] if isinstance(out, (tuple, list)) else out
            shape = tuple(real.shape)
            spec = cp_model.batch_spec(shape, ("data", "fsdp"), "cp", cp)
            xs.mark_sharding(real, mesh, spec)

        wrapped = SpmdFullyShardedDataParallel(
            model, self.mesh, shard_output=shard_output, extra_data_axis="data"
        )
        per_device = sharding.per_device_bytes(list(model.parameters()))
        axes = "".join(f" x {k}={v}" for k, v in (("tp", tp), ("cp", cp)) if v > 1)
        self.logger.info(
            f"fsdp: mesh data={data} x fsdp={shards}{axes}; parameter bytes per device "
            f"{max(per_device.values()) if per_device else 0:,} "
            f"(unsharded {sum(p.numel() * p.element_size() for p in model.parameters()):,})"
        )
        return wrapped

    def to_device(self, inputs, target, channels_last: bool = False):
        """The batch split over the mesh's data and fsdp axes (and its sequence over cp). Each
        process's batch is its share of the global batch (its sampler's): the processes' shares
        make one global array, each process uploading only its own (Note [Per-process batches]
        in torchacc/sharding/data.py); the bytes are logged once."""
        from torchacc import metrics
        from torchacc.context_parallel import model as cp_model
        from torchacc.sharding import data

        mesh, cp, axes = self.mesh, getattr(self, "cp", 1), self.batch_axes

        def layout(t):
            spec = cp_model.batch_spec(tuple(t.shape), axes, "cp", cp)
            return mesh.named_sharding(spec, tuple(t.shape)) if t.dim() else None

        tensors = (*_as_tuple(inputs), target)
        before = metrics.counter_value("TransferToDeviceBytes") or 0
        *placed, target = data.global_batch(tensors, layout)
        if not getattr(self, "_logged_upload", False) and self.rank == 0:
            self._logged_upload = True
            sent = (metrics.counter_value("TransferToDeviceBytes") or 0) - before
            share = sum(t.numel() * t.element_size() for t in tensors)
            self.logger.info(
                f"fsdp: this process uploads {sent:,} bytes per step, its share of the global "
                f"batch ({share:,} of {share * self.world_size:,} bytes: 1/{self.world_size})"
            )
        return (tuple(placed) if isinstance(inputs, tuple) else placed[0]), target

    def after_step(self, done: int, model, optimizer) -> None:
        if done == 2 and self.rank == 0:  # the optimizer state exists now
            from torchacc.distributed import sharding

            report = sharding.memory_report(model, optimizer)
            parts = [
                f"{k.replace('_', ' ')} {max(v.values()) if v else 0:,}" for k, v in report.items()
            ]
            self.logger.info(f"fsdp: bytes per device after step 2: {', '.join(parts)}")

    # ---- sharded checkpoints (DCP; torch_xla's CheckpointManager layout, DIR/<step>/)
    def open_checkpoints(self, model, optimizer) -> int | None:
        args = self.args
        if not (args.save_dir or args.resume):
            return 0
        from torchacc.torch_xla.experimental.distributed_checkpoint import CheckpointManager

        group = dist.new_group(backend="gloo")  # DCP's coordination ('xla' has no gather)
        if args.save_dir:
            self.manager = CheckpointManager(
                args.save_dir, save_interval=1, max_to_keep=2, process_group=group
            )
        return self._restore(model, optimizer, group) if args.resume else 0

    def _restore(self, model, optimizer, group) -> int:
        """The newest step of ``--resume DIR`` loaded in place, resharded to this run's layout."""
        from torchacc.torch_xla.experimental.distributed_checkpoint import (
            CheckpointManager,
            prime_optimizer,
        )

        args, rank = self.args, self.rank
        manager = CheckpointManager(args.resume, save_interval=1, process_group=group)
        steps = manager.all_steps()
        if not steps:
            line = f"error: --resume {args.resume}: no sharded checkpoint (<step>/ directories)"
            raise exit_reported(2, line, rank)
        from torchacc.distributed.checkpoint_manager import check_checkpoint

        prime_optimizer(optimizer)
        path = os.path.join(args.resume, str(max(steps)))
        try:  # a checkpoint without a data position (older ones): the step says where
            has_data = "data" in check_checkpoint(path).state_dict_metadata
            state = sharded_state(model, optimizer, 0, data={} if has_data else None)
            manager.restore(max(steps), state)
        except ValueError as e:
            raise exit_reported(2, f"error: --resume {args.resume}: {e}", rank) from None
        optimizer.load_state_dict(state["optimizer"])
        if has_data:
            self.resumed_data = (json.loads(state["data"]), path)
        return int(state["step"])

    def save(self, step: int, model, optimizer, errors: list[str], data=None) -> bool:
        """Every process writes its shards of ``step`` (and ``data``, the loader's position);
        False, after one line, if it failed."""
        self.xm.mark_step()
        try:
            self.manager.save(step, sharded_state(model, optimizer, step, data), force=True)
        except (OSError, RuntimeError) as e:
            line = f"could not save the sharded checkpoint of step {step}: {e}"
            self.logger.warning(line)
            errors.append(line)
            return False
        self.logger.info(f"saved sharded checkpoint {os.path.join(self.args.save_dir, str(step))}")
        return True


class EagerFSDP(Eager):
    """torch's FSDP2: the eager fallback of ``--fsdp --compiler-opt``."""

    def wrap(self, model):
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
