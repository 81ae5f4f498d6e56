"""The models the planner knows: gallery models by name, shape-only public configs, and a user's
``module:factory``.

Each resolves to a :class:`ModelSpec`: a factory building the ``nn.Module`` (called under
FakeTensorMode, so no weight is allocated), how to make one batch of abstract inputs, the loss,
and the transformer shape (layers, heads, width) the planner checks layouts against and uses for
model FLOPs (6N + 12 L d T). The shape-only configs (``llama-7b``, ``llama-13b``, ``llama-70b``,
``llama3-8b``, ``gpt2-xl``) are the gallery's LLaMA / GPT-2 modules at the published shapes
(LLaMA / Llama 2 / Llama 3.1 papers and model cards; GPT-2 paper), no download.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable


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


# published shapes (vocab, layers, heads, kv heads, width, MLP width, context)
_LLAMA_SHAPES = {
    # LLaMA (Touvron et al. 2023) table 2 / Llama 2 7B, 13B: MHA; Llama 2 70B: GQA with 8 kv heads
    "llama-7b": (32000, 32, 32, 32, 4096, 11008, 4096),
    "llama-13b": (32000, 40, 40, 40, 5120, 13824, 4096),
    "llama-70b": (32000, 80, 64, 8, 8192, 28672, 4096),
    # Llama 3.1 8B model card (config.json): vocab 128256, GQA 8, rope theta 500000
    "llama3-8b": (128256, 32, 32, 8, 4096, 14336, 131072),
}
_GPT_SHAPES = {"gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}  # GPT-2 paper, 1558M

SHAPE_ONLY = sorted([*_LLAMA_SHAPES, *_GPT_SHAPES])


def _gallery_models():
    """Gallery model name -> its family ("gpt", "llama", "resnet"), from the gallery's own
    config tables (the launcher's --model names)."""
    out = {}
    for family in ("gpt", "llama", "resnet50"):
        try:
            mod = importlib.import_module(f"gallery.{family}.model")
        except ImportError:
            continue
        out.update(dict.fromkeys(getattr(mod, "CONFIGS", {}), family))
    return out


def known_models():
    return sorted(set(_gallery_models()) | set(SHAPE_ONLY))


def resolve(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``name`` (a gallery model, a shape-only config or
    ``module:factory``); :class:`PlanError` naming it otherwise."""
    if not isinstance(name, str) or not name:
        raise PlanError(f"model must be a name or 'module:factory', got {name!r}")
    if name in _LLAMA_SHAPES:
        return _llama(name, _LLAMA_SHAPES[name])
    if name in _GPT_SHAPES:
        return _gpt(name, _GPT_SHAPES[name])
    gallery = _gallery_models()
    if name in gallery:
        family = gallery[name]
        return (
            _resnet(name)
            if family == "resnet50"
            else {"gpt": _gpt, "llama": _llama}[family](name, None)
        )
    if ":" in name:
        return _user(name)
    raise PlanError(
        f"unknown model {name!r}; known: {', '.join(known_models())}, or 'module:factory' "
        "(a function returning an nn.Module that maps token ids (B, T) to logits)"
    )


def _gallery(family):
    try:
        return importlib.import_module(f"gallery.{family}.model")
    except ImportError as e:
        raise PlanError(
            f"the gallery's {family} model is not importable ({e}); run from the torchacc "
            "repository or put it on PYTHONPATH (gallery/ is not part of the installed package)"
        ) from e


def _llama(name, shape):
    lm = _gallery("llama")

    if shape is None:
        cfg = lm.CONFIGS[name]
    else:
        v, L, h, kv, d, ffn, ctx = shape
        cfg = lm.LlamaConfig(
            vocab_size=v, block_size=ctx, n_layer=L, n_head=h, n_kv_head=kv, n_embd=d,
            intermediate=ffn, rope_base=500000.0 if name.startswith("llama3") else 10000.0,
        )  # fmt: skip

    def build(n_layer=None, scan_layers=False):
        c = cfg if n_layer is None else dataclasses.replace(cfg, n_layer=n_layer)
        return lm.Llama(c, kernels=True, scan_layers=scan_layers)

    return ModelSpec(
        name, build, "lm", cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.vocab_size,
        cfg.block_size, layer_prefix="layers.",
    )  # fmt: skip


def _gpt(name, overrides):
    gm = _gallery("gpt")

    cfg = gm.CONFIGS["gpt2"] if overrides else gm.CONFIGS[name]
    if overrides:
        cfg = gm.GPTConfig(**{**cfg.__dict__, **overrides})

    def build(n_layer=None, scan_layers=False):
        c = cfg if n_layer is None else gm.GPTConfig(**{**cfg.__dict__, "n_layer": n_layer})
        return gm.GPT(c, kernels=True, scan_layers=scan_layers)

    return ModelSpec(
        name, build, "lm", cfg.n_layer, cfg.n_head, cfg.n_head, cfg.n_embd, cfg.vocab_size,
        cfg.block_size, layer_prefix="h.",
    )  # fmt: skip


def _resnet(name):
    rm = _gallery("resnet50")

    def build(n_layer=None, scan_layers=False):
        return rm.build(name)

    size = 32 if name == "resnet-tiny" else 224
    return ModelSpec(name, build, "vision", image=(3, size, size), classes=1000)


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
