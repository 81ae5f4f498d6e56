"""Flat step buffers: parameters, buffers and optimizer state as views of one buffer per dtype
(Note [Flat step buffers])."""

from __future__ import annotations

import operator
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchacc import metrics
from torchacc.dynamo import bridge, collective, lower

_DATA_PTR = torch.Tensor.data_ptr
_GRAD = operator.attrgetter("grad")

# Note [Flat step buffers]
# Calling a program costs about a microsecond per array argument, and every output handed back to
# torch costs a few more; a ResNet-50's parameters, BN buffers and AdamW state are ~750 tensors.
# So compile_step keeps them in a few flat buffers, one per (dtype, device): each user tensor
# becomes a view of its group's buffer (``t.data = flat[a:b].view(shape)``, the same objects, so
# optimizer state keyed by parameter and every outside reference stay valid). The program takes
# the flat buffers (zero-copy, cached, Note [Zero-copy hand-off]), slices them into the traced
# graph's per-tensor inputs, and concatenates the updated tensors into one new buffer per group,
# which is copied back into the user's flat buffer in one memcpy. Gradients come back the same
# way into one flat gradient buffer per group, the parameters' ``.grad`` being views of it. Steps
# whose graph reads incoming gradients (accumulation across calls), or tensors that do not own
# their whole storage, use the per-tensor path.

# Note [Adopting output buffers]
# On the CPU the write-back is not a copy: the user's flat buffer *adopts* the program's output
# buffer. ``UntypedStorage._swap_data_ptr_`` swaps the memory under the flat buffer's storage with
# that of the output (a torch tensor aliasing the XLA buffer through DLPack), so every view of it
# -- parameters, optimizer state, ``.grad`` -- now reads the new values, and the output's JAX
# array is remembered as the flat buffer's zero-copy input for the next call (bridge.remember).
# A ResNet-50's parameters, AdamW state and gradients are ~400 MB: a memcpy per step saved. The
# old memory changes owner (the DLPack tensor that held the output) and is kept until the next
# call has run, so JAX arrays that aliased it (this call's inputs; what ``launch_hook`` saw) stay
# valid until then. An output whose buffer is also an input's or another output's, or of another
# size, is copied instead; so is everything on CUDA (the copy is a device memcpy there).


class _FlatRunner:
    @classmethod
    def build(cls, prog, world, n_state, n_grad, n_args):
        low = prog.lowered
        if (
            low.on_device  # sharded state stays per tensor: Note [Flat step buffers]
            or not low._fast
            or low.pieces[0].static
            or any(i >= n_state and i < n_state + n_grad for i in low._fast_dynamic)
        ):
            return None
        tensors = world.tensors
        if prog.arg_mutations or any(not _owns_storage(t) for t in tensors):
            return None
        return cls(prog, world, n_state, n_grad, n_args)

    def __init__(self, prog, world, n_state, n_grad, n_args):
        low = prog.lowered
        self.prog, self.low = prog, low
        self.piece = low.pieces[0]
        self.device = low.device
        tensors = world.tensors
        # groups of state tensors by (dtype, device); each tensor -> (group, offset, numel, shape)
        self.groups, self.where, self.flat_tensors = _flatten(tensors)
        self.ptrs = [t.data_ptr() for t in tensors]
        itemsize = [self.flat_tensors[g].element_size() for g, *_ in self.where]
        self.ptr_group = np.array([g for g, *_ in self.where], dtype=np.int64)
        self.ptr_offset = np.array(
            [off * size for (_, off, *_), size in zip(self.where, itemsize)], dtype=np.int64
        )
        self.retired = []  # Note [Adopting output buffers]
        params = world.params
        grad_groups, grad_where = _layout([params[k] for k in prog.grad_out])
        self.grad_flats = [torch.zeros(n, dtype=dt, device=dev) for (dt, dev), n in grad_groups]
        self.grad_where = grad_where
        self.grad_views = [
            self.grad_flats[gi][off : off + n].view(shape) for gi, off, n, shape in grad_where
        ]
        self.grad_params = [params[k] for k in prog.grad_out]
        self.grad_out = set(prog.grad_out)
        mutated = {i: pos for i, pos in prog.mutated}
        self.mutated_groups = sorted({self.where[i][0] for i in mutated if i < n_state})
        n_user = prog.n_user
        self.n_user = n_user
        plan = low._plan
        self.arg_pos = prog.arg_pos
        sources = []  # per program input (seg.inputs order): ("state", i) | ("arg", j) | ("lr", l)
        for ph in low._fast_dynamic:
            if ph < n_state:
                sources.append(("state", ph))
            elif ph < n_state + n_grad + n_args:
                sources.append(("arg", ph - n_state - n_grad))
            else:
                sources.append(("lr", ph - n_state - n_grad - n_args))
        inner = self.piece.function(())
        where = self.where
        out_index = [x for _, x in plan]
        grad_src = list(range(n_user, n_user + len(prog.grad_out)))
        mut_groups = self.mutated_groups

        def whole(key, flats, args, lrs):
            inputs = []
            for kind, i in sources:
                if kind == "state":
                    gi, off, n, shape = where[i]
                    inputs.append(flats[gi][off : off + n].reshape(shape))
                elif kind == "arg":
                    inputs.append(args[i])
                else:
                    inputs.append(lrs[i])
            outs = inner(key, *inputs)
            graph_outs = [outs[j] for j in out_index]
            user = graph_outs[:n_user]
            grads = [graph_outs[j] for j in grad_src]
            new_flats = []
            for gi in mut_groups:
                parts = []
                for i, (g, off, n, _shape) in enumerate(where):
                    if g != gi:
                        continue
                    pos = mutated.get(i)
                    value = graph_outs[pos] if pos is not None else flats[gi][off : off + n]
                    parts.append(value.reshape(-1).astype(flats[gi].dtype))
                new_flats.append(_concat(parts))
            grad_flats = []
            for gi in range(len(grad_groups)):
                parts = [grads[j].reshape(-1) for j, w in enumerate(grad_where) if w[0] == gi]
                grad_flats.append(_concat(parts))
            return user, new_flats, grad_flats

        self.whole = whole
        self.fn = jax.jit(whole)
        self.exe = None
        self.grads_after = None
        n_lr = len(world.lrs())
        self.lr_host = torch.zeros(n_lr, dtype=torch.float64) if not low.cuda else None
        self.lr_np = self.lr_host.numpy() if self.lr_host is not None else None
        self.lr_last, self.lr_array = None, None

    def valid(self, world):
        """Every state tensor is still the view of the flat buffer it was made (nobody assigned
        its ``.data``, e.g. ``module.to()``); one C-level pass."""
        return list(map(_DATA_PTR, world.tensors)) == self.ptrs

    def _lr_input(self, world):
        """The learning rates as the program's float64 input. CPU: written into a host buffer
        the program reads zero-copy (Note [Zero-copy hand-off]; each call waits for its program,
        so the next write never races a read); else put on the device when they change."""
        lrs = world.lrs()
        if self.lr_host is not None:
            self.lr_np[:] = lrs
            return bridge.to_jax_cpu(self.lr_host)
        if lrs != self.lr_last:
            self.lr_last = lrs
            self.lr_array = jax.device_put(np.asarray(lrs, dtype=np.float64), self.device)
        return self.lr_array

    def run(self, world, leaves, grads):
        low, device = self.low, self.device
        flats = [lower._to_jax(f, device) for f in self.flat_tensors]
        args = [lower._to_jax(leaves[i], device) for i in self.arg_pos]
        lrs = self._lr_input(world)
        key = self.piece.new_key()
        exe = self.exe
        if exe is None:
            start = time.perf_counter()
            if self.piece.collective:  # Note [Multi-process programs]
                exe = self.exe = collective.compile(self.whole, key, flats, args, lrs)
            else:
                exe = self.exe = self.fn.lower(key, flats, args, lrs).compile()
            metrics.record_time("DynamoCompileTime", time.perf_counter() - start)
            metrics.counter_inc("DynamoCompile")
            metrics.program_compiled(exe)  # its FLOPs (Note [Step FLOPs] in metrics.py)
        if lower.launch_hook is not None:
            lower.launch_hook(lambda k, *a: exe(k, *a), key, [flats, args, lrs])
        user, new_flats, grad_flats = exe(key, flats, args, lrs)
        metrics.counter_inc("DynamoExecute")
        metrics.program_ran(exe)
        conv = lower.to_torch
        cuda = low.cuda
        if not cuda:
            jax.block_until_ready((user, new_flats, grad_flats))
        if cuda:
            with torch.no_grad():
                for gi, new in zip(self.mutated_groups, new_flats):
                    self.flat_tensors[gi].copy_(conv(new, cuda))
                for flat, new in zip(self.grad_flats, grad_flats):
                    flat.copy_(conv(new, cuda))
        else:
            self._adopt_outputs(flats, user, new_flats, grad_flats)
        if list(map(id, grads)) != self.grads_after:  # the .grad objects the last run left
            self._set_grads(world)
        return [conv(u, cuda) for u in user]

    def _adopt_outputs(self, flats, user, new_flats, grad_flats):
        """Note [Adopting output buffers]: the flat buffers take over the outputs' memory."""
        targets = [self.flat_tensors[gi] for gi in self.mutated_groups] + self.grad_flats
        outs = list(new_flats) + list(grad_flats)
        ptrs = [a.unsafe_buffer_pointer() for a in outs]
        taken = {a.unsafe_buffer_pointer() for a in list(flats) + list(user)}
        retired, self.retired = self.retired, []
        with torch.no_grad():
            for flat, arr, ptr in zip(targets, outs, ptrs):
                out = bridge.to_torch_cpu(arr)
                storage = flat.untyped_storage()
                if ptr in taken or ptrs.count(ptr) > 1 or not _adoptable(storage, out):
                    flat.copy_(out)
                    continue
                storage._swap_data_ptr_(out.untyped_storage())
                self.retired.append(out)  # now holds the old memory
                bridge.remember(flat, arr)
        bases = np.array([f.data_ptr() for f in self.flat_tensors], dtype=np.int64)
        self.ptrs = (bases[self.ptr_group] + self.ptr_offset).tolist()
        del retired  # the memory of two calls ago: nothing aliases it any more

    def _set_grads(self, world):
        """Point the parameters' ``.grad`` at the flat gradient views (None where the step
        produces no gradient); steady steps find them there and skip this."""
        for p, v in zip(self.grad_params, self.grad_views):
            if p.grad is not v:
                p.grad = v
        params = world.params
        if len(self.grad_params) != len(params):
            for k, p in enumerate(params):
                if k not in self.grad_out and p.grad is not None:
                    p.grad = None
        self.grads_after = list(map(id, map(_GRAD, params)))  # views stay alive: ids are safe


def _adoptable(storage, out):
    return (
        hasattr(storage, "_swap_data_ptr_")
        and out.untyped_storage().nbytes() == storage.nbytes()
        and out.storage_offset() == 0
    )


def _concat(parts, fan_in=16):
    """One flat array from many, as a tree of small concatenations: one concatenation of hundreds
    of operands takes XLA:CPU minutes to compile (a ResNet-50's state is ~750 tensors)."""
    while len(parts) > 1:
        parts = [
            jnp.concatenate(parts[i : i + fan_in]) if len(parts[i : i + fan_in]) > 1 else parts[i]
            for i in range(0, len(parts), fan_in)
        ]
    return parts[0]


def _owns_storage(t):
    return (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        and t.device.type in ("cpu", "cuda")
    )


def _layout(tensors):
    """Groups by (dtype, device) -> [((dtype, device), numel)], and per tensor
    (group, offset, numel, shape)."""
    order, sizes, where = {}, [], []
    for t in tensors:
        k = (t.dtype, t.device)
        if k not in order:
            order[k] = len(sizes)
            sizes.append([k, 0])
        gi = order[k]
        where.append((gi, sizes[gi][1], t.numel(), tuple(t.shape)))
        sizes[gi][1] += t.numel()
    return [tuple(s) for s in sizes], where


def _flatten(tensors):
    """Move ``tensors`` into one flat buffer per (dtype, device); each becomes a view of it."""
    groups, where = _layout(tensors)
    flats = [torch.empty(n, dtype=dt, device=dev) for (dt, dev), n in groups]
    with torch.no_grad():
        for t, (gi, off, n, shape) in zip(tensors, where):
            view = flats[gi][off : off + n]
            view.copy_(t.reshape(-1))
            t.data = view.view(shape)
    return groups, where, flats
