"""A LLaMA-style decoder-only transformer: pre-RMSNorm, rotary position embedding (rotate-half),
SwiGLU MLP, grouped-query attention, untied output head.

``kernels=True`` (the gallery's ``--kernel-opt``) computes each of those layers with
``torchacc_ops`` (one fused op each way on the torchacc device; PyTorch's fused kernels or the
same formula eagerly); ``kernels=False`` writes them in plain PyTorch, as HF transformers' LLaMA
does. Both compute the same function. ``llama-1b`` has TinyLlama-1.1B's shape (1,100,048,384
parameters); ``llama-tiny`` is for CPU runs and tests.

Packed batches (padding-free SFT): ``model(idx, position_ids)`` with ``position_ids`` (B, T)
restarting at 0 where each sequence of a row starts: rotary positions restart with them and a
token attends only to earlier tokens of its own sequence, so a row of packed sequences computes
what each sequence would alone (``torchacc_ops.flash_attention(position_ids=...)`` with
``kernels``; the same mask for SDPA without).

``forward`` is ``torch.fx``-traceable for pipeline parallel (cut before blocks ``layers.<i>``)
with the arguments a batch passes: ``position_ids`` left out is Python's ``None`` (trace a
``forward(idx)`` that calls the model, as the launcher does), given it is traced as a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import torchacc_ops
from gallery.gpt.model import check_length, flash_attention

torch.fx.wrap("check_length")  # call nodes under torch.fx in this module too
torch.fx.wrap("flash_attention")


@torch.fx.wrap
def _rms_norm(x, weight, eps):
    """``torchacc_ops``' kernels as one call node each under ``torch.fx`` (see
    ``gallery.gpt.model.flash_attention``)."""
    return torchacc_ops.rms_norm(x, weight, eps)


@torch.fx.wrap
def _apply_rotary_emb(x, cos, sin):
    return torchacc_ops.apply_rotary_emb(x, cos, sin)


@torch.fx.wrap
def _swiglu(gate, up):
    return torchacc_ops.swiglu(gate, up)


__all__ = ["LlamaConfig", "CONFIGS", "Llama", "build_llama"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    block_size: int = 2048  # maximum sequence length
    n_layer: int = 22
    n_head: int = 32
    n_kv_head: int = 4
    n_embd: int = 2048
    intermediate: int = 5632
    rope_base: float = 10000.0
    eps: float = 1e-5


CONFIGS: dict[str, LlamaConfig] = {
    "llama-1b": LlamaConfig(),  # TinyLlama-1.1B's shape
    "llama-tiny": LlamaConfig(
        vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate=176
    ),
}

LLAMA_1B_NUM_PARAMS = 1_100_048_384


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: bool):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels:
            return _rms_norm(x, self.weight, self.eps)
        return _rms_norm_reference(x, self.weight, self.eps)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


@torch.fx.wrap
def _final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, kernels: bool) -> torch.Tensor:
    """:class:`RMSNorm` as one call node under ``torch.fx`` (reading the blocks' output once, as
    uniform pipeline stages ask of the chain's last block)."""
    if kernels:
        return torchacc_ops.rms_norm(x, weight, eps)
    return _rms_norm_reference(x, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kernels: bool) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (T, D/2), or (B, 1, T, D/2) for packed rows."""
    if kernels:
        return _apply_rotary_emb(x, cos, sin)
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: bool):
        super().__init__()
        if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head:
            raise ValueError(
                f"n_embd {cfg.n_embd}, n_head {cfg.n_head}, n_kv_head "
                f"{cfg.n_kv_head}: heads must divide n_embd and n_kv_head n_head"
            )
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.kernels = kernels
        kv = self.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, kv, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x, cos, sin, position_ids=None):
        b, t, c = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin, self.kernels), rotary(k, cos, sin, self.kernels)
        if self.kernels:
            y = flash_attention(q, k, v, causal=True, position_ids=position_ids)
        elif position_ids is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = _packed_causal_mask(position_ids)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: bool):
        super().__init__()
        self.kernels = kernels
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        h = _swiglu(gate, up) if self.kernels else F.silu(gate) * up
        return self.down_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: bool):
        super().__init__()
        self.input_norm = RMSNorm(cfg.n_embd, cfg.eps, kernels)
        self.attn = Attention(cfg, kernels)
        self.post_attn_norm = RMSNorm(cfg.n_embd, cfg.eps, kernels)
        self.mlp = MLP(cfg, kernels)

    def forward(self, x, cos, sin, position_ids=None):
        x = x + self.attn(self.input_norm(x), cos, sin, position_ids)
        return x + self.mlp(self.post_attn_norm(x))


@torch.fx.wrap
def _check_positions(position_ids: torch.Tensor, idx: torch.Tensor) -> None:
    """``ValueError`` unless the position ids have the token ids' shape (one call node under
    ``torch.fx``, like ``check_length``)."""
    if position_ids.shape != idx.shape:
        raise ValueError(
            f"position_ids {tuple(position_ids.shape)} must have the shape of the token ids "
            f"{tuple(idx.shape)}"
        )


@torch.fx.wrap
def _rope_prefix(table: torch.Tensor, t: int) -> torch.Tensor:
    """The rotary table's first ``t`` rows (a call node under ``torch.fx``: ``t`` is traced)."""
    return table[:t]


@torch.fx.wrap
def _packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query i may attend key j: same sequence and j <= i."""
    sequence = (position_ids == 0).cumsum(-1)
    t = position_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    return ((sequence[:, :, None] == sequence[:, None, :]) & causal).unsqueeze(1)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, kernels: bool = False, scan_layers: bool = False):
        super().__init__()
        self.config, self.kernels, self.scan_layers = cfg, kernels, scan_layers
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList(Block(cfg, kernels) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.eps, kernels)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        cos, sin = torchacc_ops.rotary_cos_sin(
            cfg.block_size, cfg.n_embd // cfg.n_head, cfg.rope_base
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if scan_layers:  # the same blocks and values, their weights stacked (one per name)
            from torchacc.torch_xla.experimental.scan_layers import ScannedLayers

            self.layers = ScannedLayers([_Carry(b) for b in self.layers])

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); ``position_ids`` (B, T): packed rows."""
        t = idx.shape[1]
        check_length(t, self.config.block_size)
        packed = () if position_ids is None else (position_ids,)
        if position_ids is None:
            cos, sin = _rope_prefix(self.rope_cos, t), _rope_prefix(self.rope_sin, t)
        else:
            _check_positions(position_ids, idx)
            cos, sin = self.rope_cos[position_ids][:, None], self.rope_sin[position_ids][:, None]
        x = self.embed(idx)
        if self.scan_layers:  # ScannedLayers: one scan on torchacc, the same loop elsewhere
            x = self.layers(x, cos, sin, *packed)[0]
        else:
            for layer in self.layers:
                x = layer(x, cos, sin, *packed)
        return self.lm_head(self.norm(x))

    def chained(self) -> nn.Module:
        """This model (its own modules and parameters) as ``embed``, then ``x = block(x)`` per
        block, then ``norm`` and ``lm_head``: each block computes its rotary tables from ``x``'s
        length (:class:`_Roped`), so the blocks form the one chain that uniform pipeline stages
        cut (``--pp`` with ``--tp``/``--cp``; Note [Uniform pipeline stages] in
        torchacc/pipeline/uniform.py). No packed rows, no ``scan_layers``."""
        if self.scan_layers:
            raise ValueError("Llama.chained: the blocks are one ScannedLayers (scan_layers=True)")
        return _Chained(self)


class _Roped(nn.Module):
    """A block as ``x -> block(x, cos, sin)``: the rotary tables of ``x``'s length computed on
    ``x``'s device with ``torchacc_ops.rotary_cos_sin``'s angles (a block holds no buffer)."""

    def __init__(self, block: Block, head_dim: int, base: float):
        super().__init__()
        self.block, self.head_dim, self.base = block, head_dim, base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        inv = 1.0 / (self.base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
        angles = torch.outer(torch.arange(x.shape[1], dtype=torch.float32, device=x.device), inv)
        return self.block(x, angles.cos(), angles.sin())


class _Chained(nn.Module):
    """:meth:`Llama.chained`'s module."""

    def __init__(self, model: Llama):
        super().__init__()
        cfg = model.config
        self.block_size = cfg.block_size
        self.embed, self.norm, self.lm_head = model.embed, model.norm, model.lm_head
        head_dim = cfg.n_embd // cfg.n_head
        self.layers = nn.ModuleList(_Roped(b, head_dim, cfg.rope_base) for b in model.layers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        check_length(idx.shape[1], self.block_size)
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(_final_norm(x, self.norm.weight, self.norm.eps, self.norm.kernels))


class _Carry(nn.Module):
    """A block as ``(x, cos, sin) -> (block(x, cos, sin), cos, sin)``: a scanned layer reads only
    its carry and its own weights, so the rotary tables (and a packed batch's position ids) ride in
    the carry."""

    def __init__(self, block: Block):
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin, *packed):
        return self.block(x, cos, sin, *packed), cos, sin, *packed


def build_llama(name: str, kernels: bool = False, scan_layers: bool = False) -> Llama:
    """``scan_layers``: the blocks are one ``ScannedLayers`` (torchacc; see ``build_gpt``)."""
    if name not in CONFIGS:
        raise KeyError(f"unknown LLaMA config {name!r}; known: {', '.join(CONFIGS)}")
    return Llama(CONFIGS[name], kernels, scan_layers)
