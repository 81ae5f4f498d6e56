"""The launcher's model registry: ``--model NAME`` -> the worker that trains it.

The launcher knows no model itself. Packages that ship models fill this registry, and the launcher
reads it when it parses ``--model``:

* a *provider* module, imported by name, whose ``torchacc_models()`` returns a list of dicts
  (the keyword arguments of :func:`register`). The providers are the module names in
  ``TORCHACC_MODEL_PROVIDERS`` (comma-separated), the ``torchacc.models`` entry points of the
  installed packages, and ``gallery.registry`` (the checkout's gallery) when it is importable.
  A provider imports nothing heavy: the launcher stays fast and the eager path free of JAX;
* :func:`register`, called before :func:`torchacc.launch.main` by a program of one's own.

Besides registered names, ``--model MODULE:FUNCTION`` names a training entry of one's own: each
worker calls ``FUNCTION(argv)`` of ``MODULE`` with the training flags (the contract of the
gallery's ``gallery/<model>/main.py:main``), and a script path given after the launcher's flags
runs as a script (``python -m torchacc.launch --nproc_per_node 2 train.py --its-flags``).

Standard library only: the launcher loads this file without importing the ``torchacc`` package.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

__all__ = [
    "Model",
    "register",
    "models",
    "lookup",
    "flag_error",
    "MODELS",
    "PROVIDER_ENV",
    "register_plan",
    "plan_models",
]

PROVIDER_ENV = "TORCHACC_MODEL_PROVIDERS"
_DEFAULT_PROVIDERS = ("gallery.registry",)  # the checkout's gallery, when importable
_ENTRY_POINT_GROUP = "torchacc.models"


@dataclass(frozen=True)
class Model:
    """One ``--model`` name.

    ``worker``: the module each worker runs (``python -m worker``; it parses the training flags
    itself), or ``MODULE:FUNCTION`` called with the training flags' argv. ``inputs``: ``"images"``
    (``--data DIR``, ``--image_size``) or ``"tokens"`` (``--seq_len``, mock tokens only).
    ``block_size``: a callable giving the longest ``--seq_len`` (None: unknown, the worker checks).
    ``resolve_checkpoint``: ``(path, warn) -> (file, state)``, raising ``ValueError`` with one
    line for a ``--resume`` that is no checkpoint of this trainer (None: the worker checks).
    ``shards``: whether ``--fsdp`` applies. ``axes_error``: ``(tp, cp, seq_len) -> str | None``,
    why this model cannot split ``tp`` ways by Megatron pairs or its ``seq_len`` tokens
    (None: the model's block size) ``cp`` ways (one line), or None (no callable: the worker
    checks).
    """

    name: str
    worker: str
    inputs: str = "tokens"
    block_size: Callable[[], int | None] | None = None
    resolve_checkpoint: Callable | None = None
    shards: bool = True
    axes_error: Callable[[int, int, int | None], str | None] | None = None


_registered: dict[str, Model] = {}
_loaded = False


def register(name: str, worker: str, **fields) -> Model:
    """Add (or replace) ``--model name``; ``fields`` are :class:`Model`'s other fields."""
    if fields.get("inputs", "tokens") not in ("images", "tokens"):
        raise ValueError(f"register({name!r}): inputs must be 'images' or 'tokens'")
    model = Model(name=name, worker=worker, **fields)
    _registered[name] = model
    return model


def _provider_names() -> list[str]:
    names = [n.strip() for n in os.environ.get(PROVIDER_ENV, "").split(",") if n.strip()]
    try:
        from importlib.metadata import entry_points

        names += [ep.value for ep in entry_points(group=_ENTRY_POINT_GROUP)]
    except Exception:  # no metadata (a bare checkout): the other providers still count
        pass
    return names + [n for n in _DEFAULT_PROVIDERS if n not in names]


def _load_providers() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    explicit = {n.strip() for n in os.environ.get(PROVIDER_ENV, "").split(",") if n.strip()}
    for name in _provider_names():
        try:
            module = importlib.import_module(name.partition(":")[0])
        except ImportError:
            if name in explicit:
                raise ImportError(f"{PROVIDER_ENV}: cannot import provider {name!r}") from None
            continue  # e.g. no gallery next to a pip install
        for entry in module.torchacc_models():
            entry = dict(entry)
            if entry["name"] not in _registered:  # register() beats a provider
                register(entry.pop("name"), entry.pop("worker"), **entry)


def models() -> dict[str, Model]:
    """Every registered model, by name (the providers are imported on the first call)."""
    _load_providers()
    return dict(_registered)


# The planner's models (``torchacc.plan``): a provider may also define ``torchacc_plan_models()``,
# a list of dicts with ``name``, ``build`` (``(n_layer or None, scan_layers) -> nn.Module``) and
# the shape the planner reads (``kind``, ``n_layer``, ``n_head``, ``n_kv_head``, ``d_model``,
# ``vocab``, ``max_seq``, ``image``, ``classes``, ``layer_prefix``: torchacc/plan/models.py's
# ModelSpec). It is called only when a plan needs a model (it may import torch).
_plan_registered: dict[str, dict] = {}
_plan_loaded = False


def register_plan(name: str, build: Callable, **fields) -> dict:
    """Add (or replace) the planner's model ``name``: ``build(n_layer, scan_layers)`` returns
    the ``nn.Module``; ``fields`` are the rest of a provider's entry (comment above)."""
    if not callable(build):
        raise ValueError(f"register_plan({name!r}): build must be callable")
    entry = dict(fields, name=name, build=build)
    _plan_registered[name] = entry
    return entry


def plan_models() -> dict[str, dict]:
    """Every model the planner can size, by name: :func:`register_plan` entries and the
    providers' ``torchacc_plan_models()`` (the providers are imported on the first call)."""
    global _plan_loaded
    if not _plan_loaded:
        _plan_loaded = True
        explicit = {n.strip() for n in os.environ.get(PROVIDER_ENV, "").split(",") if n.strip()}
        for name in _provider_names():
            try:
                module = importlib.import_module(name.partition(":")[0])
                entries = getattr(module, "torchacc_plan_models", lambda: [])()
            except ImportError:
                if name in explicit:
                    raise
                continue
            for entry in entries:
                entry = dict(entry)
                if entry["name"] not in _plan_registered:  # register_plan() beats a provider
                    register_plan(entry.pop("name"), entry.pop("build"), **entry)
    return dict(_plan_registered)


def is_entry(name: str) -> bool:
    """``MODULE:FUNCTION``: a training entry of one's own, not a registered name."""
    module, sep, func = name.partition(":")
    return bool(sep and module and func.isidentifier())


def lookup(name: str) -> Model:
    """The model of ``--model name``: a registered one, or a ``MODULE:FUNCTION`` entry."""
    found = models().get(name)
    if found is not None:
        return found
    if is_entry(name):
        return Model(name=name, worker=name, shards=True)
    raise KeyError(name)


def _block_size(model: Model) -> int | None:
    if model.block_size is None:
        return None
    try:
        return model.block_size()
    except ImportError:  # the model's package is not importable from here: the worker checks it
        return None


def axes_flag_error(args) -> str | None:
    """The launcher's ``--tp`` / ``--cp`` / ``--pp`` (one line), or None: each is an axis of the
    SPMD mesh of ``--fsdp --compiler-opt`` (data x fsdp x tp x cp, or dp x fsdp x pp) with sizes
    the model can split; ``--pp`` with ``--tp``/``--cp`` runs uniform stages on a (dp, pp, sp,
    tp) mesh, without fsdp (``--mesh DATA,1``) and, with ``--cp``, 1F1B only; ``--pp`` does not
    compose with ``--scan-layers`` or the sharded checkpoints in the launcher yet (one line
    naming the flags)."""
    pp = getattr(args, "pp", 1)
    if pp == 1 and (
        getattr(args, "num_micro_batches", None) is not None
        or getattr(args, "pp_schedule", "1F1B") != "1F1B"
    ):
        return "--num_micro_batches / --pp_schedule apply to pipeline parallel: add --pp N (N > 1)"
    axes = [f"--{n} {getattr(args, n)}" for n in ("tp", "cp", "pp") if getattr(args, n, 1) > 1]
    if not axes:
        return None
    if not (args.fsdp and args.compiler_opt):
        return f"{' '.join(axes)} needs --fsdp --compiler-opt (axes of the sharded step's mesh)"
    if pp > 1:
        inner = " ".join(a for a in axes if not a.startswith("--pp"))
        if inner and args.mesh is not None and args.mesh.split(",")[-1].strip() != "1":
            return (
                f"--pp {pp} {inner} --mesh {args.mesh}: fsdp inside the pipeline's stages does "
                "not compose with --tp/--cp (uniform stages); the devices left go to dp "
                "(--mesh DATA,1)"
            )
        if getattr(args, "cp", 1) > 1 and getattr(args, "pp_schedule", "1F1B") != "1F1B":
            return (
                f"--pp {pp} --cp {args.cp} --pp_schedule {args.pp_schedule}: context parallel "
                "inside the stages runs the 1F1B schedule only; use --pp_schedule 1F1B"
            )
        if getattr(args, "nnodes", 1) > 1 or getattr(args, "nproc_per_node", 1) not in (1, "cpu"):
            return (
                f"--pp {pp}: one process drives every stage for now (--nproc_per_node=1 on one "
                "node; on a CPU set CPU_NUM_DEVICES=N)"
            )
        if args.scan_layers:
            return (
                f"--pp {pp} --scan-layers: the pipeline cuts between blocks, which one scanned "
                "layer has none of; drop --scan-layers"
            )
        if args.save_dir or args.resume:
            flag = "--save_dir" if args.save_dir else "--resume"
            return (
                f"--pp {pp} {flag}: checkpoints of the pipeline's packed stage parameters are not "
                "wired into the launcher yet"
            )
    if args.script is None:
        return axes_error(args.model, args.tp, args.cp, args.seq_len)
    return None


def axes_error(name: str, tp: int, cp: int, seq_len: int | None) -> str | None:
    """Why ``--model name`` cannot run with ``--tp``/``--cp`` (one line), or None (unknown to
    the registry: the worker checks)."""
    try:
        model = lookup(name)
    except KeyError:
        return None
    if model.axes_error is None:
        return None
    try:
        return model.axes_error(tp, cp, seq_len)
    except ImportError:  # the model's package is not importable from here: the worker checks it
        return None


def flag_error(name: str, seq_len: int | None, data: str) -> str | None:
    """Why ``--model name`` cannot run with ``--seq_len``/``--data`` (one line), or None: an
    unknown name (the registry may be empty: no gallery next to an install), a ``--seq_len``
    for images or past the block size, a ``--data`` directory for a model of mock tokens."""
    try:
        model = lookup(name)
    except KeyError:
        known = ", ".join(sorted(models())) or "none"
        return (
            f"--model {name}: no such model here (registered: {known}); give MODULE:FUNCTION "
            "or a script path"
        )
    if model.inputs == "images" and seq_len is not None:
        return f"--seq_len applies to the gpt models, not {name}"
    if model.inputs == "tokens":
        if data != "mock":
            return f"--data: {name} trains on mock tokens only; use --data mock"
        block = _block_size(model) if seq_len is not None else None
        if block is not None and seq_len > block:
            return f"--seq_len {seq_len} > {name}'s block size {block}"
    return None


class _Names(Mapping):
    """``--model`` name -> worker (a read-only view; the providers load on first use)."""

    def __getitem__(self, name: str) -> str:
        return models()[name].worker

    def __iter__(self) -> Iterator[str]:
        return iter(models())

    def __len__(self) -> int:
        return len(models())


MODELS: Mapping[str, str] = _Names()
