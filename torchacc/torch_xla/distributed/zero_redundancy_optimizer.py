"""``torch_xla.distributed.zero_redundancy_optimizer`` on torchacc: ZeRO stage 1.

:class:`ZeroRedundancyOptimizer` wraps a torch optimizer class and keeps, on each rank, only that
rank's slice (along dim 0, padded to a multiple of the group size) of every parameter as the
optimizer's parameter, so optimizer state is 1/N per rank. A step is recorded like any other
torchacc code, through ``xm``'s collectives (torchacc.distributed.collectives, one XLA program at
the next sync):

1. reduce-scatter each full gradient: the sum over ranks times 1/N, this rank's slice;
2. optionally clip by the global norm (sum of squares of the slices, all-reduced);
3. the wrapped optimizer steps on the slices;
4. all-gather the slices and copy them into the full parameters (padding dropped).

On one process (world size 1) the slice is the whole tensor and the collectives are local math,
so the step equals the wrapped optimizer's step on ``optimizer_dtype`` copies of the parameters.
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from torch.optim import Optimizer

from torchacc.torch_xla.core import xla_model as xm


def _pad_dim0(tensor, count):
    """``tensor`` padded with zeros along dim 0 to a multiple of ``count``."""
    extra = -tensor.size(0) % count
    if extra == 0:
        return tensor
    return F.pad(tensor, [0, 0] * (tensor.dim() - 1) + [0, extra])


class ZeroRedundancyOptimizer(Optimizer):
    """ZeRO-1: ``optimizer_class(**defaults)`` on this rank's slices of ``params``.

    Arguments follow torch_xla's: ``optimizer_dtype`` (dtype of the slices and of the optimizer
    state, default float32), ``grad_clipping``/``max_norm`` (clip by the global 2-norm, default
    on, 1.0), ``sharding_groups`` (replica groups for the reduce-scatter/all-gather; default the
    whole world), ``grad_norm_groups`` (an extra all-reduce of the norm), ``lazy_init`` (shard
    later, in :meth:`init_zero`), ``bucket_cap_mb_all_gather``/``bucket_cap_mb_reduce_scatter``
    (coalesce the collectives in buckets), ``use_grad_acc_hook`` (accumulate gradients in
    ``optimizer_dtype`` ``main_grad`` buffers), ``save_master_weights`` (put the slices in the
    state dict), ``higher_cc_precision`` (reduce gradients in ``optimizer_dtype``).
    """

    def __init__(
        self,
        params,
        optimizer_class,
        optimizer_dtype=None,
        grad_clipping=True,
        max_norm=None,
        pin_layout=True,
        sharding_groups=None,
        grad_norm_groups=None,
        lazy_init=False,
        bucket_cap_mb_all_gather=0,
        bucket_cap_mb_reduce_scatter=0,
        use_grad_acc_hook=False,
        save_master_weights=False,
        higher_cc_precision=False,
        **defaults,
    ):
        if not save_master_weights:
            logging.getLogger(__name__).warning(
                "ZeroRedundancyOptimizer: save_master_weights=False, so a state dict does not "
                "hold the optimizer's parameter slices; resuming restores them from the model's "
                "parameters"
            )
        super().__init__(params, defaults)
        self.global_world_size = xm.xrt_world_size()
        self.global_rank = xm.get_ordinal()
        self._sharding_groups = (
            [list(range(self.global_world_size))] if sharding_groups is None else sharding_groups
        )
        self._grad_norm_groups = grad_norm_groups
        self.optimizer_class = optimizer_class
        self.defaults = defaults
        self.optimizer_dtype = optimizer_dtype if optimizer_dtype is not None else torch.float32
        self.grad_clipping = grad_clipping
        self.max_norm = 1.0 if max_norm is None else max_norm
        self.pin_layout = pin_layout
        self.bucket_cap_mb_all_gather = bucket_cap_mb_all_gather
        self.bucket_cap_mb_reduce_scatter = bucket_cap_mb_reduce_scatter
        self.save_master_weights = save_master_weights
        self.higher_cc_precision = higher_cc_precision
        self.use_grad_acc_hook = use_grad_acc_hook
        self._hooks = []
        self._grad_norm = None
        self.inited = False
        if not lazy_init:
            self.init_zero()

    # -- sharding -------------------------------------------------------------------------------
    @property
    def sharding_groups(self):
        return self._sharding_groups

    @sharding_groups.setter
    def sharding_groups(self, groups):
        if self.inited:
            raise RuntimeError("ZeroRedundancyOptimizer: sharding_groups set after init_zero()")
        self._sharding_groups = groups

    @property
    def grad_norm(self):
        """The global gradient norm of the last clipped step (a device tensor), else None."""
        return self._grad_norm

    def init_zero(self):
        """Slice the parameters and build the wrapped optimizer on the slices."""
        self.remove_hooks()
        group = next((list(g) for g in self._sharding_groups if self.global_rank in g), None)
        if group is None:
            raise ValueError(
                f"ZeroRedundancyOptimizer: rank {self.global_rank} is in none of the "
                f"sharding_groups {self._sharding_groups}"
            )
        self.local_world_size = len(group)
        self.local_rank = group.index(self.global_rank)
        self.base_optimizer = self.optimizer_class(self._shard_parameters(), **self.defaults)
        self._copy_hyperparameters(self.param_groups, self.base_optimizer.param_groups)
        self.inited = True

    def _shard(self, tensor):
        return _pad_dim0(tensor, self.local_world_size).chunk(self.local_world_size)[
            self.local_rank
        ]

    def _shard_parameters(self):
        params = [p for g in self.param_groups for p in g["params"]]
        devices = {p.device for p in params}
        if len(devices) != 1 or not xm.is_xla_tensor(params[0]):
            raise ValueError(
                "ZeroRedundancyOptimizer: the parameters must all be on the torchacc device "
                "(move the model there before building the optimizer); found "
                f"{sorted(map(str, devices))}"
            )
        scalars = [tuple(p.shape) for p in params if p.dim() == 0]
        if scalars:
            raise ValueError(
                "ZeroRedundancyOptimizer: parameters are sliced along dim 0, so 0-dim parameters "
                f"cannot be sharded ({len(scalars)} found); give them to another optimizer"
            )
        self.device = params[0].device
        groups = []
        with torch.no_grad():
            for group in self.param_groups:
                shards = []
                for p in group["params"]:
                    data = self._shard(p.detach()).to(self.optimizer_dtype).clone()
                    shard = torch.nn.Parameter(data, requires_grad=p.requires_grad)
                    if self.use_grad_acc_hook and p.requires_grad:
                        self._hooks.append(
                            p.register_post_accumulate_grad_hook(self._accumulate_hook(shard))
                        )
                    shards.append(shard)
                groups.append(dict(group, params=shards))
        return groups

    def _accumulate_hook(self, shard):
        def hook(param):
            if param.grad is None:
                return
            if not hasattr(shard, "main_grad"):
                shard.main_grad = torch.zeros(
                    param.shape, dtype=self.optimizer_dtype, device=self.device
                )
                param.main_grad = shard.main_grad
            shard.main_grad.add_(param.grad.detach().to(self.optimizer_dtype))
            param.grad = None

        return hook

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []

    @staticmethod
    def _copy_hyperparameters(src_groups, dst_groups):
        if len(src_groups) != len(dst_groups):
            raise ValueError(
                f"ZeroRedundancyOptimizer: {len(src_groups)} parameter groups vs "
                f"{len(dst_groups)} in the wrapped optimizer"
            )
        for src, dst in zip(src_groups, dst_groups):
            for key, value in src.items():
                if key != "params":
                    dst[key] = value

    def _pairs(self):
        """(full parameter, slice) pairs whose slice takes part in this step."""
        for group, sharded in zip(self.param_groups, self.base_optimizer.param_groups):
            for p, shard in zip(group["params"], sharded["params"]):
                if p.grad is not None or (self.use_grad_acc_hook and hasattr(shard, "main_grad")):
                    yield p, shard

    def _scheme(self, kwargs):
        return kwargs.pop(
            "sharding_scheme",
            [
                {
                    "scale_factor": 1.0,
                    "sharding_group": self._sharding_groups,
                    "group_size": self.local_world_size,
                }
            ],
        )

    # -- the step -------------------------------------------------------------------------------
    def _reduce_gradients(self, scheme):
        self._copy_hyperparameters(self.param_groups, self.base_optimizer.param_groups)
        pairs = list(self._pairs())
        grads = []
        for p, shard in pairs:
            g = shard.main_grad if self.use_grad_acc_hook else p.grad
            g = _pad_dim0(g, self.local_world_size)
            grads.append(g.to(self.optimizer_dtype) if self.higher_cc_precision else g)
        for step in scheme:
            kw = dict(
                scale=step["scale_factor"] / step["group_size"],
                scatter_dim=0,
                shard_count=step["group_size"],
                groups=step["sharding_group"],
                pin_layout=self.pin_layout,
            )
            if self.bucket_cap_mb_reduce_scatter > 0 and grads:
                grads = xm.reduce_scatter_bucketized(
                    xm.REDUCE_SUM, grads, bucket_cap_mb=self.bucket_cap_mb_reduce_scatter, **kw
                )
            else:
                grads = [xm.reduce_scatter(xm.REDUCE_SUM, g, **kw) for g in grads]
        for (_p, shard), g in zip(pairs, grads):
            shard.grad = g.to(self.optimizer_dtype)

    @torch.no_grad()
    def _clip_grad_norm(self, max_norm):
        grads = [s.grad for g in self.base_optimizer.param_groups for s in g["params"]]
        total = torch.zeros([], dtype=self.optimizer_dtype, device=self.device)
        for g in grads:
            if g is not None:
                total += (g * g).sum()
        xm.all_reduce(xm.REDUCE_SUM, [total], groups=self._sharding_groups)
        if self._grad_norm_groups is not None:
            xm.all_reduce(xm.REDUCE_SUM, [total], groups=self._grad_norm_groups)
        self._grad_norm = total.sqrt()
        coeff = torch.clamp(float(max_norm) / (self._grad_norm + 1e-6), max=1.0)
        for g in grads:
            if g is not None:
                g.mul_(coeff)

    def allgather_weights_and_update_full_parameter(self, sharding_scheme=None):
        """Gather every slice and copy it (padding dropped) into its full parameter."""
        scheme = sharding_scheme if sharding_scheme is not None else self._scheme({})
        pairs = list(self._pairs())
        pieces = [shard.detach().to(p.dtype) for p, shard in pairs]
        for step in reversed(scheme):
            groups = step["sharding_group"]
            if self.bucket_cap_mb_all_gather > 0 and pieces:
                pieces = xm.all_gather_bucketized(
                    pieces, dim=0, groups=groups, bucket_cap_mb=self.bucket_cap_mb_all_gather
                )
            else:
                pieces = [
                    xm.all_gather(t, dim=0, groups=groups, pin_layout=self.pin_layout)
                    for t in pieces
                ]
        with torch.no_grad():
            for (p, _shard), full in zip(pairs, pieces):
                p.copy_(full[: p.size(0)])

    @torch.no_grad()
    def step(self, closure=None, **kwargs):
        """Reduce-scatter the gradients, (clip), step the slices, all-gather the parameters."""
        if not self.inited:
            raise RuntimeError("ZeroRedundancyOptimizer: call init_zero() before step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scheme = self._scheme(kwargs)
        self._reduce_gradients(scheme)
        if self.grad_clipping:
            self._clip_grad_norm(self.max_norm)
        self.base_optimizer.step(**kwargs)
        self.base_optimizer.zero_grad(set_to_none=True)
        self.allgather_weights_and_update_full_parameter(scheme)
        self._copy_hyperparameters(self.base_optimizer.param_groups, self.param_groups)
        return loss

    def zero_grad(self, set_to_none=False):
        super().zero_grad(set_to_none=set_to_none)
        if self.use_grad_acc_hook:
            for group in self.base_optimizer.param_groups:
                for shard in group["params"]:
                    if hasattr(shard, "main_grad"):
                        shard.main_grad.zero_()

    # -- state ----------------------------------------------------------------------------------
    def get_shape_info(self):
        params = [p for g in self.param_groups for p in g["params"]]
        return {i: p.shape for i, p in enumerate(params)}

    def state_dict(self):
        """torch's optimizer state dict plus ``base_state`` (this rank's sliced state),
        ``shape_info`` and, with ``save_master_weights``, ``sharded_master_weights``."""
        state = super().state_dict()
        state["base_state"] = self.base_optimizer.state_dict()["state"]
        state["shape_info"] = self.get_shape_info()
        if self.save_master_weights:
            shards = [s for g in self.base_optimizer.param_groups for s in g["params"]]
            state["sharded_master_weights"] = {i: s.data for i, s in enumerate(shards)}
        return state

    def load_state_dict(self, state_dict):
        state_dict = copy.deepcopy(state_dict)
        base_state = state_dict.pop("base_state")
        master = state_dict.pop("sharded_master_weights", None)
        state_dict.pop("shape_info", None)
        super().load_state_dict(state_dict)
        self.init_zero()  # fresh slices of the current parameters
        inner = self.base_optimizer.state_dict()
        inner["state"] = base_state
        inner["param_groups"] = state_dict["param_groups"]
        self.base_optimizer.load_state_dict(inner)
        if master is None:
            return
        dummies = []
        with torch.no_grad():
            for group, sharded, loaded in zip(
                self.param_groups, self.base_optimizer.param_groups, state_dict["param_groups"]
            ):
                for p, shard, index in zip(group["params"], sharded["params"], loaded["params"]):
                    shard.copy_(master[index])
                    if self.use_grad_acc_hook:
                        shard.main_grad = torch.zeros(
                            p.shape, dtype=self.optimizer_dtype, device=self.device
                        )
                        p.main_grad = shard.main_grad
                    elif p.grad is None:
                        p.grad = torch.zeros_like(p)  # so that the gather below includes p
                        dummies.append(p)
        xm.mark_step()
        self.allgather_weights_and_update_full_parameter()
        for p in dummies:
            p.grad = None
        xm.mark_step()
