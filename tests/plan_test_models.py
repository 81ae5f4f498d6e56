"""A model provider for tests/test_plan.py (``TORCHACC_MODEL_PROVIDERS=plan_test_models``):
``gpt-tiny-4l``, the gallery's gpt-tiny with 4 layers, deep enough for the planner's depth
extrapolation (compiled whole, and at 1 and 2 layers) at a CPU test's cost; ``llama-tiny-4l``,
the gallery's LLaMA-tiny with 4 layers and a forward torch.fx can trace (token ids -> logits,
no packed-row branch), so ``ta.dist.PipelineParallel`` can cut it into 2 or 4 stages."""

import dataclasses

import torch


def torchacc_models():
    return []  # nothing for the launcher


def _pipelinable_llama(cfg):
    from gallery.llama import model as lm

    class PipelinableLlama(lm.Llama):
        def forward(self, idx):  # Llama.forward without the checks fx cannot trace
            t = idx.shape[1]
            cos, sin = torch.narrow(self.rope_cos, 0, 0, t), torch.narrow(self.rope_sin, 0, 0, t)
            x = self.embed(idx)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return self.lm_head(self.norm(x))

    def build(n_layer=None, scan_layers=False):
        c = cfg if n_layer is None else dataclasses.replace(cfg, n_layer=n_layer)
        return PipelinableLlama(c, kernels=False, scan_layers=scan_layers)

    return build


def torchacc_plan_models():
    from gallery.gpt import model as gm
    from gallery.llama import model as lm
    from gallery.plan_models import _gpt, _llama

    llama = dict(_llama("llama-tiny-4l", dataclasses.replace(lm.CONFIGS["llama-tiny"], n_layer=4)))
    llama["build"] = _pipelinable_llama(dataclasses.replace(lm.CONFIGS["llama-tiny"], n_layer=4))
    return [_gpt("gpt-tiny-4l", dataclasses.replace(gm.CONFIGS["gpt-tiny"], n_layer=4)), llama]
