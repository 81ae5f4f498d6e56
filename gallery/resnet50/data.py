"""Input data for the ResNet-50 recipe.

* ``MockImageNet`` (the default, ``--data mock``): an ImageNet-1k-like set held in memory: a pool
  of 256 deterministic uint8 images with labels in [0, 1000), indexed up to 1,281,167 samples
  (the size of ImageNet-1k train). Batches are gathered from the pool, so the input pipeline
  costs next to nothing and the benchmark measures the training step.
* ``ImageFolder`` (``--data DIR``): any ``DIR/<class>/<image>`` or ``DIR/train/<class>/<image>``
  tree, such as real ImageNet or the mock tree ``prepare`` writes. Images are decoded, randomly
  resized-cropped and flipped (deterministically from (seed, epoch, index), so resumed runs see
  the same pixels) by DataLoader workers; sharding is ``DistributedSampler``.
* ``prepare`` writes a mock ImageFolder tree of real image files::

      python -m gallery.resnet50.data prepare --out DIR --num-images N

Both sets yield uint8 ``(3, H, W)`` images; :func:`normalize` turns a batch into normalized
float on the device (fewer bytes to copy, and the same on both paths).

Decoding uses Pillow when it is installed (any format, JPEG included). Without it the built-in
decoders read PNG (8-bit gray/RGB/RGBA/palette, non-interlaced), binary PPM (P6) and ``.npy``;
``prepare`` writes PNG files by default then (JPEG needs Pillow).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
import zlib

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = [
    "IMAGENET_TRAIN_SIZE",
    "MockImageNet",
    "ImageFolder",
    "normalize",
    "load_image",
    "write_png",
    "read_png",
    "write_ppm",
    "read_ppm",
    "prepare",
    "main",
]

IMAGENET_TRAIN_SIZE = 1_281_167
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMG_EXTENSIONS = (".png", ".jpg", ".jpeg", ".ppm", ".npy", ".bmp", ".webp", ".tif", ".tiff")

try:  # optional: any format, JPEG included
    from PIL import Image as _PILImage
except ImportError:  # pragma: no cover - depends on the environment
    _PILImage = None


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 (N, 3, H, W) on any device -> float32, ImageNet mean/std normalized."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, 3, 1, 1) * 255.0
    inv_std = 1.0 / (torch.tensor(IMAGENET_STD, device=images.device).view(1, 3, 1, 1) * 255.0)
    return (images.float() - mean) * inv_std


# ----------------------------------------------------------------------------- mock data
class MockImageNet(Dataset):
    """Deterministic in-memory ImageNet-like data (see module docstring)."""

    def __init__(
        self,
        image_size: int = 224,
        num_samples: int = IMAGENET_TRAIN_SIZE,
        num_classes: int = 1000,
        seed: int = 0,
        pool_size: int = 256,
    ):
        self.num_samples = num_samples
        self.num_classes = num_classes
        g = torch.Generator().manual_seed(seed)
        pool_size = min(pool_size, num_samples)
        self.labels = torch.randint(0, num_classes, (pool_size,), generator=g)
        # Smooth class-tinted images (a coarse random field upsampled) plus noise: learnable,
        # image-like statistics, and cheap to make.
        coarse = torch.rand(pool_size, 3, 8, 8, generator=g)
        tint = torch.rand(num_classes, 3, 1, 1, generator=g)[self.labels]
        img = F.interpolate(coarse, size=(image_size, image_size), mode="bilinear")
        img = 0.6 * img + 0.4 * tint + 0.08 * torch.randn(img.shape, generator=g)
        self.pool = (img.clamp(0, 1) * 255).round().to(torch.uint8).contiguous()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        j = index % len(self.pool)
        return self.pool[j], self.labels[j]

    def get_batch(self, indices: torch.Tensor):
        j = indices % len(self.pool)
        return self.pool.index_select(0, j), self.labels.index_select(0, j)


# ----------------------------------------------------------------------------- image codecs
def _png_chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def write_png(path: str, image: np.ndarray, level: int = 6) -> None:
    """Write an (H, W, 3) or (H, W) uint8 array as a PNG (filter type 0, zlib)."""
    image = np.ascontiguousarray(image, dtype=np.uint8)
    h, w = image.shape[:2]
    color = 2 if image.ndim == 3 else 0
    rows = image.reshape(h, -1)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", zlib.compress(raw, level))
        + _png_chunk(b"IEND", b"")
    )
    with open(path, "wb") as f:
        f.write(data)


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def read_png(path: str) -> np.ndarray:
    """Decode an 8-bit, non-interlaced PNG to (H, W, 3) uint8 RGB (alpha dropped)."""
    with open(path, "rb") as f:
        blob = f.read()
    if blob[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, palette, header = 8, [], None, None
    while pos < len(blob):
        (length,) = struct.unpack(">I", blob[pos : pos + 4])
        kind = blob[pos + 4 : pos + 8]
        data = blob[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", data)
        elif kind == b"PLTE":
            palette = np.frombuffer(data, np.uint8).reshape(-1, 3)
        elif kind == b"IDAT":
            idat.append(data)
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError(f"{path}: PNG without IHDR")
    w, h, depth, color, _, _, interlace = header
    channels = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}.get(color)
    if depth != 8 or interlace != 0 or channels is None:
        raise ValueError(
            f"{path}: PNG with bit depth {depth}, color type {color}, interlace {interlace} "
            "is not supported by the built-in decoder; install Pillow"
        )
    stride = w * channels
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), np.uint8).reshape(h, stride + 1)
    filters, data = raw[:, 0], raw[:, 1:]
    if not filters.any():
        out = data.copy()
    else:
        out = np.zeros((h, stride), np.uint8)
        prev = np.zeros(stride, np.int32)
        for y in range(h):
            cur = data[y].astype(np.int32)
            f = int(filters[y])
            if f == 1:  # Sub: running sum per channel
                cur = np.cumsum(cur.reshape(w, channels), axis=0).reshape(-1) & 0xFF
            elif f == 2:  # Up
                cur = (cur + prev) & 0xFF
            elif f in (3, 4):  # Average, Paeth: sequential
                row = cur.tolist()
                up = prev.tolist()
                for x in range(stride):
                    left = row[x - channels] if x >= channels else 0
                    if f == 3:
                        row[x] = (row[x] + ((left + up[x]) >> 1)) & 0xFF
                    else:
                        ul = up[x - channels] if x >= channels else 0
                        row[x] = (row[x] + _paeth(left, up[x], ul)) & 0xFF
                cur = np.asarray(row, np.int32)
            elif f != 0:
                raise ValueError(f"{path}: bad PNG filter type {f}")
            out[y] = cur
            prev = cur
    img = out.reshape(h, w, channels)
    if color == 3:
        if palette is None:
            raise ValueError(f"{path}: palette PNG without PLTE")
        return palette[img[..., 0]]
    if channels in (1, 2):
        return np.repeat(img[..., :1], 3, axis=2)
    return np.ascontiguousarray(img[..., :3])


def write_ppm(path: str, image: np.ndarray) -> None:
    h, w = image.shape[:2]
    with open(path, "wb") as f:
        f.write(f"P6\n{w} {h}\n255\n".encode())
        f.write(np.ascontiguousarray(image, dtype=np.uint8).tobytes())


def read_ppm(path: str) -> np.ndarray:
    with open(path, "rb") as f:
        blob = f.read()
    tokens, pos = [], 0
    while len(tokens) < 4:
        while blob[pos : pos + 1].isspace():
            pos += 1
        if blob[pos : pos + 1] == b"#":
            pos = blob.index(b"\n", pos) + 1
            continue
        end = pos
        while not blob[end : end + 1].isspace():
            end += 1
        tokens.append(blob[pos:end])
        pos = end
    if tokens[0] != b"P6" or int(tokens[3]) != 255:
        raise ValueError(f"{path}: only binary 8-bit PPM (P6, maxval 255) is supported")
    w, h = int(tokens[1]), int(tokens[2])
    pos += 1  # the single whitespace after maxval
    return np.frombuffer(blob, np.uint8, count=w * h * 3, offset=pos).reshape(h, w, 3)


def load_image(path: str) -> np.ndarray:
    """Any supported image file -> (H, W, 3) uint8 RGB."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        arr = np.load(path)
        return np.repeat(arr[..., None], 3, axis=2) if arr.ndim == 2 else arr[..., :3]
    if _PILImage is not None:
        with _PILImage.open(path) as im:
            return np.asarray(im.convert("RGB"))
    if ext == ".png":
        return read_png(path)
    if ext == ".ppm":
        return read_ppm(path)
    raise RuntimeError(f"{path}: decoding {ext} files needs Pillow (pip install pillow)")


# ----------------------------------------------------------------------------- ImageFolder
def _random_resized_crop(
    img: np.ndarray, size: int, rng: np.random.Generator, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> torch.Tensor:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip on an HWC uint8 array ->
    (3, size, size) uint8."""
    h, w = img.shape[:2]
    area = h * w
    top, left, ch, cw = 0, 0, h, w
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
        cw_ = int(round(np.sqrt(target * aspect)))
        ch_ = int(round(np.sqrt(target / aspect)))
        if 0 < cw_ <= w and 0 < ch_ <= h:
            top, left, ch, cw = (
                int(rng.integers(0, h - ch_ + 1)),
                int(rng.integers(0, w - cw_ + 1)),
                ch_,
                cw_,
            )
            break
    else:  # central crop at the nearest allowed ratio
        r = w / h
        if r < ratio[0]:
            cw, ch = w, int(round(w / ratio[0]))
        elif r > ratio[1]:
            ch, cw = h, int(round(h * ratio[1]))
        top, left = (h - ch) // 2, (w - cw) // 2
    crop = torch.from_numpy(np.ascontiguousarray(img[top : top + ch, left : left + cw]))
    x = crop.permute(2, 0, 1).unsqueeze(0).float()
    x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    x = x.squeeze(0).round_().clamp_(0, 255).to(torch.uint8)
    if rng.random() < 0.5:
        x = x.flip(2)
    return x


class ImageFolder(Dataset):
    """``root/<class>/<image>`` (or ``root/train/<class>/<image>``) with training augmentation."""

    def __init__(self, root: str, image_size: int = 224, seed: int = 0):
        if os.path.isdir(os.path.join(root, "train")):
            root = os.path.join(root, "train")
        self.root = root
        self.image_size = image_size
        self.seed = seed
        self.epoch = 0
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"{root}: no class sub-directories (expected root/<class>/)")
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        empty = []
        for c in self.classes:
            files = []
            for dirpath, _, names in os.walk(os.path.join(root, c), followlinks=True):
                files += [
                    os.path.join(dirpath, n)
                    for n in names
                    if n.lower().endswith(IMG_EXTENSIONS) and not n.startswith(".")
                ]
            if not files:
                empty.append(c)
            self.samples += [(p, self.class_to_idx[c]) for p in sorted(files)]
        if empty:
            raise FileNotFoundError(
                f"{root}: no image files ({', '.join(IMG_EXTENSIONS)}) for classes "
                f"{', '.join(empty[:5])}{' ...' if len(empty) > 5 else ''}"
            )

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        rng = np.random.default_rng([self.seed, self.epoch, index])
        return _random_resized_crop(load_image(path), self.image_size, rng), label


# ----------------------------------------------------------------------------- prepare
def prepare(
    out: str,
    num_images: int = 1000,
    num_classes: int | None = None,
    image_size: int = 256,
    fmt: str | None = None,
    seed: int = 0,
) -> dict:
    """Write a mock ImageNet-style tree ``out/train/n<class>/<class>_<i>.<ext>``.

    ``num_classes`` defaults to min(1000, num_images); image i belongs to class i % num_classes.
    Returns a small description (also written to ``out/mock_imagenet.json``).
    """
    import json

    if fmt is None:
        fmt = "jpeg" if _PILImage is not None else "png"
    if fmt == "jpeg" and _PILImage is None:
        raise RuntimeError("--format jpeg needs Pillow (pip install pillow); use png")
    num_classes = num_classes or min(1000, num_images)
    if num_images < num_classes:
        raise ValueError(f"--num-images {num_images} < --num-classes {num_classes}")
    ext = {"png": ".png", "jpeg": ".JPEG", "ppm": ".ppm", "npy": ".npy"}[fmt]
    train = os.path.join(out, "train")
    rng = np.random.default_rng(seed)
    tints = rng.random((num_classes, 3))
    for c in range(num_classes):
        os.makedirs(os.path.join(train, f"n{c:08d}"), exist_ok=True)
    for i in range(num_images):
        c = i % num_classes
        h = image_size + int(rng.integers(-image_size // 8, image_size // 8 + 1))
        w = image_size + int(rng.integers(-image_size // 8, image_size // 8 + 1))
        coarse = torch.from_numpy(rng.random((1, 3, 6, 6), dtype=np.float32))
        field = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)[0]
        img = 0.55 * field.permute(1, 2, 0).numpy() + 0.45 * tints[c]
        img = img + rng.normal(0.0, 0.04, img.shape)
        img = (np.clip(img, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        path = os.path.join(train, f"n{c:08d}", f"n{c:08d}_{i}{ext}")
        if fmt == "png":
            write_png(path, img)
        elif fmt == "ppm":
            write_ppm(path, img)
        elif fmt == "npy":
            np.save(path, img)
        else:
            _PILImage.fromarray(img).save(path, format="JPEG", quality=90)
    info = {
        "root": os.path.abspath(out),
        "num_images": num_images,
        "num_classes": num_classes,
        "image_size": image_size,
        "format": fmt,
        "seed": seed,
    }
    with open(os.path.join(out, "mock_imagenet.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gallery.resnet50.data", allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="write a mock ImageNet-style ImageFolder tree")
    pp.add_argument("--out", required=True, help="output directory (DIR/train/<class>/...)")
    pp.add_argument("--num-images", type=int, default=1000)
    pp.add_argument("--num-classes", type=int, default=None, help="default min(1000, images)")
    pp.add_argument("--image-size", type=int, default=256, help="about this many pixels a side")
    pp.add_argument(
        "--format",
        choices=("png", "jpeg", "ppm", "npy"),
        default=None,
        help="default: jpeg with Pillow installed, else png",
    )
    pp.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.num_images < 1 or (args.num_classes is not None and args.num_classes < 1):
        p.error("--num-images and --num-classes must be >= 1")
    if args.image_size < 8:
        p.error("--image-size must be >= 8")
    try:
        info = prepare(
            args.out, args.num_images, args.num_classes, args.image_size, args.format, args.seed
        )
    except (RuntimeError, ValueError) as e:
        p.error(str(e))
    print(
        f"wrote {info['num_images']} {info['format']} images in {info['num_classes']} classes "
        f"to {os.path.join(info['root'], 'train')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
