"""One torchacc_ops check on XLA:GPU against eager CUDA (run by tests/test_ops_kernels_gpu.py).

    python tests/kernels_gpu_worker.py attention-bf16-causal
    python tests/kernels_gpu_worker.py attention-bf16-gqa
    python tests/kernels_gpu_worker.py attention-fp32
    python tests/kernels_gpu_worker.py cross-entropy-memory
    python tests/kernels_gpu_worker.py attention-bf16-gqa --device cpu   # XLA:CPU vs eager CPU

Prints one ``RESULT {json}`` line, or ``{"skip": reason}`` where JAX has no GPU backend.
Attention cases run forward + backward of ``torchacc_ops.flash_attention`` on the torchacc device
and of eager CUDA SDPA from the same inputs, and report the largest differences and the fused
attention counters; the compiled HLO of the rule alone gives the cuDNN custom calls it contains.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

CASES = {
    # name: (dtype, B, Hq, Hkv, T, D)
    "attention-bf16-causal": (torch.bfloat16, 4, 8, 8, 256, 64),
    "attention-bf16-gqa": (torch.bfloat16, 2, 8, 2, 256, 128),
    "attention-fp32": (torch.float32, 2, 4, 4, 128, 64),
}


def _attention(case, eager):
    import torchacc
    import torchacc_ops
    from torchacc import metrics

    dtype, B, H, Hk, T, D = CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hk, Hk))
    up = torch.randn(B, H, T, D, generator=g)

    def run(device):
        leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
        if device == eager:
            rep = H // Hk
            kk, vv = (t.repeat_interleave(rep, 1) for t in leaves[1:])
            out = torch.nn.functional.scaled_dot_product_attention(
                leaves[0], kk, vv, is_causal=True
            )
        else:
            out = torchacc_ops.flash_attention(*leaves, causal=True)
        (out.float() * up.to(device)).sum().backward()
        if device != eager:
            torchacc.sync()
        return [t.float().cpu() for t in (out, *(x.grad for x in leaves))]

    want = run(eager)
    metrics.clear_all()
    got = run(torchacc.device())
    counters = {n: metrics.counter_value(n) for n in metrics.counter_names() if "Attention" in n}
    diffs = [float((a - e).abs().max() / e.abs().max()) for a, e in zip(got, want)]
    return {"counters": counters, "rel_diffs": diffs, **_hlo_calls(dtype, B, H, Hk, T, D)}


def _hlo_calls(dtype, B, H, Hk, T, D):
    """cuDNN custom calls in the compiled forward + backward of the attention rules alone."""
    import jax
    import jax.numpy as jnp

    from torchacc.lowering import fused_attention as fa

    jd = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    q = jax.ShapeDtypeStruct((B, H, T, D), jd)
    kv = jax.ShapeDtypeStruct((B, Hk, T, D), jd)

    def step(q, k, v):
        out, lse = fa.attention(q, k, v, None, 0.0, True, None, False)
        return fa.attention_backward(out, q, k, v, out, lse, None, None, 0.0, True, None, False)

    text = jax.jit(step).lower(q, kv, kv).compile().as_text()
    calls = [ln for ln in text.splitlines() if 'custom_call_target="__cudnn$fmha' in ln]
    return {
        "fmha_forward_calls": sum("Backward" not in ln for ln in calls),
        "fmha_backward_calls": sum("Backward" in ln for ln in calls),
    }


def _cross_entropy_memory():
    """Scratch bytes XLA:GPU needs for the chunked cross-entropy forward + backward of bf16 GPT-2
    b8 logits (8192 x 50257), and for a plain log_softmax(x.float()) formulation."""
    import jax
    import jax.numpy as jnp

    from torchacc.lowering import fused

    rows, vocab = 8192, 50257
    x = jax.ShapeDtypeStruct((rows, vocab), jnp.bfloat16)
    t = jax.ShapeDtypeStruct((rows,), jnp.int64)

    def chunked(x, t):
        loss, lse = fused.cross_entropy(x, t, -100, 0.0, 1, 0)
        return loss, fused.cross_entropy_backward(jnp.float32(1), x, t, lse, -100, 0.0, 1, 0)

    def plain(x, t):
        def f(x):
            logp = jax.nn.log_softmax(x.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, t[:, None], axis=-1))

        return jax.value_and_grad(f)(x)

    def temp(fn):
        return jax.jit(fn).lower(x, t).compile().memory_analysis().temp_size_in_bytes

    return {
        "chunked_temp": temp(chunked),
        "plain_temp": temp(plain),
        "f32_logits": rows * vocab * 4,
    }


def main():
    case = sys.argv[1]
    eager = sys.argv[3] if sys.argv[2:3] == ["--device"] else "cuda"
    import torchacc

    if eager == "cuda" and (torchacc.platform() != "gpu" or not torch.cuda.is_available()):
        print("RESULT " + json.dumps({"skip": "needs a GPU visible to torch and to JAX"}))
        return
    result = _cross_entropy_memory() if case == "cross-entropy-memory" else _attention(case, eager)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
