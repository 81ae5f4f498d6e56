"""The trace-once frontend: ``torch.compile(model, backend="torchacc")`` and ``compile_step``.

A step is captured once (dynamo + AOTAutograd, or a whole-step trace) as FX graphs of ATen ops,
each lowered with ``torchacc.lowering`` into one jitted JAX program; later calls only launch the
programs. Tensors stay where the user keeps them (CPU or CUDA, zero-copy through DLPack).
README: "torch.compile backend and whole-step compile".

Importing this package registers the ``"torchacc"`` dynamo backend (an installed torchacc also
registers it through the ``torch_dynamo_backends`` entry point) and teaches dynamo to see
torchacc-device tensors as tensors (device_tensors.py). The entry point names the function
``torchacc.dynamo:backend``, so no submodule may be called ``backend``: importing it would rebind
the package attribute to the module (the AOTAutograd backend lives in ``aot.py``).
"""

from __future__ import annotations


def backend(gm, example_inputs, **kwargs):
    """The dynamo backend; imports the machinery on first use (entry point target)."""
    from torchacc.dynamo.aot import backend as _backend

    return _backend(gm, example_inputs, **kwargs)


def compile_step(fn=None, **options):
    """Compile a whole training step (forward, backward, optimizer update) into one program.

    See torchacc/dynamo/step.py."""
    from torchacc.dynamo.step import compile_step as _compile_step

    return _compile_step(fn, **options)


def register():
    """Register ``backend`` with dynamo under the name ``"torchacc"`` (idempotent)."""
    from torch._dynamo.backends import registry

    if registry._COMPILER_FNS.get("torchacc") is not backend:
        registry._COMPILER_FNS.pop("torchacc", None)
        registry.register_backend(backend, name="torchacc")


def _installed_entry_point():
    """Whether an installed torchacc declares the backend as a dynamo entry point: then dynamo
    loads this module and registers ``backend`` itself (registering it here first would make that
    a duplicate name)."""
    from importlib.metadata import entry_points

    return any(e.name == "torchacc" for e in entry_points(group="torch_dynamo_backends"))


if not _installed_entry_point():
    register()

# dynamo fakes torchacc-device tensors as plain tensors (Note [torch.compile over torchacc tensors])
from torchacc.dynamo import device_tensors as _device_tensors  # noqa: E402

_device_tensors.install()

__all__ = ["backend", "compile_step", "register"]
