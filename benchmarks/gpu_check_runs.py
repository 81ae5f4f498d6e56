"""What ``benchmarks/gpu_check.py`` runs: the sides (launcher flags per mode), the workloads
(model and sizes on the GPU and for ``--smoke``) and the runs in priority order with their
expected cost and cap."""

from __future__ import annotations

SIDES = {  # side -> launcher flags
    "eager": [],
    "torch.compile": ["--torch_compile"],
    "torchacc": ["--compiler-opt"],
    "torchacc-trace-once": ["--compiler-opt", "--compile_mode=dynamo"],
}


# workload -> (launcher model, sizes) for the GPU and for --smoke
WORKLOADS = {
    "resnet50": {
        "gpu": [
            "--model",
            "resnet50",
            "--batch_size",
            "128",
            "--image_size",
            "224",
            "--mock_samples",
            "4096",
        ],
        "smoke": [
            "--model",
            "resnet-tiny",
            "--batch_size",
            "4",
            "--image_size",
            "32",
            "--mock_samples",
            "256",
        ],
        "label": "ResNet-50 AMP b128 224²",
    },
    "gpt2": {
        "gpu": ["--model", "gpt2", "--batch_size", "8", "--seq_len", "1024"],
        "smoke": ["--model", "gpt-tiny", "--batch_size", "8", "--seq_len", "64"],
        "label": "GPT-2 124M b8 s1024",
    },
    "llama-1b": {
        "gpu": ["--model", "llama-1b", "--batch_size", "4", "--seq_len", "2048"],
        "smoke": ["--model", "llama-tiny", "--batch_size", "4", "--seq_len", "64"],
        "label": "LLaMA-1B (TinyLlama shape) b4 s2048",
    },
}


# (id, workload, side, fsdp, expected seconds on one H100 incl. process start, cap seconds)
# in priority order: GPT-2's three sides, ResNet-50 eager and torchacc, the issue-40 FSDP check,
# LLaMA-1B FSDP, then the rest. The expected costs are guesses (no GPU run yet): a run is skipped
# only when the budget left is below its guess, and its timeout is min(cap, budget left).
RUNS = [
    ("gpt2.eager", "gpt2", "eager", False, 25, 120),
    ("gpt2.torchacc", "gpt2", "torchacc", False, 55, 180),
    ("gpt2.torch.compile", "gpt2", "torch.compile", False, 60, 180),
    ("resnet50.eager", "resnet50", "eager", False, 30, 120),
    ("resnet50.torchacc", "resnet50", "torchacc", False, 60, 200),
    ("gpt2-fsdp.torchacc", "gpt2", "torchacc", True, 55, 180),
    ("llama-1b-fsdp.torchacc", "llama-1b", "torchacc", True, 90, 240),
    ("llama-1b-fsdp.eager", "llama-1b", "eager", True, 35, 150),
    ("resnet50.torch.compile", "resnet50", "torch.compile", False, 80, 200),
    ("gpt2.torchacc-trace-once", "gpt2", "torchacc-trace-once", False, 55, 180),
    ("gpt2-fsdp.eager", "gpt2", "eager", True, 25, 120),
]
