"""``torchacc.Config``: TorchAcc's nested configuration (sections, field names and defaults).

::

    config = ta.Config()
    config.compute.bf16 = True
    config.memory.gc = True
    config.memory.gc_cls = {"Block"}
    config.dataloader.buckets = [32, 64, 128]
    config.validate()                  # ValueError naming the field on bad input

Every section is a slotted dataclass, so a typo'd field (``config.compute.bf61 = True``) is an
``AttributeError`` at assignment, as in TorchAcc. ``validate()`` checks types and values field by
field and raises ``ValueError`` naming the field (``compute.fp16``, ``dist.fsdp.size``...);
checks that need the model or the world size (``gc_cls`` naming a class of the model, the parallel
sizes' product) are ``validate_for(model, world_size)``, which ``accelerate()`` calls first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKENDS = ("lazy", "eager")
TOPOLOGY = ("dp", "fsdp", "pp", "tp")  # TorchAcc's default order
TOPOLOGY_NAMES = ("dp", "fsdp", "pp", "sp", "tp")  # "sp" may be placed too (default: before tp)
DEFAULT_PAD_VALUES = {"input_ids": 0, "attention_mask": 0, "labels": -100}


def _bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"Config.{name} must be a bool, got {value!r}")


def _size(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Config.{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"Config.{name} must be >= 1, got {value}")


def _names(name, value, allow_none=False):
    if value is None and allow_none:
        return
    if not isinstance(value, (set, frozenset, list, tuple)) or not all(
        isinstance(v, str) for v in value
    ):
        raise ValueError(f"Config.{name} must be a set of class names (str), got {value!r}")


@dataclass(slots=True)
class ComputeConfig:
    """``fp16``/``bf16``: the model's forward under autocast of that dtype (fp32 master weights).
    ``acc_scaled_dot_attn``: ``F.scaled_dot_product_attention`` runs as torchacc_ops'
    flash_attention inside the accelerated model's forward."""

    fp16: bool = False
    bf16: bool = False
    acc_scaled_dot_attn: bool = False

    def validate(self):
        for name in ("fp16", "bf16", "acc_scaled_dot_attn"):
            _bool(f"compute.{name}", getattr(self, name))
        if self.fp16 and self.bf16:
            raise ValueError("Config.compute.fp16 and Config.compute.bf16 cannot both be True")


@dataclass(slots=True)
class MemoryConfig:
    """``gc``: gradient checkpointing of the submodules whose class name is in ``gc_cls``
    (all of them, or the first ``gc_cnt`` in module order)."""

    gc: bool = False
    gc_cls: set | None = None
    gc_cnt: int | None = None

    def validate(self):
        _bool("memory.gc", self.gc)
        _names("memory.gc_cls", self.gc_cls, allow_none=True)
        if self.gc_cnt is not None and (
            isinstance(self.gc_cnt, bool) or not isinstance(self.gc_cnt, int) or self.gc_cnt < 1
        ):
            raise ValueError(
                f"Config.memory.gc_cnt must be an int >= 1 or None, got {self.gc_cnt!r}"
            )
        if self.gc and not self.gc_cls:
            raise ValueError(
                "Config.memory.gc is True but Config.memory.gc_cls names no module class to "
                "checkpoint (e.g. gc_cls={'Block'})"
            )


@dataclass(slots=True)
class DataLoaderConfig:
    """Bucketing (torchacc.accel.loader): ``buckets`` (lengths) or ``max_length`` with
    ``num_buckets`` uniform buckets; ``pad_value_dict`` maps each batch key to its pad value."""

    buckets: list | None = None
    max_length: int | None = None
    num_buckets: int | None = None
    pad_value_dict: dict | None = None

    def validate(self):
        if self.buckets is not None:
            if not isinstance(self.buckets, (list, tuple)) or not self.buckets:
                raise ValueError(
                    f"Config.dataloader.buckets must be a non-empty list of lengths, got "
                    f"{self.buckets!r}"
                )
            for b in self.buckets:
                if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                    raise ValueError(
                        f"Config.dataloader.buckets must hold positive ints, got {b!r} in "
                        f"{list(self.buckets)}"
                    )
            if len(set(self.buckets)) != len(self.buckets):
                raise ValueError(
                    f"Config.dataloader.buckets holds a duplicate length: {list(self.buckets)}"
                )
        _size("dataloader.max_length", self.max_length, allow_none=True)
        _size("dataloader.num_buckets", self.num_buckets, allow_none=True)
        if self.num_buckets is not None and self.max_length is None and self.buckets is None:
            raise ValueError(
                "Config.dataloader.num_buckets is set but Config.dataloader.max_length is not: "
                "uniform buckets are max_length // num_buckets * (i + 1)"
            )
        if self.pad_value_dict is not None and (
            not isinstance(self.pad_value_dict, dict)
            or not all(isinstance(k, str) for k in self.pad_value_dict)
        ):
            raise ValueError(
                f"Config.dataloader.pad_value_dict must map batch keys (str) to pad values, got "
                f"{self.pad_value_dict!r}"
            )

    def bucketing(self):
        """Whether batches are bucketed."""
        return self.buckets is not None or self.max_length is not None


@dataclass(slots=True)
class DPConfig:
    """Data parallel; ``size=None`` is the world size divided by the other sizes."""

    size: int | None = None


@dataclass(slots=True)
class TPConfig:
    size: int = 1


PP_SCHEDULES = ("1F1B", "PipeDreamFlush", "GPipe")


@dataclass(slots=True)
class PPConfig:
    """Pipeline parallel (``ta.dist.PipelineParallel``; torchacc/pipeline/): ``size`` stages,
    cut *before* each of ``split_points`` (module names or modules; ``size - 1`` of them);
    each batch is split into ``num_micro_batches``; ``schedule`` is ``"1F1B"`` (TorchAcc's
    PipeDreamFlush, the default) or ``"GPipe"``. ``input_names`` / ``broadcast_loss`` are
    TorchAcc's (the loss is the same on every device here)."""

    size: int = 1
    num_micro_batches: int = 1
    input_names: list | None = None
    split_points: list = field(default_factory=list)
    broadcast_loss: bool = True
    schedule: str = "1F1B"

    def validate(self):
        _size("dist.pp.size", self.size)
        _size("dist.pp.num_micro_batches", self.num_micro_batches)
        _bool("dist.pp.broadcast_loss", self.broadcast_loss)
        if not isinstance(self.split_points, (list, tuple)):
            raise ValueError(
                f"Config.dist.pp.split_points must be a list of module names or modules, got "
                f"{self.split_points!r}"
            )
        if str(getattr(self.schedule, "name", self.schedule)).lower() not in {
            s.lower() for s in PP_SCHEDULES
        }:
            raise ValueError(
                f"Config.dist.pp.schedule must be one of {list(PP_SCHEDULES)}, got "
                f"{self.schedule!r}"
            )


@dataclass(slots=True)
class SPConfig:
    """Sequence (context) parallel: the sequence split over ``size`` devices, attention as
    Ulysses or ring attention (``algorithm``: "auto", "ulysses", "ring"; Note [Context parallel
    for a model] in torchacc/context_parallel/model.py). Backend 'lazy' only."""

    size: int = 1
    algorithm: str = "auto"


@dataclass(slots=True)
class FSDPConfig:
    """Fully sharded data parallel: ``wrap_layer_cls`` names the classes sharded as units."""

    size: int = 1
    wrap_layer_cls: set = field(default_factory=set)
    flatten_parameters: bool = True
    sync_module_states: bool = False


@dataclass(slots=True)
class DistConfig:
    dp: DPConfig = field(default_factory=DPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    pp: PPConfig = field(default_factory=PPConfig)
    sp: SPConfig = field(default_factory=SPConfig)
    topology: list = field(default_factory=lambda: list(TOPOLOGY))

    def validate(self):
        _size("dist.dp.size", self.dp.size, allow_none=True)
        for name in ("fsdp", "tp", "pp", "sp"):
            _size(f"dist.{name}.size", getattr(self, name).size)
        if self.sp.algorithm not in ("auto", "ulysses", "ring"):
            raise ValueError(
                f"Config.dist.sp.algorithm must be 'auto', 'ulysses' or 'ring', got "
                f"{self.sp.algorithm!r}"
            )
        self.pp.validate()
        _names("dist.fsdp.wrap_layer_cls", self.fsdp.wrap_layer_cls)
        _bool("dist.fsdp.flatten_parameters", self.fsdp.flatten_parameters)
        _bool("dist.fsdp.sync_module_states", self.fsdp.sync_module_states)
        topology = self.topology
        if (
            not isinstance(topology, (list, tuple))
            or len(set(topology)) != len(topology)
            or any(t not in TOPOLOGY_NAMES for t in topology)
        ):
            raise ValueError(
                f"Config.dist.topology must list distinct names among {list(TOPOLOGY_NAMES)}, got "
                f"{topology!r}"
            )

    def sizes(self, world_size):
        """(dp, fsdp, tp, pp, sp) with ``dp.size=None`` resolved against ``world_size``."""
        rest = self.fsdp.size * self.tp.size * self.pp.size * self.sp.size
        dp = self.dp.size
        if dp is None:
            if world_size % rest:
                raise ValueError(
                    f"Config.dist: fsdp.size * tp.size * pp.size * sp.size = {rest} does not "
                    f"divide the world size {world_size}"
                )
            dp = world_size // rest
        if dp * rest != world_size:
            raise ValueError(
                f"Config.dist: dp.size * fsdp.size * tp.size * pp.size * sp.size = {dp * rest} "
                f"(dp {dp}, fsdp {self.fsdp.size}, tp {self.tp.size}, pp {self.pp.size}, sp "
                f"{self.sp.size}) must equal the world size {world_size}"
            )
        return dp, self.fsdp.size, self.tp.size, self.pp.size, self.sp.size


def _class_names(model):
    return {type(m).__name__ for m in model.modules()}


@dataclass(slots=True)
class Config:
    """TorchAcc's configuration: ``backend`` (``'lazy'``: the torchacc device; ``'eager'``: plain
    PyTorch) and the ``compute``, ``memory``, ``dataloader`` and ``dist`` sections."""

    backend: str = "lazy"
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def validate(self):
        """Check every field on its own; ``ValueError`` naming the first bad one."""
        if self.backend not in BACKENDS:
            raise ValueError(
                f"Config.backend must be one of {list(BACKENDS)}, got {self.backend!r}"
            )
        sections = (
            ("compute", ComputeConfig),
            ("memory", MemoryConfig),
            ("dataloader", DataLoaderConfig),
            ("dist", DistConfig),
        )
        for name, cls in sections:
            if not isinstance(getattr(self, name), cls):
                raise ValueError(
                    f"Config.{name} must be a {cls.__name__}, got {type(getattr(self, name))}"
                )
            getattr(self, name).validate()

    def validate_for(self, model, world_size):
        """``validate()`` plus the checks that need the model and the job: the class names in
        ``memory.gc_cls`` and ``dist.fsdp.wrap_layer_cls`` exist in ``model``, the parallel
        sizes multiply to ``world_size``. Returns the resolved (dp, fsdp, tp, pp, sp)."""
        self.validate()
        present = _class_names(model)
        for name, wanted in (
            ("memory.gc_cls", self.memory.gc_cls if self.memory.gc else None),
            ("dist.fsdp.wrap_layer_cls", self.dist.fsdp.wrap_layer_cls),
        ):
            missing = sorted(set(wanted or ()) - present)
            if missing:
                raise ValueError(
                    f"Config.{name} names {missing}, which is no class of the model's modules "
                    f"(it has {sorted(present)})"
                )
        return self.dist.sizes(world_size)

    def is_lazy_backend(self):
        return self.backend == "lazy"

    def is_eager_backend(self):
        return self.backend == "eager"
