"""``torch_xla.utils.utils`` on torchacc (the parts training scripts use)."""

from __future__ import annotations


class SampleGenerator:
    """Yields ``data`` ``sample_count`` times: the fake-data loader of torch_xla's examples.

    ``iter()`` restarts it, ``len()`` is ``sample_count``.
    """

    def __init__(self, data, sample_count):
        self._data = data
        self._sample_count = sample_count
        self._count = 0

    def __iter__(self):
        return SampleGenerator(self._data, self._sample_count)

    def __len__(self):
        return self._sample_count

    def __next__(self):
        return self.next()

    def next(self):
        if self._count >= self._sample_count:
            raise StopIteration
        self._count += 1
        return self._data


def as_list(t):
    return t if isinstance(t, (tuple, list)) else [t]


def getenv_as(name, dtype, defval=None):
    import os

    env = os.environ.get(name, None)
    if env is None:
        return defval
    if dtype is bool:
        return env.lower() in ("1", "true", "yes", "y", "on")
    return dtype(env)


def check_env_flag(name, default=""):
    """Whether the environment variable ``name`` (else ``default``) is 1/true/yes/on."""
    import os

    return os.environ.get(name, default).strip().upper() in ("1", "Y", "YES", "TRUE", "ON")
