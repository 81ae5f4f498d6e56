"""LLaMA-style decoder (RMSNorm, rotary embedding, SwiGLU, grouped-query attention)."""
