"""torchacc: record PyTorch training steps on a lazy device and run them as XLA programs (JAX).

Public API::

    dev = torchacc.device()          # torch.device('torchacc', 0)
    torchacc.sync()                  # = mark_step(): compile (first time) and launch the step
    torchacc.sync(wait=True)         # ... and wait for the device
    step = torchacc.compile(train_step)  # trace once: the whole step as one program
    torchacc.metrics.metrics_report()
    model, loader = torchacc.accelerate(model, loader, torchacc.Config())  # TorchAcc's front door
"""

from torchacc import _jaxconfig  # noqa: F401  (before JAX makes any array)
from torchacc import program as _program
from torchacc.lazy import dispatch as _dispatch  # noqa: F401  (installs __torch_dispatch__)
from torchacc import metrics
from torchacc.lazy.device import device, device_hw
from torchacc.runtime.device import jax_device, platform
from torchacc.engine.execute import sync, wait_device_ops
from torchacc.lazy.tensor import LazyTensor
from torchacc.lazy import factories as _factories  # noqa: F401  (device= factories route here)
from torchacc.lazy import op_counters as _op_counters  # noqa: F401  (xla::<op> counters)
from torchacc.lazy import autograd_kernels as _autograd_kernels  # noqa: F401  (above autograd)
from torchacc.lazy import layer_kernels as _layer_kernels  # noqa: F401  (above autograd)
from torchacc.lazy import op_sites as _op_sites
from torchacc.engine.explain import SyncWarning
from torchacc.amp import autocast_policy as _autocast_policy
from torchacc.accel.config import Config
from torchacc.accel.loader import AsyncLoader
from torchacc.accel.api import accelerate, mark_dynamic
from torchacc.accel import ops
from torchacc.lazy.scan_hf import scan_hf_layers
from torchacc import amp, dist, utils  # TorchAcc's ta.amp, ta.dist, ta.utils namespaces
from torchacc.amp import syncfree
from torchacc.core import fetch_gradients, is_lazy_device, is_lazy_tensor, lazy_device

mark_step = sync
_op_sites.install()  # TORCHACC_DEBUG=1: each recorded op knows the user's line that recorded it

_program.enable_persistent_cache()
# module.to(torchacc.device()) swaps parameters in place (torch's future default) instead of making
# new Parameter objects: tied weights stay tied and optimizers built before .to() keep working.
import torch as _torch  # noqa: E402

_torch.__future__.set_swap_module_params_on_conversion(True)
from torchacc.nn import rnn as _rnn  # noqa: E402

_rnn.install()  # RNNs' weak references to their weights would block load_state_dict's swap
_autocast_policy.install()  # torch.autocast('torchacc', ...) works after `import torchacc`
from torchacc import _after_dynamo  # noqa: E402

_after_dynamo.install()  # torch.compile sees torchacc tensors as tensors, whatever the backend


def __getattr__(name):
    # torchacc.compile(step): the whole step as one program (torchacc/dynamo/step.py); imported on
    # first use, as torch._dynamo takes seconds to import
    if name == "compile":
        from torchacc.dynamo import compile_step

        return compile_step
    raise AttributeError(f"module 'torchacc' has no attribute {name!r}")


__all__ = [
    "AsyncLoader",
    "Config",
    "LazyTensor",
    "SyncWarning",
    "accelerate",
    "amp",
    "compile",
    "device",
    "device_hw",
    "dist",
    "fetch_gradients",
    "is_lazy_device",
    "is_lazy_tensor",
    "lazy_device",
    "jax_device",
    "mark_dynamic",
    "mark_step",
    "metrics",
    "ops",
    "platform",
    "scan_hf_layers",
    "sync",
    "syncfree",
    "utils",
    "wait_device_ops",
]
