"""``torch_xla.experimental.spmd_fully_sharded_data_parallel`` (FSDPv2) on torchacc.

``SpmdFullyShardedDataParallel(module, mesh, shard_output=None, auto_wrap_policy=None,
auto_wrapper_callable=None, extra_data_axis=None)`` moves ``module`` to the device and shards
every parameter's largest dimension over the mesh's ``fsdp`` axis (``torchacc.distributed.fsdp``)
and constrains the forward's output to be split by batch; XLA's partitioner gathers parameters
per layer and reduce-scatters their gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from torchacc.distributed import fsdp
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla.distributed.spmd import xla_sharding as xs


def _prepare_spmd_partition_spec(param, extra_data_axis=None, shard_maximal=False):
    spec = list(fsdp.parameter_spec(tuple(param.shape), "fsdp", shard_maximal))
    if extra_data_axis is not None:
        spec = [(extra_data_axis, e) if e is not None else None for e in spec]
    return tuple(spec)


def _default_shard_output(output, mesh, extra_data_axis=None):
    real = output
    if isinstance(output, (tuple, list)):
        real = output[0]
    elif hasattr(output, "logits") and isinstance(output.logits, torch.Tensor):
        real = output.logits  # a transformers ModelOutput
    if not isinstance(real, torch.Tensor):
        raise RuntimeError(
            f"SpmdFullyShardedDataParallel: cannot shard an output of type {type(output)}; pass "
            "shard_output=callable(output, mesh)"
        )
    axes = "fsdp" if extra_data_axis is None else (extra_data_axis, "fsdp")
    if torch.compiler.is_dynamo_compiling():  # torch.compile: a constraint in the graph
        if real.device.type == DEVICE_TYPE and real.dim() > 0:
            xs.mark_sharding(real, mesh, fsdp.batch_spec(real.dim(), axes))
        return
    fsdp.shard_batch(real, mesh.get_jax_mesh(), axes)


def _numel(module):
    return sum(p.numel() for p in module.parameters())


class SpmdFullyShardedDataParallel(nn.Module):
    """FSDPv2: ``module``'s parameters sharded over the ``fsdp`` axis of ``mesh`` (or the
    global mesh); ``auto_wrap_policy(module=, recurse=, nonwrapped_numel=)`` (torch's FSDP
    policies) picks submodules to wrap first, with ``auto_wrapper_callable(m, *args, **kw)``."""

    def __init__(
        self,
        module,
        mesh=None,
        shard_output=None,
        auto_wrap_policy=None,
        auto_wrapper_callable=None,
        extra_data_axis=None,
    ):
        if isinstance(module, SpmdFullyShardedDataParallel):
            raise RuntimeError("SpmdFullyShardedDataParallel: the module is already wrapped")
        mesh = mesh if mesh is not None else xs.get_global_mesh()
        if mesh is None:
            raise ValueError("SpmdFullyShardedDataParallel: pass mesh= or call xs.set_global_mesh")
        if not mesh.axis_names or "fsdp" not in mesh.axis_names:
            raise ValueError(
                f"SpmdFullyShardedDataParallel: the mesh must have an axis named 'fsdp', got "
                f"axis names {mesh.axis_names}"
            )
        if extra_data_axis is not None and extra_data_axis not in mesh.axis_names:
            raise ValueError(
                f"SpmdFullyShardedDataParallel: extra_data_axis={extra_data_axis!r}: The provided "
                f"{extra_data_axis} axis is not in the mesh (axes {mesh.axis_names})"
            )
        super().__init__()
        if auto_wrap_policy is not None:
            wrapper = auto_wrapper_callable or (
                lambda m, *a, **kw: SpmdFullyShardedDataParallel(m, *a, **kw)
            )
            self._wrap_children(
                module, auto_wrap_policy, wrapper, mesh, shard_output, extra_data_axis
            )
        # a module still on the CPU moves to the device first, as torch_xla does
        module = module.to(torch.device(DEVICE_TYPE, 0))
        self._orig_module = module
        self._mesh = mesh
        self._extra_data_axis = extra_data_axis
        # each parameter's largest dim over 'fsdp' (torch_xla's shard_maximal=True)
        fsdp.shard_parameters(module, mesh.get_jax_mesh(), maximal=True)
        self._shard_output = shard_output or (
            lambda out, m: _default_shard_output(out, m, extra_data_axis)
        )

    @staticmethod
    def _wrap_children(module, policy, wrapper, mesh, shard_output, extra_data_axis):
        for name, child in list(module.named_children()):
            SpmdFullyShardedDataParallel._wrap_children(
                child, policy, wrapper, mesh, shard_output, extra_data_axis
            )
            if isinstance(child, SpmdFullyShardedDataParallel):
                continue
            if policy(module=child, recurse=False, nonwrapped_numel=_numel(child)):
                setattr(
                    module,
                    name,
                    wrapper(
                        child, mesh=mesh, shard_output=shard_output, extra_data_axis=extra_data_axis
                    ),
                )

    @property
    def module(self):
        return self._orig_module

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        self._shard_output(output, self._mesh)
        return output

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def __getitem__(self, key):
        return self.module.__getitem__(key)
