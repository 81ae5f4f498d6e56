"""``torchacc.scan_hf_layers``: a transformers model (tiny config, no weights downloaded) with its
decoder layers as one scan, against the unwrapped model (Note [Scanned HF decoder layers])."""

import copy
import os
import sys

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import torchacc
import torchacc.dynamo
from torchacc import metrics
from torchacc.dynamo import aot

sys.path.insert(0, os.path.dirname(__file__))
from compile_counts import new_graphs  # noqa: E402

DEV = torch.device("torchacc")
SCAN = torch.ops.higher_order.scan


def _tiny(kind, depth):
    torch.manual_seed(0)
    shape = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=depth,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    return Qwen2ForCausalLM(Qwen2Config(**shape))


def _close(a, b, tol=1e-5):
    scale = max(1.0, float(b.detach().abs().max()))
    torch.testing.assert_close(a.detach().cpu(), b.detach(), atol=tol * scale, rtol=tol)


def _check_grads(model, ref):
    """The scanned model's gradients, stacked ones included, against the unwrapped model's."""
    stacked = model.model.layers
    for name in stacked.weights()[0]:
        want = torch.stack(
            [dict(layer.named_parameters())[name].grad for layer in ref.model.layers]
        )
        _close(getattr(stacked, name.replace(".", "__")).grad, want)
    own = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        if ".layers." not in name:
            _close(own[name].grad, p.grad)


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def test_scanned_llama_on_the_lazy_device_matches_and_compiles_flat_in_depth():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    programs = {}
    for depth in (1, 2, 4):  # depth 1 first: the small programs of HF's own mask code, once
        ref = _tiny("llama", depth)
        model = torchacc.scan_hf_layers(copy.deepcopy(ref))
        assert len(model.model.layers) == depth
        # transformers' per-layer checkpoint names and values, both ways
        state = model.state_dict()
        assert state.keys() == ref.state_dict().keys()
        for k, v in ref.state_dict().items():
            assert torch.equal(state[k], v), k
        model.load_state_dict(ref.state_dict())
        want = _loss(ref, ids)
        want.backward()
        model.to(DEV)
        metrics.clear_all()
        got = _loss(model, ids.to(DEV))
        got.backward()
        torchacc.sync()
        programs[depth] = new_graphs()
        _close(got, want)
        _check_grads(model, ref)
    assert programs[2] == programs[4] == 1  # the step's one program, whatever the depth


def test_scanned_qwen2_under_torch_compile_is_one_scan_each_way(monkeypatch):
    seen = {}
    real = aot.lower_graph

    def spy(gm, example_inputs, name):
        seen.setdefault(name, []).append(gm)
        return real(gm, example_inputs, name)

    monkeypatch.setattr(aot, "lower_graph", spy)
    torch._dynamo.reset()
    counters.clear()
    metrics.clear_all()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    ref = _tiny("qwen2", 3)
    model = torchacc.scan_hf_layers(copy.deepcopy(ref))
    want = _loss(ref, ids)
    want.backward()
    got = _loss(torch.compile(model, backend="torchacc"), ids)
    got.backward()
    _close(got, want)
    _check_grads(model, ref)
    assert not counters["graph_break"]
    assert metrics.counter_value("DynamoGraph") == 1
    assert metrics.counter_value("DynamoCompile") == 2
    for kind in ("forward", "backward"):
        (gm,) = seen[kind]
        assert sum(1 for n in gm.graph.nodes if n.target is SCAN) == 1
    torch._dynamo.reset()


def test_scanned_llama_in_compile_step_trains_like_the_unwrapped_model():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = _tiny("llama", 2)
    model = torchacc.scan_hf_layers(copy.deepcopy(ref))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))

    @torchacc.dynamo.compile_step
    def step(ids):
        opt.zero_grad()
        loss = _loss(model, ids)
        loss.backward()
        opt.step()
        return loss

    metrics.clear_all()
    for _ in range(3):
        got = step(ids)
        ref_opt.zero_grad()
        want = _loss(ref, ids)
        want.backward()
        ref_opt.step()
        _close(got, want)
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        _close(state[k], v)
    assert metrics.counter_value("StepTrace") == 1
    assert metrics.counter_value("DynamoCompile") == 1
    (prog,) = step._programs.values()
    assert sum(1 for n in prog.lowered.gm.graph.nodes if n.target is SCAN) == 2


def test_scan_hf_layers_refuses_what_it_cannot_scan():
    model = _tiny("llama", 3)
    model.model.layers[2].mlp.up_proj = torch.nn.Linear(32, 48, bias=False)
    with pytest.raises(ValueError, match=r"'mlp.up_proj.weight' of layer 2 has shape \(48, 32\)"):
        torchacc.scan_hf_layers(model)
    model = _tiny("llama", 3)
    model.config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 1 is a 'sliding_attention' layer, layer 0 a"):
        torchacc.scan_hf_layers(model)
    model = torchacc.scan_hf_layers(_tiny("llama", 2))
    assert model.config.use_cache is False
    with pytest.raises(IndexError, match=r"not as layers\[0\]"):
        model.model.layers[0]
    with pytest.raises(ValueError, match="a DynamicCache .*use_cache=False"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match="found no decoder layer list in Linear"):
        torchacc.scan_hf_layers(torch.nn.Linear(2, 2))
