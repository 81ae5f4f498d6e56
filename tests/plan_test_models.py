"""A model provider for tests/test_plan.py (``TORCHACC_MODEL_PROVIDERS=plan_test_models``):
``gpt-tiny-4l``, the gallery's gpt-tiny with 4 layers, deep enough for the planner's depth
extrapolation (compiled whole, and at 1 and 2 layers) at a CPU test's cost."""

import dataclasses


def torchacc_models():
    return []  # nothing for the launcher


def torchacc_plan_models():
    from gallery.gpt import model as gm
    from gallery.plan_models import _gpt

    return [_gpt("gpt-tiny-4l", dataclasses.replace(gm.CONFIGS["gpt-tiny"], n_layer=4))]
