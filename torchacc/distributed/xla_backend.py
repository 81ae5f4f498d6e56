"""The ``"xla"`` torch.distributed backend: process-group calls become in-graph collectives.

::

    import torchacc.torch_xla.distributed.xla_backend  # (or torchacc.distributed.xla_backend)
    dist.init_process_group(backend="xla", init_method="env://")   # under torchrun

``init_process_group`` keeps torch's own rendezvous (the env:// store) and, in the backend's
creator, joins the multi-process JAX runtime from the same environment (``runtime.initialize``), so
``dist.get_rank()/get_world_size()`` and ``xm.get_ordinal()/xrt_world_size()`` agree.

Collectives on torchacc tensors (``dist.all_reduce``, ``all_gather(_into_tensor)``,
``reduce_scatter(_tensor)``, ``broadcast``, ``all_to_all(_single)``, ``reduce``) are recorded in the
pending graph (``torchacc.distributed.collectives``) and run by XLA at the next ``torchacc.sync()``;
their Work objects are complete at once, as in torch_xla. CPU tensors work too, through a copy
to the device and back (running just that collective at once). ``barrier`` waits on the JAX
coordination service. ``send``/``recv`` are one ppermute each, run at once as torch's blocking
calls are (the peers' matching calls run the same op; with more than two processes, or in SPMD
mode, a program of the two peers alone); ``batch_isend_irecv`` records one collective_permute per
permutation the ranks' lists form together (a ring: one). Rooted gather/scatter raise
``NotImplementedError``; so does any collective on a group smaller than the whole job.
"""

from __future__ import annotations

import datetime
import functools

import torch
import torch.distributed as dist

from torchacc.engine import execute
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.record import value_of
from torchacc.lazy.tensor import LazyTensor
from torchacc.lazy.transfer import to_device as _upload
from torchacc.runtime import processes as runtime
from torchacc.sharding import collectives, point_to_point

BACKEND_NAME = "xla"


def _done(result=None):
    fut = torch.futures.Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


class ProcessGroupXla(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives are recorded into torchacc's graph."""

    def __init__(self, store, rank, size, timeout, global_ranks=None):
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout if timeout is not None else datetime.timedelta(minutes=30)
        world = runtime.world_size()
        ranks = list(global_ranks) if global_ranks else list(range(size))
        self._whole_world = size == world and sorted(ranks) == list(range(world))
        self._global_ranks = ranks

    def getBackendName(self):
        return BACKEND_NAME

    def _get_backend_name(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    # -- helpers ------------------------------------------------------------------------------
    def _check(self, op):
        if not self._whole_world:
            raise NotImplementedError(
                f"torchacc 'xla' process group: {op} on a group of ranks {self._global_ranks} is "
                f"not supported; collectives run over the whole job of {runtime.world_size()} "
                "processes"
            )

    def _global_rank(self, group_rank):
        return self._global_ranks[group_rank]

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        self._check("all_reduce")
        op = collectives.reduce_op_name(_reduce_op(opts), "all_reduce")
        collectives.all_reduce(op, list(tensors))
        return _done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        self._check("all_reduce_coalesced")
        op = collectives.reduce_op_name(_reduce_op(opts), "all_reduce_coalesced")
        collectives.all_reduce(op, list(tensors))
        return _done(tensors)

    def reduce(self, tensors, opts=None):
        # every rank gets the result; torch only promises it on the root
        self._check("reduce")
        op = collectives.reduce_op_name(_reduce_op(opts), "reduce")
        collectives.all_reduce(op, list(tensors))
        return _done(tensors)

    # -- gathers --------------------------------------------------------------------------------
    def allgather(self, output_tensors_lists, input_tensors, opts=None):
        self._check("all_gather")
        for outputs, inp in zip(output_tensors_lists, input_tensors, strict=True):
            if len(outputs) != self.size():
                raise ValueError(
                    f"torchacc 'xla' process group: all_gather needs {self.size()} output tensors, "
                    f"got {len(outputs)}"
                )
            for out in outputs:
                if tuple(out.shape) != tuple(inp.shape):
                    raise NotImplementedError(
                        "torchacc 'xla' process group: all_gather with output shapes differing "
                        f"from the input ({tuple(out.shape)} vs {tuple(inp.shape)})"
                    )
            gathered = collectives.all_gather(inp.unsqueeze(0), dim=0)
            collectives._write(outputs, list(gathered.unbind(0)))
        return _done(output_tensors_lists)

    def allgather_coalesced(self, output_tensors_lists, input_tensors, opts=None):
        return self.allgather(output_tensors_lists, input_tensors, opts)

    def all_gather_single(self, output, input, opts=None):
        self._check("all_gather_into_tensor")
        n = self.size()
        if output.numel() != input.numel() * n:
            raise ValueError(
                f"torchacc 'xla' process group: all_gather_into_tensor output has {output.numel()} "
                f"elements, expected {n} x {input.numel()}"
            )
        if output.dim() == input.dim() and output.shape[0] == input.shape[0] * n:
            gathered = collectives.all_gather(input, dim=0)
        else:  # the stacked form: output (world, *input.shape)
            gathered = collectives.all_gather(input.unsqueeze(0), dim=0).reshape(output.shape)
        collectives._write([output], [gathered])
        return _done([output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs, strict=True):
            self.all_gather_single(out, inp, opts)
        return _done(outputs)

    # -- reduce-scatters ------------------------------------------------------------------------
    def reduce_scatter(self, output_tensors, input_tensors_lists, opts=None):
        self._check("reduce_scatter")
        op = collectives.reduce_op_name(_reduce_op(opts), "reduce_scatter")
        for out, inputs in zip(output_tensors, input_tensors_lists, strict=True):
            if len(inputs) != self.size():
                raise ValueError(
                    f"torchacc 'xla' process group: reduce_scatter needs {self.size()} input "
                    f"tensors, got {len(inputs)}"
                )
            stacked = torch.stack(list(inputs))
            result = collectives.reduce_scatter(op, stacked, 1.0, 0, self.size())
            collectives._write([out], [result.reshape(out.shape)])
        return _done(output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        self._check("reduce_scatter_tensor")
        op = collectives.reduce_op_name(_reduce_op(opts), "reduce_scatter_tensor")
        n = self.size()
        if input.numel() != output.numel() * n:
            raise ValueError(
                f"torchacc 'xla' process group: reduce_scatter_tensor input has {input.numel()} "
                f"elements, expected {n} x {output.numel()}"
            )
        if input.dim() == output.dim() and input.shape[0] == output.shape[0] * n:
            result = collectives.reduce_scatter(op, input, 1.0, 0, n)
        else:  # the stacked form: input (world, *output.shape)
            result = collectives.reduce_scatter(op, input.reshape(n, *output.shape), 1.0, 0, n)
        collectives._write([output], [result.reshape(output.shape)])
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for out, inp in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(out, inp, opts)
        return _done(outputs)

    # -- broadcast and all-to-all ---------------------------------------------------------------
    def broadcast(self, tensors, opts=None):
        self._check("broadcast")
        root = opts.rootRank if opts is not None else 0
        collectives.broadcast(list(tensors), self._global_rank(root))
        return _done(tensors)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, opts=None
    ):
        self._check("all_to_all_single")
        n = self.size()
        for name, sizes in (
            ("output_split_sizes", output_split_sizes),
            ("input_split_sizes", input_split_sizes),
        ):
            if sizes and len(set(sizes)) > 1:
                raise NotImplementedError(
                    f"torchacc 'xla' process group: all_to_all_single with unequal {name}={sizes}"
                )
        if input.shape[0] % n:
            raise ValueError(
                f"torchacc 'xla' process group: all_to_all_single input dimension 0 "
                f"({input.shape[0]}) does not split into {n} equal blocks"
            )
        result = collectives.all_to_all(input, 0, 0, n)
        collectives._write([output], [result.reshape(output.shape)])
        return _done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):
        self._check("all_to_all")
        n = self.size()
        if len(input_tensors) != n or len(output_tensors) != n:
            raise ValueError(f"torchacc 'xla' process group: all_to_all needs {n} tensors per list")
        shapes = {tuple(t.shape) for t in list(input_tensors) + list(output_tensors)}
        if len(shapes) > 1:
            raise NotImplementedError(
                "torchacc 'xla' process group: all_to_all with tensors of different shapes"
            )
        stacked = torch.stack(list(input_tensors))
        result = collectives.all_to_all(stacked, 0, 0, n)
        collectives._write(output_tensors, list(result.unbind(0)))
        return _done(output_tensors)

    # -- host synchronisation -------------------------------------------------------------------
    def barrier(self, opts=None):
        self._check("barrier")
        timeout = getattr(opts, "timeout", None) if opts is not None else None
        if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
            timeout = self._timeout
        collectives.barrier("pg", timeout.total_seconds())
        return _done()

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        seconds = timeout.total_seconds() if timeout is not None else self._timeout.total_seconds()
        collectives.barrier("monitored", seconds)

    # -- not supported --------------------------------------------------------------------------
    def _unsupported(self, op):
        raise NotImplementedError(
            f"torchacc 'xla' process group: {op} is not supported (collectives over the whole job "
            "only: all_reduce, all_gather, reduce_scatter, broadcast, all_to_all, reduce, barrier)"
        )

    # -- point to point ---------------------------------------------------------------------
    # send/recv: one ppermute run at once (a 2-process job: every rank records it; more
    # processes: a program of the two peers alone). batch_isend_irecv: Note [A batch of
    # point-to-point ops] in sharding/collectives.py (torch.distributed.batch_isend_irecv is
    # routed here for this group, see _route_batch_isend_irecv)
    def _p2p(self, op, tensors, peer):
        self._check(op)
        (t,) = tensors
        if not isinstance(t, LazyTensor):
            raise NotImplementedError(
                f"torchacc 'xla' process group: {op} of a {t.device} tensor; move it to the "
                "torchacc device (the exchange is recorded into the step)"
            )
        return t, self._global_rank(peer)

    def send(self, tensors, dst, tag=0):
        """``collective_permute(t, [(me, dst)])``, run at once; the peer's matching ``recv`` runs
        the same op (sends and receives pair up in the order each rank issues them)."""
        t, dst = self._p2p("send", tensors, dst)
        point_to_point.send_recv(t, runtime.rank(), dst, "send")
        return _done(tensors)

    def recv(self, tensors, src, tag=0):
        t, src = self._p2p("recv", tensors, src)
        result = point_to_point.send_recv(t, src, runtime.rank(), "recv")
        with torch.no_grad():
            t.copy_(result)
        return _done(tensors)

    def batch_isend_irecv(self, p2p_op_list):
        """torch's ``batch_isend_irecv`` on this group: every rank's sends and receives as
        collective_permutes recorded in the step (a ring is one); complete Work objects."""
        self._check("batch_isend_irecv")
        ops = []
        for p in p2p_op_list:
            kind = "send" if p.op in (dist.isend, dist.send) else "recv"
            if not isinstance(p.tensor, LazyTensor):
                raise NotImplementedError(
                    f"torchacc 'xla' process group: batch_isend_irecv {kind} of a "
                    f"{p.tensor.device} tensor; move it to the torchacc device (the exchange is "
                    "recorded into the step)"
                )
            ops.append((kind, self._global_rank(p.group_peer), p.tensor))
        point_to_point.batch_exchange(ops)
        return [_done([p.tensor]) for p in p2p_op_list]

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv_anysource")

    def gather(self, *args, **kwargs):
        self._unsupported("gather")

    def scatter(self, *args, **kwargs):
        self._unsupported("scatter")


def _via_device(method):
    """Let a collective take CPU tensors too: copy them to the device, run the collective there
    (just the graph it needs, at once) and copy the results back (a host round trip)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        pairs = []

        def to_device(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
                d = _upload(x)
                pairs.append((x, d))
                return d
            if isinstance(x, (list, tuple)):
                return type(x)(to_device(v) for v in x)
            return x

        work = method(self, *[to_device(a) for a in args], **kwargs)
        if pairs:
            values = [value_of(d) for _, d in pairs]
            pending = list({id(v): v for v in values if v.node is not None}.values())
            if pending:
                execute.run(pending, donate=False)
            with torch.no_grad():
                for host, d in pairs:
                    host.copy_(d.cpu())
        return work

    return wrapper


for _name in (
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "allgather",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_single",
    "broadcast",
    "all_to_all_single",
    "alltoall",
):
    setattr(ProcessGroupXla, _name, _via_device(getattr(ProcessGroupXla, _name)))
ProcessGroupXla._allgather_base = ProcessGroupXla.all_gather_single
ProcessGroupXla._reduce_scatter_base = ProcessGroupXla.reduce_scatter_single
ProcessGroupXla.alltoall_base = ProcessGroupXla.all_to_all_single
ProcessGroupXla.allgather_coalesced = ProcessGroupXla.allgather


def _reduce_op(opts):
    return opts.reduceOp if opts is not None else dist.ReduceOp.SUM


def _create_process_group(dist_backend_opts, backend_options=None):
    """The creator torch calls for ``backend="xla"`` (extended API: it tells the group's ranks)."""
    store = dist_backend_opts.store
    group_rank = dist_backend_opts.group_rank
    group_size = dist_backend_opts.group_size
    ranks = list(getattr(dist_backend_opts, "global_ranks_in_group", None) or [])
    runtime.initialize()
    world, me = runtime.world_size(), runtime.rank()
    if not ranks and group_size == world and group_rank != me:
        raise RuntimeError(
            f"torchacc 'xla' process group: torch.distributed says rank {group_rank} of "
            f"{group_size}, but this process joined the JAX runtime as rank {me} of {world} "
            "(RANK/WORLD_SIZE differ from what init_process_group was given?)"
        )
    if not ranks and group_size != world:
        raise RuntimeError(
            f"torchacc 'xla' process group: world size {group_size} given to init_process_group, "
            f"but the job (WORLD_SIZE) has {world} processes"
        )
    return ProcessGroupXla(store, group_rank, group_size, dist_backend_opts.timeout, ranks)


def _route_batch_isend_irecv():
    """``torch.distributed.batch_isend_irecv`` hands a list on an xla group to the group (torch
    calls isend/irecv one at a time on a group it cannot coalesce, and one rank's list alone does
    not say which exchange the ranks make together); any other group goes to torch's."""
    from torch.distributed import distributed_c10d as c10d

    torch_batch = c10d.batch_isend_irecv
    if getattr(torch_batch, "_torchacc", False):
        return

    @functools.wraps(torch_batch)
    def batch_isend_irecv(p2p_op_list):
        if p2p_op_list and isinstance(p2p_op_list[0], dist.P2POp):
            c10d._check_p2p_op_list(p2p_op_list)
            if isinstance(p2p_op_list[0].group, ProcessGroupXla):
                return p2p_op_list[0].group.batch_isend_irecv(p2p_op_list)
        return torch_batch(p2p_op_list)

    batch_isend_irecv._torchacc = True
    c10d.batch_isend_irecv = batch_isend_irecv
    dist.batch_isend_irecv = batch_isend_irecv


def _register():
    _route_batch_isend_irecv()
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_process_group, extended_api=True, devices=[DEVICE_TYPE, "cpu"]
    )


_register()
