"""``torch_xla.utils`` on torchacc."""
