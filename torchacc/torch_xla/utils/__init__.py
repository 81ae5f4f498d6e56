"""``torch_xla.utils`` on torchacc: the package of ``utils`` (torch_xla's small helpers) and
``checkpoint`` (gradient checkpointing)."""
