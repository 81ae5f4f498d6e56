"""TorchAcc's front door: ``Config`` and its validation, ``accelerate`` (a config translated into
engine calls), ``AsyncLoader``'s bucketing and ``Config.memory.gc`` (exported as
``torchacc.Config``, ``torchacc.accelerate`` ...). Gradient checkpointing and the HF scan helper
are the lazy frontend's (torchacc/lazy/checkpoint.py, scan_hf.py)."""
