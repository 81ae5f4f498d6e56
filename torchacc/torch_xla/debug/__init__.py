"""``torch_xla.debug`` on torchacc."""
