import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCHACC_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "torchacc"))
