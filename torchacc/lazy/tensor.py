"""LazyTensor: the torch tensor subclass that lives on the ``torchacc`` device.

A LazyTensor has no data of its own: it points at a Storage (see Note [Values, storages and views]
in graph.py), and a view tensor additionally carries the chain of view ops from that storage. All
ATen ops on it land in ``torchacc.lazy.dispatch`` (which also installs ``__deepcopy__``).
"""

from __future__ import annotations

import torch

from torchacc.lazy.device import DEVICE_TYPE, register_backend

register_backend()
_DEVICE = torch.device(DEVICE_TYPE, 0)
_new_wrapper = torch.Tensor._make_wrapper_subclass


class LazyTensor(torch.Tensor):
    # _st: Storage; _view: tuple of chain entries or None; _vcache: (version, Value) or None;
    # _desc: (shape, stride, dtype, storage_offset)

    @staticmethod
    def __new__(cls, *args, **kwargs):
        raise TypeError("LazyTensor is made by torchacc; use tensor.to(torchacc.device())")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("torchacc.lazy.dispatch not loaded")  # replaced by it

    __torch_function__ = torch._C._disabled_torch_function_impl

    # --- host reads -------------------------------------------------------------------------
    def numpy(self, *, force=False):
        return self.cpu().numpy()

    def tolist(self):
        return self.cpu().tolist()

    def __repr__(self, *, tensor_contents=None):
        text = repr(self.detach().cpu())
        body = text[len("tensor(") : -1] if text.startswith("tensor(") else text
        return f"tensor({body}, device='{self.device}')"

    def __format__(self, format_spec):
        # torch's Tensor.__format__ formats a 0-dim tensor's number only when ``type(self) is
        # Tensor``; a device tensor formats as a plain one does (f"{loss}", format(t, ".4f")): its
        # value is read like ``.item()``, a counted host read (TransferFromDevice).
        if self.dim() == 0:
            return self.detach().item().__format__(format_spec)
        return object.__format__(self, format_spec)

    def __coerce_same_metadata_as_tangent__(self, expected_meta, expected_type=None):
        # torch.compile: AOTAutograd traced the backward with plain fake tensors on this device
        # (Note [torch.compile over torchacc tensors] in torchacc/dynamo/device_tensors.py), so a
        # gradient arriving as a LazyTensor is the plain tensor it expects
        if expected_meta is None and expected_type in (None, torch.Tensor):
            return self
        return None

    def __reduce_ex__(self, protocol):
        # torch.save of a device tensor stores its CPU value (like torch_xla's xm.save)
        return torch.Tensor.__reduce_ex__(self.detach().cpu(), protocol)


def _data_get(self):
    return torch.Tensor.data.__get__(self)


def _data_set(self, new):
    if not isinstance(new, LazyTensor):
        raise TypeError(
            f"torchacc: cannot assign a {new.device} tensor to .data of a {self.device} tensor"
        )
    torch.Tensor.data.__set__(self, new)
    adopt(self, new)


def adopt(t, new):
    """Point LazyTensor ``t`` at ``new``'s storage, view chain and metadata (after torch itself
    gave ``t`` new's sizes and strides: ``.data = new``, in-place view ops)."""
    t._st, t._view, t._vcache, t._desc = new._st, new._view, new._vcache, new._desc


LazyTensor.data = property(_data_get, _data_set)


# torch.optim picks its foreach implementation only for exact Tensor/Parameter types; listing ours
# lets AdamW & co. issue one _foreach_* call per group instead of one dispatch per parameter.
def _allow_foreach():
    import torch.optim.optimizer as optimizer_module
    from torch.utils import _foreach_utils

    for module in (optimizer_module, _foreach_utils):
        supported = getattr(module, "_foreach_supported_types", None)
        if isinstance(supported, list) and LazyTensor not in supported:
            supported.append(LazyTensor)  # (private API: if it moves, the per-parameter path runs)


_allow_foreach()


def make(storage, desc, view=None, vcache=None):
    """A new LazyTensor over ``storage`` (a view when ``view`` is a chain)."""
    shape, stride, dtype, offset = desc
    t = _new_wrapper(LazyTensor, shape, stride, offset, dtype=dtype, device=_DEVICE)
    t._st = storage
    t._view = view
    t._vcache = vcache
    t._desc = desc
    return t
