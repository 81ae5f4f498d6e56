"""The parallel-modes front door (``--parallel_mode``): torchacc.parallel's MindSpore-style
modes over every device this process drives; its context is set before the device is first used,
the strategy file's layers are sharded, then the mode applies (inputs split by batch)."""

from __future__ import annotations

from gallery.common.frontdoors.compiler import Compiler

__all__ = ["ParallelMode"]

_MODES = {"semi_auto": "semi_auto_parallel", "auto": "auto_parallel"}


class ParallelMode(Compiler):
    sharded = True  # XLA's partitioner reduces the gradients

    def start(self) -> None:
        import torchacc.parallel as par

        args = self.args
        par.init()
        par.set_auto_parallel_context(
            parallel_mode=_MODES.get(args.parallel_mode, args.parallel_mode),
            gradients_mean=True,  # the mean loss's gradient, as the single-device run
            device_memory_budget=getattr(args, "device_memory_budget", None),
        )

    def shard(self, model):
        """The strategies applied, then the mode; logs each device's bytes of parameters."""
        import torchacc.parallel as par
        from torchacc.distributed import sharding

        args, logger = self.args, self.logger
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
