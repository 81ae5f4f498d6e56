"""A GPT-2-style decoder-only transformer (pre-LayerNorm, learned positions, tied embeddings).

Attention is ``F.scaled_dot_product_attention(..., is_causal=True)`` so the eager baseline uses
PyTorch's fused kernels (flash / memory-efficient on CUDA) and the compiler path sees one op.
With ``kernels=True`` (the gallery's ``--kernel-opt``) attention is
``torchacc_ops.flash_attention`` (the same call on both paths; on the torchacc device one fused op,
cuDNN on XLA:GPU). With ``scan_layers=True`` (the launcher's ``--scan-layers``) the blocks are
one ``ScannedLayers`` of torchacc (stacked weights, one scan on the torchacc device).
The fused QKV projection ``c_attn`` is laid out head-major (Megatron's layout), so a
tensor-parallel split of its rows is a split of the heads. ``forward`` is ``torch.fx``-traceable
(pipeline parallel cuts it into stages before blocks ``h.<i>``). Configurations are chosen by name;
``gpt2`` is the 124M model (124,439,808 parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torchacc_ops

__all__ = ["GPTConfig", "CONFIGS", "GPT", "build_gpt", "num_params"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    block_size: int = 1024  # maximum sequence length
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


CONFIGS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(),  # 124M
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),  # 774M
    # Small configurations for CPU runs and tests.
    "gpt-mini": GPTConfig(vocab_size=8192, block_size=256, n_layer=4, n_head=4, n_embd=256),
    "gpt-tiny": GPTConfig(vocab_size=512, block_size=64, n_layer=2, n_head=2, n_embd=64),
}

GPT2_NUM_PARAMS = 124_439_808


@torch.fx.wrap
def flash_attention(q, k, v, **kwargs):
    """``torchacc_ops.flash_attention``, looked up at each call (context parallel swaps it in
    the model's forward); one call node under ``torch.fx``, whose tracing cannot enter it."""
    return torchacc_ops.flash_attention(q, k, v, **kwargs)


@torch.fx.wrap
def check_length(t: int, block_size: int) -> None:
    """``ValueError`` for a sequence longer than the block size. Under ``torch.fx`` (the pipeline's
    splitter traces ``forward``) this is one call node run with the real length, not Python
    control flow on a traced value; eagerly it is the same check as inline."""
    if t > block_size:
        raise ValueError(f"sequence length {t} > block_size {block_size}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, kernels: bool = False):
        super().__init__()
        self.kernels = kernels
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        # c_attn's output features are head-major, (head, q|k|v, head_dim) as Megatron stores
        # a fused QKV: a contiguous split of them over tensor-parallel devices gives each device
        # whole heads' q, k and v (torchacc/sharding/recipes.py)
        qkv = self.c_attn(x).view(b, t, self.n_head, 3, c // self.n_head).transpose(1, 2)
        q, k, v = qkv.unbind(3)
        p = self.dropout if self.training else 0.0
        if self.kernels:
            y = flash_attention(q, k, v, causal=True, dropout_p=p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, kernels: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, kernels)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, kernels: bool = False, scan_layers: bool = False):
        super().__init__()
        self.config, self.kernels, self.scan_layers = cfg, kernels, scan_layers
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, kernels) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2

        self.apply(self._init_weights)
        # GPT-2: scale the init of the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        if scan_layers:  # the same blocks and values, their weights stacked (one per name)
            from torchacc.torch_xla.experimental.scan_layers import ScannedLayers

            self.h = ScannedLayers(self.h)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab)."""
        t = idx.shape[1]
        check_length(t, self.config.block_size)
        pos = torch.arange(t, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        if self.scan_layers:
            x = self.h(x)  # ScannedLayers: one scan on torchacc, the same loop elsewhere
        else:
            for block in self.h:
                x = block(x)
        return self.lm_head(self.ln_f(x))


def build_gpt(name: str, kernels: bool = False, scan_layers: bool = False, **overrides) -> GPT:
    """``scan_layers``: the blocks are one ``ScannedLayers`` (torchacc): their weights stacked,
    one ``lax.scan`` each way on the torchacc device (compiled once whatever the depth, and the
    optimizer sees one parameter per block weight name), the same plain loop elsewhere."""
    if name not in CONFIGS:
        raise KeyError(f"unknown GPT config {name!r}; known: {', '.join(CONFIGS)}")
    cfg = CONFIGS[name]
    if overrides:
        cfg = GPTConfig(**{**cfg.__dict__, **overrides})
    return GPT(cfg, kernels, scan_layers)


def num_params(model: nn.Module) -> int:
    """Unique parameters (the tied embedding / lm_head weight counts once)."""
    return sum(p.numel() for p in model.parameters())
