"""The gallery's models as the planner (``torchacc.plan``) sizes them: every ``--model`` name of
the gallery plus shape-only published configurations, each a dict of the planner's model fields.

``gallery/registry.py``'s ``torchacc_plan_models`` returns :func:`plan_models`; torchacc finds it
through its registry (``torchacc/launch_registry.py``, ``plan_models()``) and never imports the
gallery itself. A dict holds ``name``, ``build`` (``(n_layer or None, scan_layers) ->
nn.Module``, called under ``FakeTensorMode``: no weight is allocated), ``kind`` (``"lm"``: token
ids (B, T) -> logits; ``"vision"``: images (B, C, H, W) -> logits), and the shape the planner
checks layouts against and counts model FLOPs with (layers, heads, kv heads, width, vocab,
context; the image and classes of a vision model; the parameter prefix of the repeated blocks).

The shape-only configurations (``llama-7b``, ``llama-13b``, ``llama-70b``, ``llama3-8b``,
``gpt2-xl``) are the gallery's LLaMA / GPT-2 modules at the published shapes (LLaMA / Llama 2 /
Llama 3.1 papers and model cards; GPT-2 paper), no download.
"""

from __future__ import annotations

import dataclasses

# published shapes (vocab, layers, heads, kv heads, width, MLP width, context)
LLAMA_SHAPES = {
    # LLaMA (Touvron et al. 2023) table 2 / Llama 2 7B, 13B: MHA; Llama 2 70B: GQA with 8 kv heads
    "llama-7b": (32000, 32, 32, 32, 4096, 11008, 4096),
    "llama-13b": (32000, 40, 40, 40, 5120, 13824, 4096),
    "llama-70b": (32000, 80, 64, 8, 8192, 28672, 4096),
    # Llama 3.1 8B model card (config.json): vocab 128256, GQA 8, rope theta 500000
    "llama3-8b": (128256, 32, 32, 8, 4096, 14336, 131072),
}
GPT_SHAPES = {"gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600)}  # GPT-2 paper, 1558M


def _llama(name, cfg):
    from gallery.llama import model as lm

    def build(n_layer=None, scan_layers=False):
        c = cfg if n_layer is None else dataclasses.replace(cfg, n_layer=n_layer)
        return lm.Llama(c, kernels=True, scan_layers=scan_layers)

    return dict(
        name=name, build=build, kind="lm", n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_kv_head=cfg.n_kv_head, d_model=cfg.n_embd, vocab=cfg.vocab_size,
        max_seq=cfg.block_size, layer_prefix="layers.",
    )  # fmt: skip


def _gpt(name, cfg):
    from gallery.gpt import model as gm

    def build(n_layer=None, scan_layers=False):
        c = cfg if n_layer is None else dataclasses.replace(cfg, n_layer=n_layer)
        return gm.GPT(c, kernels=True, scan_layers=scan_layers)

    return dict(
        name=name, build=build, kind="lm", n_layer=cfg.n_layer, n_head=cfg.n_head,
        n_kv_head=cfg.n_head, d_model=cfg.n_embd, vocab=cfg.vocab_size,
        max_seq=cfg.block_size, layer_prefix="h.",
    )  # fmt: skip


def _resnet(name, size):
    from gallery.resnet50 import model as rm

    def build(n_layer=None, scan_layers=False):
        return rm.build(name)

    return dict(name=name, build=build, kind="vision", image=(3, size, size), classes=1000)


def plan_models():
    """The planner's entries (module docstring) for the gallery's models and the published
    shapes."""
    from gallery.gpt import model as gm
    from gallery.llama import model as lm
    from gallery.resnet50 import model as rm

    out = [_llama(n, c) for n, c in lm.CONFIGS.items()]
    out += [_gpt(n, c) for n, c in gm.CONFIGS.items()]
    out += [_resnet(n, 32 if n == "resnet-tiny" else 224) for n in rm.CONFIGS]
    for name, (v, L, h, kv, d, ffn, ctx) in LLAMA_SHAPES.items():
        cfg = lm.LlamaConfig(
            vocab_size=v, block_size=ctx, n_layer=L, n_head=h, n_kv_head=kv, n_embd=d,
            intermediate=ffn, rope_base=500000.0 if name.startswith("llama3") else 10000.0,
        )  # fmt: skip
        out.append(_llama(name, cfg))
    for name, overrides in GPT_SHAPES.items():
        out.append(_gpt(name, dataclasses.replace(gm.CONFIGS["gpt2"], **overrides)))
    return out
