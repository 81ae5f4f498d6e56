"""Device tensors at the trace-once frontend's program boundary (SPMD on ``torchacc.compile``).

Note [Device tensors in a trace-once program]
In SPMD mode a step's tensors live on the torchacc device: parameters and inputs marked with
``mark_sharding`` (FSDPv2, ``torchacc.parallel``, ``accelerate``) hold global ``jax.Array``s with a
``NamedSharding``. A program the trace-once frontend compiled (``torchacc.compile``,
torchacc/dynamo) takes those arrays as they are: ``jax.jit`` reads each argument's sharding (the
program's in_shardings), a result that overwrites an argument (a parameter, an optimizer moment)
or is a parameter's gradient is given that argument's sharding (out_shardings, so state keeps its
layout and the program compiles once), and a mark inside the traced step is a
``torchacc::shard`` node, a ``with_sharding_constraint``. Results come back as torchacc tensors
holding the program's arrays; state is rebound to its new array (no recorded op, no copy).

The trace-once frontend may not import the lazy one; the lazy frontend registers the three
functions below and its tensor class when it loads (``torchacc/lazy/transfer.py``). The class is
what dynamo is told to see as a plain tensor (Note [torch.compile over torchacc tensors] in
torchacc/dynamo/device_tensors.py).
"""

from __future__ import annotations

# name of the device type, and the lazy frontend's callbacks (None until it loads)
device_type = [None]
_array_of = [None]  # fn(tensor) -> jax.Array (its pending graph run first)
_tensor_of = [None]  # fn(array, torch dtype) -> a new device tensor holding ``array``
_rebind = [None]  # fn(tensor, array): the tensor's data is now ``array``
tensor_type = [None]  # the torch.Tensor subclass of torchacc-device tensors


def register(name, array_of, tensor_of, rebind, cls=None):
    device_type[0] = name
    _array_of[0], _tensor_of[0], _rebind[0] = array_of, tensor_of, rebind
    tensor_type[0] = cls


def is_device_tensor(t):
    """Whether torch tensor ``t`` lives on the torchacc device."""
    return device_type[0] is not None and t.device.type == device_type[0]


def array_of(t):
    return _array_of[0](t)


def tensor_of(array, dtype):
    return _tensor_of[0](array, dtype)


def rebind(t, array):
    _rebind[0](t, array)
