"""``torch_xla.core`` on torchacc."""
