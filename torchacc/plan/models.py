"""The models the planner knows: the registry's (``torchacc/launch_registry.py``
``plan_models()``, filled by the packages that ship models: the checkout's gallery adds its
``--model`` names and the shape-only published configs ``llama-7b``, ``llama-13b``,
``llama-70b``, ``llama3-8b``, ``gpt2-xl``) and a user's ``module:factory``. torchacc never
imports the gallery.

Each resolves to a :class:`ModelSpec`: a factory building the ``nn.Module`` (called under
FakeTensorMode, so no weight is allocated), its kind (token ids -> logits, or images ->
logits), and the transformer shape (layers, heads, width) the planner checks layouts against and
uses for model FLOPs (6N + 12 L d T).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from torchacc import launch_registry


class PlanError(ValueError):
    """A bad planner input (names the value); never an XLA traceback."""


@dataclasses.dataclass
class ModelSpec:
    name: str
    build: Callable  # (n_layer or None, scan_layers) -> nn.Module
    kind: str  # "lm" (token ids -> logits), "vision" (images -> logits), "custom"
    n_layer: int | None = None
    n_head: int | None = None
    n_kv_head: int | None = None
    d_model: int | None = None
    vocab: int | None = None
    max_seq: int | None = None
    image: tuple | None = None  # (C, H, W) for vision models
    classes: int | None = None
    layer_prefix: str | None = None  # parameter name prefix of the repeated blocks


_FIELDS = {f.name for f in dataclasses.fields(ModelSpec)}


def known_models():
    return sorted(launch_registry.plan_models())


def resolve(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``name`` (a registered model or ``module:factory``);
    :class:`PlanError` naming it otherwise."""
    if not isinstance(name, str) or not name:
        raise PlanError(f"model must be a name or 'module:factory', got {name!r}")
    entry = launch_registry.plan_models().get(name)
    if entry is not None:
        unknown = set(entry) - _FIELDS
        if unknown:
            raise PlanError(f"model {name!r}: the registry's entry has unknown fields {unknown}")
        return ModelSpec(**entry)
    if ":" in name:
        return _user(name)
    known = ", ".join(known_models()) or "none registered (no gallery next to this install)"
    raise PlanError(
        f"unknown model {name!r}; known: {known}, or 'module:factory' (a function returning an "
        "nn.Module that maps token ids (B, T) to logits)"
    )


def _user(path):
    mod_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise PlanError(f"model {path!r}: cannot import {attr!r} from {mod_name!r} ({e})") from e
    if not callable(factory):
        raise PlanError(f"model {path!r}: {attr!r} is not callable")

    def build(n_layer=None, scan_layers=False):
        return factory()

    return ModelSpec(path, build, "lm")
