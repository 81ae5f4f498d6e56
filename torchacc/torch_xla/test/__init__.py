"""``torch_xla.test`` on torchacc: ``test_utils`` (the helpers torch_xla's example scripts use)."""
