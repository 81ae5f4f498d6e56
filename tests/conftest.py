import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_CACHE = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "torchacc")
os.environ.setdefault("TORCHACC_CACHE_DIR", _CACHE)
