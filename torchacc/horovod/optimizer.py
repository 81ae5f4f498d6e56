"""``hvd.DistributedOptimizer``, ``hvd.Compression``, ``hvd.broadcast_parameters`` and
``hvd.broadcast_optimizer_state``.

Eager path (CPU/CUDA parameters): a post-accumulate-grad hook per parameter counts backward
passes; when every gradient of a bucket (about 25 MB of parameters of one dtype and device, in
reverse registration order, the order backward produces them) has had ``backward_passes_per_step``
passes, the bucket's flattened gradients are all-reduced asynchronously while backward goes on.
``synchronize()`` waits for them and writes the reduced values into ``p.grad``. Torchacc path
(torchacc parameters): ``synchronize()`` records one coalesced all-reduce of all gradients in the
step, as ``xm.reduce_gradients`` does (Note [Horovod on two paths] in ``__init__.py``).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from torchacc.distributed import state
from torchacc.horovod import basics, exchange, ops
from torchacc.sharding import collectives as C


class _NoneCompressor:
    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compressor:
    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Gradient compression for ``allreduce`` and ``DistributedOptimizer``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


def _bucket_bytes():
    return int(float(os.environ.get("TORCHACC_HVD_BUCKET_MB", "25")) * 2**20)


class _Bucket:
    __slots__ = ("params", "ready", "work", "flat", "ctx")

    def __init__(self, params):
        self.params, self.ready, self.work, self.flat, self.ctx = params, 0, None, None, None


class _DistributedOptimizer:
    """Methods mixed into the user's optimizer class by ``DistributedOptimizer``."""

    def _hvd_setup(
        self, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor
    ):
        ops._check_op("DistributedOptimizer", op)
        if gradient_predivide_factor != 1.0 and op is not ops.Average:
            raise ValueError(
                "torchacc.horovod.DistributedOptimizer: gradient_predivide_factor applies to "
                "op=hvd.Average only"
            )
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._hvd_names = _names(params, named_parameters)
        self._hvd_params = params
        self._hvd_compression = compression
        self._hvd_passes = int(backward_passes_per_step)
        self._hvd_op = op
        self._hvd_predivide = float(gradient_predivide_factor)
        self._hvd_should_sync = True
        self._hvd_synchronized = False
        self._hvd_counts = {p: 0 for p in params}
        self._hvd_checked = False
        eager = [p for p in params if not ops.on_device(p)]
        self._hvd_buckets, self._hvd_bucket_of = _buckets(eager)
        self._hvd_hooks = []
        if basics.size() > 1:
            self._hvd_hooks = [p.register_post_accumulate_grad_hook(self._hvd_hook) for p in eager]

    def _hvd_scales(self):
        if self._hvd_op is ops.Average:
            return 1.0 / self._hvd_predivide, self._hvd_predivide / basics.size()
        return 1.0, 1.0

    def _hvd_hook(self, p):
        n = self._hvd_counts[p] + 1
        if n > self._hvd_passes:
            raise AssertionError(
                "torchacc.horovod.DistributedOptimizer: gradients were computed more than "
                f"backward_passes_per_step={self._hvd_passes} times before optimizer.step() or "
                "optimizer.synchronize(); raise backward_passes_per_step to accumulate more"
            )
        self._hvd_counts[p] = n
        if n == self._hvd_passes:
            bucket = self._hvd_bucket_of[p]
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and self._hvd_checked:
                self._hvd_launch(bucket)

    def _hvd_launch(self, bucket):
        pre, _ = self._hvd_scales()
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        flat = torch.cat(grads) if len(grads) > 1 else grads[0].clone()
        flat, bucket.ctx = self._hvd_compression.compress(flat)
        if pre != 1.0:
            flat.mul_(pre)
        torch_op = getattr(dist.ReduceOp, ops._TORCH_OP[self._hvd_op.name])
        bucket.flat = flat
        bucket.work = dist.all_reduce(flat, torch_op, async_op=True)

    def _hvd_first_check(self):
        """Once: every rank has the same parameters (names, shapes, dtypes), so the buckets
        match; a clear error on every rank otherwise."""
        described = [
            (n, tuple(p.shape), str(p.dtype))
            for n, p in zip(self._hvd_names, self._hvd_params, strict=True)
        ]
        ops._describe.current = f"{len(described)} parameters"
        ops._exchange("DistributedOptimizer", [], ops._signature(described))
        self._hvd_checked = True

    def synchronize(self):
        """Finish reducing every gradient: afterwards ``p.grad`` holds the reduced gradient."""
        if basics.size() == 1:
            self._hvd_reset()
            return
        if not self._hvd_checked:
            self._hvd_first_check()
        lazy = [p for p in self._hvd_params if ops.on_device(p)]
        if lazy:
            self._hvd_reduce_on_device(lazy)
        for bucket in self._hvd_buckets:
            if bucket.work is None:
                self._hvd_launch(bucket)  # parameters that got no gradient reduce zeros
        _, post = self._hvd_scales()
        with torch.no_grad():
            for bucket in self._hvd_buckets:
                bucket.work.wait()
                if post != 1.0:  # in the sent dtype, as Horovod's postscale
                    bucket.flat.mul_(post)
                flat = self._hvd_compression.decompress(bucket.flat, bucket.ctx)
                offset = 0
                for p in bucket.params:
                    n = p.numel()
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                    offset += n
        self._hvd_reset()
        self._hvd_synchronized = True

    def _hvd_reduce_on_device(self, params):
        pre, post = self._hvd_scales()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        sent = []
        ctxs = []
        for g in grads:
            c, ctx = self._hvd_compression.compress(g)
            sent.append(c * pre if pre != 1.0 else c)
            ctxs.append(ctx)
        op = ops._DEVICE_OP[self._hvd_op.name]
        reduced = C.average_gradients(sent, post, op)  # Note [One gradient average, one start]
        with torch.no_grad():
            for p, g, r, ctx in zip(params, grads, reduced, ctxs, strict=True):
                r = self._hvd_compression.decompress(r, ctx)
                if p.grad is None:
                    p.grad = r
                else:
                    g.copy_(r)

    def _hvd_reset(self):
        for p in self._hvd_counts:
            self._hvd_counts[p] = 0
        for bucket in self._hvd_buckets:
            bucket.ready, bucket.work, bucket.flat, bucket.ctx = 0, None, None, None

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``step()`` does not synchronize (call ``synchronize()`` yourself first, e.g.
        to clip the reduced gradients)."""
        self._hvd_should_sync = False
        try:
            yield
        finally:
            self._hvd_should_sync = True

    def step(self, closure=None):
        if self._hvd_should_sync:
            if self._hvd_synchronized:
                import warnings

                warnings.warn(
                    "torchacc.horovod: optimizer.step() after optimizer.synchronize() reduces "
                    "the gradients again; use `with optimizer.skip_synchronize():`",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none=True):
        if any(b.work is not None for b in self._hvd_buckets):
            raise AssertionError(
                "torchacc.horovod.DistributedOptimizer: optimizer.zero_grad() was called after "
                "loss.backward() but before optimizer.step() or optimizer.synchronize()"
            )
        return super(self.__class__, self).zero_grad(set_to_none)


def _names(params, named_parameters):
    if named_parameters is None:
        return [f"allreduce.noname.{i}" for i in range(len(params))]
    pairs = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in pairs):
        raise ValueError(
            "torchacc.horovod.DistributedOptimizer: named_parameters must be (name, parameter) "
            "pairs, e.g. model.named_parameters()"
        )
    seen, dups = set(), []
    for n, _ in pairs:
        if n in seen:
            dups.append(n)
        seen.add(n)
    if dups:
        raise ValueError(
            "torchacc.horovod.DistributedOptimizer: parameter names in named_parameters must be "
            f"unique; duplicates: {sorted(set(dups))}"
        )
    by_id = {id(p): n for n, p in pairs}
    missing = [tuple(p.shape) for p in params if id(p) not in by_id]
    if missing:
        raise ValueError(
            "torchacc.horovod.DistributedOptimizer: named_parameters was given, but "
            f"{len(missing)} parameter(s) of the optimizer are not in it (shapes {missing}); "
            "merge every model's named_parameters()"
        )
    return [by_id[id(p)] for p in params]


def _buckets(params):
    limit, buckets, of = _bucket_bytes(), [], {}
    current, size, key = [], 0, None
    for p in reversed(params):
        k = (p.dtype, p.device)
        nbytes = p.numel() * p.element_size()
        if current and (k != key or size + nbytes > limit):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += nbytes
        key = k
    if current:
        buckets.append(_Bucket(current))
    for b in buckets:
        for p in b.params:
            of[p] = b
    return buckets, of


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=Compression.none,
    backward_passes_per_step=1,
    op=ops.Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=None,
):
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged (``op``) over all ranks.

    Returns an object of a subclass of the optimizer's class that shares its parameter groups
    and state. ``backward_passes_per_step=k`` reduces after every k-th backward (the gradients
    accumulate, not divided by k); ``compression=hvd.Compression.fp16`` sends float16.
    """
    basics.require("DistributedOptimizer")
    if groups is not None or num_groups:
        raise NotImplementedError(
            "torchacc.horovod.DistributedOptimizer: groups=/num_groups= are not supported "
            "(gradients are bucketed by size; see TORCHACC_HVD_BUCKET_MB)"
        )
    if backward_passes_per_step < 1:
        raise ValueError(
            "torchacc.horovod.DistributedOptimizer: backward_passes_per_step must be >= 1, got "
            f"{backward_passes_per_step}"
        )
    base = type(optimizer)
    methods = {
        k: v for k, v in vars(_DistributedOptimizer).items() if k not in ("__dict__", "__weakref__")
    }
    cls = type(base.__name__, (base,), methods)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped._hvd_setup(
        named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor
    )
    return wrapped


# --------------------------------------------------------------------------------------------
# broadcasts of parameters and optimizer state (torchacc/distributed/state.py)


def broadcast_parameters(params, root_rank):
    """Overwrite parameters with rank ``root_rank``'s: ``params`` is a ``state_dict()`` (several
    models' may be merged) or a list of ``(name, tensor)`` pairs such as ``named_parameters()``."""
    basics.require("broadcast_parameters")
    exchange._check_root("broadcast_parameters", root_rank)
    if basics.size() > 1:
        state.broadcast_parameters(params, root_rank)


def broadcast_optimizer_state(optimizer, root_rank):
    """Make every rank's optimizer state and hyperparameters (lr, momentum, ...) rank
    ``root_rank``'s; state a rank has not created yet is created first."""
    basics.require("broadcast_optimizer_state")
    exchange._check_root("broadcast_optimizer_state", root_rank)
    if basics.size() > 1:
        state.broadcast_optimizer_state(optimizer, root_rank)
