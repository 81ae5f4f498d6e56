"""``torch_xla.core.xla_model`` (``xm``) on torchacc.

Devices: each process drives one torchacc device (``xla_device()`` = ``torchacc.device()``).
Ranks: :func:`world_info` reads ``torchacc.distributed`` when that package is present, else the
launcher's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, as torchrun
sets them), else a single process. Collectives: with world size 1 they are identities (times
``scale``), exactly what torch_xla computes on one replica; with more processes they go to
``torchacc.distributed.collectives.<name>`` (same arguments as here), or raise
``NotImplementedError`` naming the op when that module is not available.

The module is split along torch_xla's own sections: ranks and devices (``_xm_devices``),
steps, RNG and memory (``_xm_step``), collectives (``_xm_collectives``) and host data
(``_xm_save``); every name is re-exported here.
"""

from torchacc.torch_xla.core import _xm_collectives, _xm_devices, _xm_save, _xm_step

for _part in (_xm_devices, _xm_step, _xm_collectives, _xm_save):
    globals().update({k: v for k, v in vars(_part).items() if not k.startswith("__")})
del _part
