"""TorchAcc's front door: ``Config``, ``accelerate``, ``AsyncLoader`` with bucketing, and
gradient checkpointing that saves memory (exported as ``torchacc.Config``, ``torchacc.accelerate``
...)."""
