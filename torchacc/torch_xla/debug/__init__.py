"""``torch_xla.debug`` on torchacc: the package of ``metrics`` (counters, metrics report) and
``profiler`` (traces, ``StepTrace``)."""
