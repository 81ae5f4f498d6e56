"""Horovod-API example (gallery/horovod/train.py)."""
