"""A plain HuggingFace ``Trainer`` script: no torchacc (or torch_xla) code in it.

Eager PyTorch::

    python gallery/hf_trainer/train.py --model gpt2 --output_dir /tmp/run

The same script through torchacc's compiler (transformers/accelerate see torch_xla, which resolves
to ``torchacc.torch_xla``, and put the model on the torchacc device)::

    python -m torchacc.run_torch_xla gallery/hf_trainer/train.py --model gpt2 --output_dir /tmp/run

It trains a model built from a config (``gpt2``: causal LM; ``bert``: sequence classification) on
deterministic synthetic tokens, evaluates, saves checkpoints every ``--save_steps`` steps and the
final model, and writes ``results.json`` (per-step losses, eval loss, torch_xla metrics when
running on torchacc) into ``--output_dir/<model>``. ``--compare DIR`` (on the eager run) reports
the per-step loss differences with the run in ``DIR`` and reloads its saved models in eager
PyTorch. Dropout is off so eager and torchacc runs can be
compared step by step (their random streams differ by design).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
)
from transformers.utils import is_torch_xla_available

SIZES = {
    # tiny: CI; small: a few minutes on a CPU
    "tiny": dict(hidden=32, layers=1, heads=2, vocab=64, seq=16),
    "small": dict(hidden=256, layers=4, heads=4, vocab=4096, seq=128),
}


class SyntheticTokens(Dataset):
    """``n`` fixed random token sequences (and, for classification, a label per sequence)."""

    def __init__(self, n, seq, vocab, seed, labels=False):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = self.ids[:, 0] % 2 if labels else None

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        if self.labels is None:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def build_model(name, size):
    s = SIZES[size]
    if name == "gpt2":
        config = GPT2Config(
            vocab_size=s["vocab"],
            n_positions=s["seq"],
            n_embd=s["hidden"],
            n_layer=s["layers"],
            n_head=s["heads"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return GPT2LMHeadModel(config)
    if name == "bert":
        config = BertConfig(
            vocab_size=s["vocab"],
            hidden_size=s["hidden"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            intermediate_size=4 * s["hidden"],
            max_position_embeddings=s["seq"],
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
        )
        return BertForSequenceClassification(config)
    raise SystemExit(f"--model {name!r}: expected gpt2 or bert")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["gpt2"], choices=["gpt2", "bert"])
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=20)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--save_steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    # adamw_torch_fused is transformers' default on an accelerator; the example names its choice
    p.add_argument("--optim", default="adamw_torch_fused")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compare",
        metavar="DIR",
        help="another run's --output_dir (e.g. torchacc's): report the largest per-step loss "
        "difference, and reload its saved models here and evaluate them",
    )
    return p.parse_args(argv)


def xla_metrics():
    """torch_xla's counters and timings when the run went through torch_xla (torchacc)."""
    if not is_torch_xla_available():
        return None
    import torch_xla.debug.metrics as met

    return {
        "counters": {name: met.counter_value(name) for name in met.counter_names()},
        "compile_time_s": (met.metric_data("CompileTime") or (0, 0.0))[1] / 1e9,  # ns
        "report": met.short_metrics_report(),
    }


def datasets(name, size, steps, batch_size):
    s = SIZES[size]
    labels = name == "bert"
    train = SyntheticTokens(steps * batch_size, s["seq"], s["vocab"], seed=1, labels=labels)
    evaluation = SyntheticTokens(2 * batch_size, s["seq"], s["vocab"], seed=2, labels=labels)
    return train, evaluation


def train_one(name, args, output_dir):
    if is_torch_xla_available():
        import torch_xla.debug.metrics as met

        met.clear_all()  # this model's compiles only
    torch.manual_seed(args.seed)
    model = build_model(name, args.size)
    train, evaluation = datasets(name, args.size, args.max_steps, args.batch_size)
    training_args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        optim=args.optim,
        logging_steps=1,
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    eval_metrics = trainer.evaluate()
    trainer.save_model(os.path.join(output_dir, "final"))
    results = {
        "model": name,
        "device": str(training_args.device),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval_loss": eval_metrics["eval_loss"],
        "xla_metrics": xla_metrics(),
    }
    with open(os.path.join(output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps({k: v for k, v in results.items() if k != "xla_metrics"}))
    if results["xla_metrics"]:
        print(results["xla_metrics"]["report"])
    return results


def compare(name, args, ours, other_dir):
    """Loss differences with another run, and that run's saved model evaluated here."""
    with open(os.path.join(other_dir, "results.json")) as f:
        other = json.load(f)
    model_class = GPT2LMHeadModel if name == "gpt2" else BertForSequenceClassification
    reloaded = model_class.from_pretrained(os.path.join(other_dir, "final"))
    _, evaluation = datasets(name, args.size, args.max_steps, args.batch_size)
    trainer = Trainer(
        model=reloaded,
        args=TrainingArguments(
            output_dir=os.path.join(args.output_dir, "reload", name),
            per_device_eval_batch_size=args.batch_size,
            report_to=[],
            disable_tqdm=True,
        ),
        eval_dataset=evaluation,
    )
    out = {
        "model": name,
        "other_device": other["device"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(ours["losses"], other["losses"])),
        "eval_loss_diff": abs(ours["eval_loss"] - other["eval_loss"]),
        "reloaded_eval_loss": trainer.evaluate()["eval_loss"],
        "other_eval_loss": other["eval_loss"],
        "other_xla_metrics": other["xla_metrics"],
    }
    with open(os.path.join(args.output_dir, name, "compare.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: v for k, v in out.items() if k != "other_xla_metrics"}))
    return out


def main(argv=None):
    args = parse_args(argv)
    results = {}
    for name in args.model:
        ours = train_one(name, args, os.path.join(args.output_dir, name))
        if args.compare:
            compare(name, args, ours, os.path.join(args.compare, name))
        results[name] = ours
    return results


if __name__ == "__main__":
    main()
