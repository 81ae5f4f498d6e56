"""``torch_xla.distributed`` on torchacc: ``xla_backend`` (the ``"xla"`` process group),
``parallel_loader`` (``MpDeviceLoader``), ``xla_multiprocessing``."""
