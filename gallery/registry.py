"""The gallery's models for the launcher's registry (``torchacc/launch_registry.py``).

The launcher imports this module by name (a provider) and calls :func:`torchacc_models`; the
planner (``torchacc.plan``) calls :func:`torchacc_plan_models`. It imports nothing at module
level: the model configurations (and torch) load only when a value needs them (a ``--seq_len``
bound, a ``--resume`` check, a plan).
"""

from __future__ import annotations

__all__ = ["torchacc_models", "torchacc_plan_models"]

# --model name -> worker module. GPT and LLaMA names are the configurations in
# gallery/gpt/model.py and gallery/llama/model.py (tests check they agree).
_RESNETS = ("resnet50", "resnet-tiny")  # resnet-tiny: ResNet-50's blocks at CI size
_GPTS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt-mini", "gpt-tiny")
_LLAMAS = ("llama-1b", "llama-tiny")


def _block_size(module: str, name: str):
    def read() -> int | None:
        import importlib

        configs = importlib.import_module(module).CONFIGS
        cfg = configs.get(name)
        return None if cfg is None else cfg.block_size

    return read


def _axes_error(module: str, name: str):
    def check(tp: int, cp: int, seq_len: int | None) -> str | None:
        import importlib

        cfg = importlib.import_module(module).CONFIGS.get(name)
        if cfg is None:
            return None
        heads = cfg.n_head
        kv = getattr(cfg, "n_kv_head", heads)
        hidden = getattr(cfg, "intermediate", 4 * cfg.n_embd)
        sizes = (("attention heads", heads), ("key/value heads", kv), ("MLP hidden", hidden))
        for what, n in sizes:
            if n % tp:
                return f"--tp {tp} does not divide {name}'s {n} {what}"
        seq = seq_len or cfg.block_size
        # Ulysses when the heads on a device split cp ways, else the causal (zig-zag) ring
        # (Note [Context parallel for a model] in torchacc/context_parallel/model.py)
        ulysses = heads // tp % cp == 0 and kv // tp % cp == 0
        chunks = cp if ulysses else 2 * cp
        if cp > 1 and seq % chunks:
            how = "cp (Ulysses)" if ulysses else "2 * cp (the causal ring's zig-zag halves)"
            return f"--cp {cp}: the sequence of {seq} tokens is not divisible by {how} = {chunks}"
        return None

    return check


def _resolve_checkpoint(path: str, warn=None):
    """The gallery trainer's checkpoint (``gallery/common/checkpoint.py``): one safe load."""
    from gallery.common.checkpoint import resolve_checkpoint

    return resolve_checkpoint(path, warn=warn)  # CheckpointError is a ValueError


def torchacc_models() -> list[dict]:
    out = [
        dict(
            name=n,
            worker="gallery.resnet50.main",
            inputs="images",
            shards=False,
            resolve_checkpoint=_resolve_checkpoint,
        )
        for n in _RESNETS
    ]
    for names, worker, configs in (
        (_GPTS, "gallery.gpt.main", "gallery.gpt.model"),
        (_LLAMAS, "gallery.llama.main", "gallery.llama.model"),
    ):
        out += [
            dict(
                name=n,
                worker=worker,
                block_size=_block_size(configs, n),
                resolve_checkpoint=_resolve_checkpoint,
                axes_error=_axes_error(configs, n),
            )
            for n in names
        ]
    return out


def torchacc_plan_models() -> list[dict]:
    """The planner's models (``gallery/plan_models.py``): the gallery's configurations and the
    shape-only published ones; imports torch and the model modules, so only the planner calls it."""
    from gallery.plan_models import plan_models

    return plan_models()
