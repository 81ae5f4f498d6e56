"""One parity run: a model trained 2 SGD steps eagerly and on torchacc, from the same weights.

    python tests/gpu_parity_worker.py MODEL --device cuda   # eager CUDA vs XLA:GPU
    python tests/gpu_parity_worker.py MODEL --device cpu    # eager CPU vs XLA:CPU (smoke run)

fp32 with TF32 off on both sides (torchacc follows torch's flags: Note [float32 precision follows
torch]). Prints one ``RESULT {json}`` line: per-step losses of both, the largest relative gradient
difference after step 1 (see _grad_error), the JAX
platform torchacc ran on, and the ops that fell back to CPU. ``{"skip": reason}`` when the
machine cannot run the comparison (no JAX GPU backend, transformers missing).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

STEPS = 2
LR = 0.05


def _mlp():
    from models import MLP

    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    return MLP(), lambda m, d: F.cross_entropy(m(x.to(d)), y.to(d))


def _cnn_bn():
    from models import CNN

    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 5, (4,))
    return CNN(), lambda m, d: F.cross_entropy(m(x.to(d)), y.to(d))


def _gpt_sdpa():
    from gallery.gpt.model import build_gpt

    model = build_gpt("gpt-tiny")
    x = torch.randint(0, 512, (2, 16))
    y = torch.randint(0, 512, (2, 16))

    def loss(m, d):
        logits = m(x.to(d))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(d).reshape(-1))

    return model, loss


def _hf(kind):
    import transformers as tf

    common = dict(vocab_size=128, attn_implementation="sdpa")
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **common,
        )  # fmt: skip
        model = tf.GPT2LMHeadModel(cfg)
    elif kind == "bert":
        cfg = tf.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            **common,
        )  # fmt: skip
        model = tf.BertForMaskedLM(cfg)
    else:
        cfg = tf.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=32, attention_dropout=0.0, **common,
        )  # fmt: skip
        model = tf.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    return model, lambda m, d: m(input_ids=ids.to(d), labels=ids.to(d)).loss


MODELS = {
    "mlp": _mlp,
    "cnn-bn": _cnn_bn,
    "gpt-sdpa": _gpt_sdpa,
    "hf-gpt2": lambda: _hf("gpt2"),
    "hf-bert": lambda: _hf("bert"),
    "hf-llama": lambda: _hf("llama"),
}


def _train(model, loss_fn, device, sync):
    model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(model, device)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        sync()
        losses.append(float(loss.detach().cpu()))
    return losses, {n: g.cpu() for n, g in grads.items()}


def _grad_error(got, want):
    """Largest max|got - want| / scale over parameters; scale is the parameter's largest eager
    gradient, but at least 1% of the model's largest (a gradient that is analytically zero, like
    an attention key bias's, is pure rounding noise on both sides)."""
    floor = 0.01 * max(float(w.abs().max()) for w in want.values())
    worst, where = 0.0, None
    for name, w in want.items():
        scale = max(float(w.abs().max()), floor) or 1.0
        err = float((got[name] - w).abs().max()) / scale
        if err > worst:
            worst, where = err, name
    return worst, where


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: TF32 off on both sides
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if args.model.startswith("hf-"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            print("RESULT " + json.dumps({"skip": "transformers is not installed"}))
            return
    import torchacc

    platform = torchacc.platform()
    if args.device == "cuda" and platform != "gpu":
        print("RESULT " + json.dumps({"skip": "JAX has no GPU backend (install jax[cuda12/13])"}))
        return
    torch.manual_seed(0)
    model, loss_fn = MODELS[args.model]()
    twin = copy.deepcopy(model)

    def cuda_sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    eager_losses, eager_grads = _train(model, loss_fn, torch.device(args.device), cuda_sync)
    torchacc.metrics.clear_counters()
    acc_losses, acc_grads = _train(twin, loss_fn, torchacc.device(), torchacc.sync)
    err, where = _grad_error(acc_grads, eager_grads)
    result = {
        "platform": platform,
        "eager_losses": eager_losses,
        "torchacc_losses": acc_losses,
        "grad_rel_error": err,
        "grad_worst_param": where,
        "fallbacks": torchacc.metrics.executed_fallback_ops(),
        "compiles": torchacc.metrics.counter_value("UncachedCompile") or 0,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
