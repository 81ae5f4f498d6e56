"""``torch_xla._internal`` on torchacc: only ``tpu`` (what torch_xla's tests import to skip TPU
cases); torch_xla's other internals belong to its C++ runtime."""
