"""``torch_xla._internal.tpu`` on torchacc: there is no TPU (torchacc runs on GPUs and CPUs
through JAX), so there are no TPU chips and no TPU version."""


def num_available_chips():
    return 0


def num_available_devices():
    return 0


def version():
    """torch_xla raises when the host has no TPU; so does torchacc."""
    raise EnvironmentError("torch_xla._internal.tpu.version(): this host has no TPU (torchacc)")
