"""The auto-parallel context: the job's devices, the parallel mode and its options, and the device
matrix (the one mesh every strategy is laid out on).

See Note [Parallel modes on the sharding engine] in ``torchacc/parallel/__init__.py``.
"""

from __future__ import annotations

import enum
import math

from torchacc.sharding import api as engine


class ParallelMode(str, enum.Enum):
    """MindSpore's parallel modes; the string values are accepted wherever a mode is."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"


_ALIASES = {"semi_auto": ParallelMode.SEMI_AUTO_PARALLEL, "auto": ParallelMode.AUTO_PARALLEL}
_DEFAULTS = {
    "parallel_mode": ParallelMode.STAND_ALONE,
    "gradients_mean": False,
    "parameter_broadcast": False,
    "device_num": None,
    "global_rank": None,
    "device_memory_budget": None,
    "loss_reduction": "mean",
}


class _Context:
    def __init__(self):
        self.values = dict(_DEFAULTS)
        self.frozen_by = None  # what fixed the context: "shard()", "the first training step"
        self.matrix = None  # DeviceMatrix once fixed


_ctx = _Context()


def parse_mode(mode):
    if isinstance(mode, ParallelMode):
        return mode
    if isinstance(mode, str):
        key = mode.strip().lower()
        if key in _ALIASES:
            return _ALIASES[key]
        for m in ParallelMode:
            if key in (m.value, m.name.lower()):
                return m
    names = ", ".join(m.value for m in ParallelMode)
    raise ValueError(f"set_auto_parallel_context: unknown parallel_mode {mode!r}; expected {names}")


def init():
    """Start the job's devices for the parallel modes (MindSpore's ``init()``): switches torchacc to
    SPMD mode, one program over every device of the job. Call it first, before any tensor is put
    on the device."""
    try:
        engine.use_spmd()
    except RuntimeError as e:
        raise RuntimeError(
            "torchacc.parallel.init(): call it at the start of the script, before any tensor is "
            f"moved to the torchacc device ({e})"
        ) from None


def get_group_size():
    """Every device of the job: processes x local devices."""
    return engine.device_count()


def get_rank():
    """This process's first device among every device of the job (the process's rank when each
    process drives one device)."""
    from torchacc.sharding import api as runtime_mesh

    return engine.ordinal(runtime_mesh.local_devices()[0])


def set_auto_parallel_context(**kwargs):
    """Set the parallel mode and its options (see the module Note); only before ``shard()`` and
    before the first training step of a parallelized model."""
    unknown = sorted(set(kwargs) - set(_DEFAULTS))
    if unknown:
        raise ValueError(
            f"set_auto_parallel_context: unknown option(s) {unknown}; expected {sorted(_DEFAULTS)}"
        )
    if _ctx.frozen_by is not None:
        raise RuntimeError(
            f"set_auto_parallel_context({', '.join(sorted(kwargs))}) after {_ctx.frozen_by}: set "
            "the parallel context before shard() and before the first training step (or call "
            "reset_auto_parallel_context() to start a new network)"
        )
    new = dict(_ctx.values)
    for key, value in kwargs.items():
        if key == "parallel_mode":
            value = parse_mode(value)
        elif key in ("gradients_mean", "parameter_broadcast"):
            if not isinstance(value, bool):
                raise ValueError(f"set_auto_parallel_context: {key} must be a bool, got {value!r}")
        elif key == "loss_reduction" and value not in ("mean", "sum"):
            raise ValueError(
                f"set_auto_parallel_context: loss_reduction must be 'mean' or 'sum', got {value!r}"
            )
        elif key == "device_memory_budget" and value is not None and value <= 0:
            raise ValueError(f"set_auto_parallel_context: device_memory_budget={value} <= 0")
        new[key] = value
    if new["parallel_mode"] != ParallelMode.STAND_ALONE:
        init()
        n = get_group_size()
        if new["device_num"] not in (None, n):
            raise ValueError(
                f"set_auto_parallel_context: device_num={new['device_num']} but the job has {n} "
                "devices (processes x local devices); leave device_num=None"
            )
        if new["global_rank"] not in (None, get_rank()):
            raise ValueError(
                f"set_auto_parallel_context: global_rank={new['global_rank']} but this process's "
                f"first device is {get_rank()}; leave global_rank=None"
            )
    _ctx.values = new


def get_auto_parallel_context(key):
    if key not in _DEFAULTS:
        raise ValueError(
            f"get_auto_parallel_context: unknown option {key!r}; expected {sorted(_DEFAULTS)}"
        )
    value = _ctx.values[key]
    if key == "device_num" and value is None and mode() != ParallelMode.STAND_ALONE:
        return get_group_size()
    if key == "global_rank" and value is None and mode() != ParallelMode.STAND_ALONE:
        return get_rank()
    return value


def reset_auto_parallel_context():
    """Back to the defaults (STAND_ALONE); a new network may then set its own context."""
    _ctx.values = dict(_DEFAULTS)
    _ctx.frozen_by = None
    _ctx.matrix = None


def mode():
    return _ctx.values["parallel_mode"]


def option(key):
    return _ctx.values[key]


def uses_strategies():
    return mode() in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL)


def freeze(reason):
    if _ctx.frozen_by is None:
        _ctx.frozen_by = reason


def _primes(n):
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


class DeviceMatrix:
    """The job's devices as one mesh: data-parallel axes ``dp0, dp1, ...`` (major) times
    model-parallel axes ``mp0, mp1, ...`` (minor), one axis per prime factor so that any strategy
    whose slice counts multiply to a divisor of ``mp`` has axes to go on."""

    def __init__(self, n, mp):
        self.n, self.mp, self.dp = n, mp, n // mp
        dp_axes = [(f"dp{i}", p) for i, p in enumerate(_primes(self.dp))]
        mp_axes = [(f"mp{i}", p) for i, p in enumerate(_primes(mp))]
        axes = dp_axes + mp_axes or [("dp0", 1)]
        self.names = tuple(a for a, _ in axes)
        self.sizes = tuple(s for _, s in axes)
        self.dp_axes = tuple(a for a, _ in dp_axes)
        self.mesh = engine.jax_mesh(range(n), self.sizes, self.names)

    def size(self, axes):
        return math.prod(self.sizes[self.names.index(a)] for a in axes)

    def __repr__(self):
        return f"DeviceMatrix(devices={self.n}, data_parallel={self.dp}, model_parallel={self.mp})"


def device_matrix(mp=None):
    """The fixed device matrix; the first call fixes it with ``mp`` model-parallel devices (a
    later model's ``mp`` must divide it)."""
    if _ctx.matrix is None:
        n = get_group_size()
        _ctx.matrix = DeviceMatrix(n, mp or 1)
    elif mp is not None and _ctx.matrix.mp % mp:
        raise ValueError(
            f"torchacc.parallel: the device matrix is already fixed at {_ctx.matrix}; a second "
            f"model needs model_parallel={mp}: call reset_auto_parallel_context() between networks"
        )
    return _ctx.matrix


def data_parallel_degree():
    """How many slices the batch is split into (the device matrix's data-parallel size)."""
    if mode() == ParallelMode.STAND_ALONE:
        return 1
    return device_matrix().dp
