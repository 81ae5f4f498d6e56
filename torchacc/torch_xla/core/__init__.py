"""``torch_xla.core`` on torchacc: the package of ``xla_model`` (devices, ``mark_step``,
collectives, save), ``functions``, ``xla_builder``, ``xla_op_registry`` and ``xla_env_vars``."""
