"""``torchacc.Config`` and ``accelerate()``'s checks: TorchAcc's sections, names and defaults, a
typo'd field refused at assignment, and every bad setting a ``ValueError`` naming its field before
anything happens (no device, no patch, no process group)."""

import pytest
import torch
import torch.nn as nn

import torchacc as ta


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.fc(x)


def test_sections_fields_and_defaults_are_torchaccs():
    c = ta.Config()
    assert c.backend == "lazy"
    assert (c.compute.fp16, c.compute.bf16, c.compute.acc_scaled_dot_attn) == (False, False, False)
    assert (c.memory.gc, c.memory.gc_cls, c.memory.gc_cnt) == (False, None, None)
    d = c.dataloader
    assert (d.buckets, d.max_length, d.num_buckets, d.pad_value_dict) == (None, None, None, None)
    assert c.dist.dp.size is None
    assert [getattr(c.dist, n).size for n in ("fsdp", "tp", "pp", "sp")] == [1, 1, 1, 1]
    assert c.dist.fsdp.wrap_layer_cls == set()
    assert (c.dist.fsdp.flatten_parameters, c.dist.fsdp.sync_module_states) == (True, False)
    assert c.dist.topology == ["dp", "fsdp", "pp", "tp"]
    c.validate()
    assert ta.AsyncLoader([], "cpu", max_length=64).bucketing.pad_value_dict == {
        "input_ids": 0,
        "attention_mask": 0,
        "labels": -100,
    }


@pytest.mark.parametrize(
    "section,name", [("compute", "bf61"), ("memory", "gc_class"), ("dist", "ddp"), (None, "bakend")]
)
def test_a_typo_is_an_error_at_assignment(section, name):
    c = ta.Config()
    target = c if section is None else getattr(c, section)
    with pytest.raises(AttributeError, match=name):
        setattr(target, name, True)


def _set(config, path, value):
    *parents, last = path.split(".")
    target = config
    for p in parents:
        target = getattr(target, p)
    setattr(target, last, value)


BAD = [
    ({"compute.fp16": True, "compute.bf16": True}, "compute.fp16 and Config.compute.bf16"),
    ({"backend": "cuda"}, "Config.backend"),
    ({"compute.bf16": 1}, "Config.compute.bf16"),
    ({"dist.dp.size": 0}, "Config.dist.dp.size"),
    ({"dist.fsdp.size": 0}, "Config.dist.fsdp.size"),
    ({"dist.tp.size": -1}, "Config.dist.tp.size"),
    ({"dist.pp.size": 0}, "Config.dist.pp.size"),
    ({"dist.sp.size": 0}, "Config.dist.sp.size"),
    ({"dist.topology": ["dp", "dp"]}, "Config.dist.topology"),
    ({"memory.gc": True}, "Config.memory.gc_cls"),
    ({"memory.gc_cnt": 0}, "Config.memory.gc_cnt"),
    ({"dataloader.buckets": [32, 0]}, "Config.dataloader.buckets"),
    ({"dataloader.buckets": [32, 64, 32]}, "duplicate"),
    ({"dataloader.buckets": []}, "Config.dataloader.buckets"),
    ({"dataloader.num_buckets": 4}, "Config.dataloader.max_length"),
    ({"dataloader.max_length": 0}, "Config.dataloader.max_length"),
    ({"dataloader.pad_value_dict": [0]}, "Config.dataloader.pad_value_dict"),
]
# only checkable against the model or the job
BAD_FOR_MODEL = [
    ({"memory.gc": True, "memory.gc_cls": {"Blok"}}, "Config.memory.gc_cls names ['Blok']"),
    ({"dist.fsdp.wrap_layer_cls": {"Layer"}}, "Config.dist.fsdp.wrap_layer_cls"),
    ({"dist.dp.size": 2}, "must equal the world size 1"),
    ({"dist.fsdp.size": 2}, "does not divide the world size 1"),
]


@pytest.mark.parametrize("settings,message", BAD, ids=[m for _, m in BAD])
def test_validate_names_the_bad_field(settings, message):
    c = ta.Config()
    for path, value in settings.items():
        _set(c, path, value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        c.validate()


@pytest.mark.parametrize(
    "settings,message", BAD + BAD_FOR_MODEL, ids=[m for _, m in BAD + BAD_FOR_MODEL]
)
def test_accelerate_refuses_before_anything_happens(settings, message):
    c = ta.Config()
    for path, value in settings.items():
        _set(c, path, value)
    model = nn.Sequential(Block(), Block())
    forwards = [m.forward for m in model.modules()]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ta.accelerate(model, [{"input_ids": torch.zeros(1, 2)}], c)
    assert all(p.device.type == "cpu" for p in model.parameters()), "nothing moved"
    assert [m.forward for m in model.modules()] == forwards, "nothing checkpointed or wrapped"
    assert torch.nn.functional.scaled_dot_product_attention is sdpa
    assert not torch.distributed.is_initialized(), "no process group started"


@pytest.mark.parametrize(
    "path,backend,message",
    [
        ("dist.pp.size", "eager", "Config.dist.pp.size = 2: pipeline"),  # lazy: supported
        ("dist.sp.size", "eager", "Config.dist.sp.size = 2: sequence"),
        ("dist.tp.size", "eager", "Config.dist.tp.size = 2 on backend 'eager'"),
    ],
)
def test_sizes_not_supported_yet_name_the_field(monkeypatch, path, backend, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # the sizes must multiply to the world size first
    c = ta.Config(backend=backend)
    _set(c, path, 2)
    model = Block()
    with pytest.raises(NotImplementedError, match=message):
        ta.accelerate(model, config=c)
    assert model.fc.weight.device.type == "cpu"


def test_mark_dynamic_points_to_bucketing():
    with pytest.raises(NotImplementedError, match="bucketing"):
        ta.mark_dynamic(torch.zeros(2, 3), 1)
