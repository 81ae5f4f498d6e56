"""Step time of a transformers LLaMA with an attention mask on the lazy device (``ta.accelerate``),
and how many programs each step runs: transformers' mask check reads a pending tensor each
forward (Note [Reads of host-known values] in torchacc/lazy/host_eval.py).

    python benchmarks/hf_mask_reads.py [--steps 30] [--layers 2] [--hidden 256]

Prints one JSON line: seconds per step over the steps after 5 warm-up steps, from the first of
them to the end of the last one's program (a throughput: the host may run ahead of the device),
programs executed per step, host-evaluated reads per step, the last loss.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()
    import transformers

    import torchacc as ta
    from torchacc import metrics

    cfg = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=a.seq,
    )  # fmt: skip
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(a.steps):
        ids = torch.randint(0, 1024, (a.batch, a.seq), generator=g)
        mask = torch.ones(a.batch, a.seq, dtype=torch.long)
        mask[0, a.seq // 2 :] = 0  # one padded row: the mask is really read
        data.append({"input_ids": ids, "attention_mask": mask, "labels": ids})
    model, loader = ta.accelerate(transformers.LlamaForCausalLM(cfg), data, ta.Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss, start = None, None
    for i, batch in enumerate(loader):
        if i == 5:
            ta.sync()
            loss.item()  # the warm-up's programs have finished
            metrics.clear_all()
            start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    ta.sync()
    loss.item()
    steady = a.steps - 5
    seconds = (time.perf_counter() - start) / steady
    execs = (metrics.metric_data("ExecuteTime") or (0,))[0]
    out = {
        "step_s": round(seconds, 4),
        "programs_per_step": round(execs / steady, 2),
        "host_reads_per_step": round((metrics.counter_value("HostEvaluatedRead") or 0) / steady, 2),
        "last_loss": round(float(loss), 5),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
