"""gallery/resnet50: the model, the data pipeline and eager runs through the launcher."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from conftest import eager_device_type
from gallery_harness import check_metrics, load_metrics, needs_processes, run_launcher

from gallery.resnet50 import data as rdata
from gallery.resnet50.model import CONFIGS, RESNET50_NUM_PARAMS, Bottleneck, build, resnet50


def test_resnet50_has_torchvisions_parameter_count():
    with torch.device("meta"):
        model = resnet50()
    n = sum(p.numel() for p in model.parameters())
    assert n == RESNET50_NUM_PARAMS == 25_557_032
    keys = set(model.state_dict())
    # torchvision's names, so its checkpoints load unchanged
    for k in (
        "conv1.weight",
        "bn1.running_mean",
        "layer1.0.downsample.0.weight",
        "layer3.5.conv3.weight",
        "layer4.2.bn3.num_batches_tracked",
        "fc.bias",
    ):
        assert k in keys, k
    assert len(keys) == 320
    assert model.layer2[0].conv2.stride == (2, 2) and model.layer2[0].conv1.stride == (1, 1)


def test_resnet_tiny_has_every_kind_of_resnet50_block():
    """``--model=resnet-tiny`` (the compiler-parity test's model) is ResNet-50's code with fewer,
    narrower blocks: each stage opens with a projection shortcut, stages 2-4 downsample on the 3x3
    convolution, stage 1 also has an identity-shortcut block; and ``build`` gives ResNet-50 itself
    for ``resnet50``."""
    with torch.device("meta"):
        tiny, full = build("resnet-tiny"), build("resnet50")
    assert sum(p.numel() for p in full.parameters()) == RESNET50_NUM_PARAMS
    assert set(full.state_dict()) == set(resnet50().state_dict())
    stages = [tiny.layer1, tiny.layer2, tiny.layer3, tiny.layer4]
    assert [len(s) for s in stages] == list(CONFIGS["resnet-tiny"][0]) == [2, 1, 1, 1]
    assert all(isinstance(b, Bottleneck) for s in stages for b in s)
    assert all(s[0].downsample is not None for s in stages)
    assert tiny.layer1[1].downsample is None  # an identity shortcut
    assert [s[0].conv2.stride for s in stages] == [(1, 1), (2, 2), (2, 2), (2, 2)]
    assert sum(isinstance(m, torch.nn.Conv2d) for m in tiny.modules()) == 20
    assert sum(isinstance(m, torch.nn.Conv2d) for m in full.modules()) == 53


def test_resnet50_small_input_forward():
    torch.manual_seed(0)
    model = resnet50(num_classes=10).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_mock_imagenet_is_deterministic():
    a = rdata.MockImageNet(image_size=32, num_samples=1000, seed=1, pool_size=16)
    b = rdata.MockImageNet(image_size=32, num_samples=1000, seed=1, pool_size=16)
    c = rdata.MockImageNet(image_size=32, num_samples=1000, seed=2, pool_size=16)
    assert torch.equal(a.pool, b.pool) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.pool, c.pool)
    assert len(a) == 1000 and a.pool.dtype == torch.uint8 and a.pool.shape == (16, 3, 32, 32)
    x, y = a.get_batch(torch.tensor([3, 19, 999]))
    assert x.shape == (3, 3, 32, 32) and y.shape == (3,) and y.dtype == torch.int64
    assert torch.equal(x[1], a[19][0]) and int(y[2]) == int(a[999][1])
    assert 0 <= int(a.labels.min()) and int(a.labels.max()) < 1000
    z = rdata.normalize(x)
    assert z.dtype == torch.float32 and abs(float(z.mean())) < 3


def _png_with_filters(img: np.ndarray, filters) -> bytes:
    """Encode (H, W, 3) uint8 with the given PNG filter type per row (the encoder side)."""
    h, w, c = img.shape
    rows = img.reshape(h, w * c).astype(np.int32)
    raw = bytearray()
    prev = np.zeros(w * c, np.int32)
    for y in range(h):
        f = filters[y % len(filters)]
        cur = rows[y]
        left = np.concatenate([np.zeros(c, np.int32), cur[:-c]])
        ul = np.concatenate([np.zeros(c, np.int32), prev[:-c]])
        if f == 0:
            out = cur
        elif f == 1:
            out = cur - left
        elif f == 2:
            out = cur - prev
        elif f == 3:
            out = cur - (left + prev) // 2
        else:
            pred = [
                rdata._paeth(int(a), int(b), int(u)) for a, b, u in zip(left, prev, ul, strict=True)
            ]
            out = cur - np.asarray(pred)
        raw += bytes([f]) + bytes((out & 0xFF).astype(np.uint8))
        prev = cur
    import struct

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + rdata._png_chunk(b"IHDR", ihdr)
        + rdata._png_chunk(b"IDAT", zlib.compress(bytes(raw)))
        + rdata._png_chunk(b"IEND", b"")
    )


def test_image_codecs_round_trip(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (7, 5, 3), dtype=np.uint8)
    rdata.write_png(tmp_path / "a.png", img)
    assert np.array_equal(rdata.read_png(tmp_path / "a.png"), img)
    rdata.write_ppm(tmp_path / "a.ppm", img)
    assert np.array_equal(rdata.read_ppm(tmp_path / "a.ppm"), img)
    (tmp_path / "f.png").write_bytes(_png_with_filters(img, [0, 1, 2, 3, 4]))
    assert np.array_equal(rdata.read_png(tmp_path / "f.png"), img)
    gray = img[..., 0]
    rdata.write_png(tmp_path / "g.png", gray)
    assert np.array_equal(rdata.read_png(tmp_path / "g.png"), np.repeat(gray[..., None], 3, 2))
    np.save(tmp_path / "a.npy", img)
    assert np.array_equal(rdata.load_image(str(tmp_path / "a.npy")), img)


@pytest.mark.parametrize("pillow", [False, True], ids=["builtin-codecs", "pillow"])
def test_prepare_and_image_folder(tmp_path, monkeypatch, pillow):
    if pillow and rdata._PILImage is None:
        pytest.skip("Pillow is not installed")
    if not pillow:
        monkeypatch.setattr(rdata, "_PILImage", None)
    fmt = "jpeg" if pillow else "png"
    argv = ["prepare", "--out", str(tmp_path), "--num-images", "6", "--num-classes", "3"]
    assert rdata.main([*argv, "--image-size", "24", "--format", fmt]) == 0
    assert len(list((tmp_path / "train").glob("*/*.JPEG" if pillow else "*/*.png"))) == 6
    ds = rdata.ImageFolder(str(tmp_path), image_size=16, seed=5)
    assert ds.num_classes == 3 and len(ds) == 6
    assert ds.classes == ["n00000000", "n00000001", "n00000002"]
    x, y = ds[2]  # sorted by class, then file name: two images per class
    assert x.shape == (3, 16, 16) and x.dtype == torch.uint8 and y == 1
    # augmentation depends on (seed, epoch, index) only
    assert torch.equal(ds[2][0], x)
    ds.set_epoch(1)
    fresh = rdata.ImageFolder(str(tmp_path), 16, 5)
    assert any(not torch.equal(ds[i][0], fresh[i][0]) for i in range(6))
    if not pillow:
        with pytest.raises(RuntimeError, match="needs Pillow"):
            rdata.prepare(str(tmp_path / "j"), 2, fmt="jpeg")


def test_prepare_cli_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        rdata.main(["prepare"])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        rdata.main(["prepare", "--out", str(tmp_path), "--num-images", "2", "--num-classes", "5"])
    assert e.value.code == 2


def test_image_folder_rejects_empty_classes(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError, match="no image files"):
        rdata.ImageFolder(str(tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eager_one_process_on_an_image_folder(tmp_path):
    rdata.prepare(str(tmp_path / "data"), num_images=8, num_classes=4, image_size=40, fmt="png")
    out = tmp_path / "m.json"
    p = run_launcher(
        "--nproc_per_node=1",
        "--amp_level=O0",
        "--batch_size=2",
        "--image_size=32",
        "--max_steps=2",
        "--log_interval=1",
        "--workers=1",
        f"--data={tmp_path / 'data'}",
        f"--output={out}",
    )
    assert "[launch] resnet50: eager (DDP), 1 node(s) x 1 process(es)" in p.stdout
    assert "step 2/2 (100%)" in p.stdout and "samples/s" in p.stdout and "ETA" in p.stdout
    assert f"[summary] resnet50 eager x1 {eager_device_type()} O0/fp32 batch 2/proc" in p.stdout
    m = load_metrics(out)
    check_metrics(m, steps=2, world_size=1)
    assert m["config"]["parameters"] == RESNET50_NUM_PARAMS - 2048 * 996 - 996  # 4 classes
    assert m["config"]["steps_per_epoch"] == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_processes(2)
def test_eager_two_processes_mock_data(tmp_path):
    out = tmp_path / "m.json"
    p = run_launcher(
        "--nproc_per_node=2",
        "--amp_level=O0",
        "--batch_size=2",
        "--image_size=32",
        "--max_steps=2",
        "--log_interval=1",
        "--mock_samples=64",
        f"--output={out}",
    )
    assert "1 node(s) x 2 process(es)" in p.stdout
    m = load_metrics(out)
    check_metrics(m, steps=2, world_size=2)
    assert m["config"]["parameters"] == RESNET50_NUM_PARAMS
    assert m["config"]["steps_per_epoch"] == 16  # 64 samples / 2 ranks / batch 2
    assert m["summary"]["amp"] == "O0/fp32"
