"""Accelerators' peak numbers: what MFU and the planner's roofline divide by.

One small table (standard library only, base stage) used by the launcher's MFU log,
``ta.accelerate`` runs, ``benchmarks/`` and ``torchacc.plan``. Every figure is the vendor's
dense (no sparsity) number from the datasheet named in ``source``; bandwidths are bytes per
second. ``link_bw`` is the intra-node link (NVLink) per GPU per direction; ``network_bw`` is a
typical inter-node figure per GPU (one 400 Gb/s NIC per GPU = 50 GB/s).
"""

from __future__ import annotations

import dataclasses

TERA = 1e12
GIGA = 1e9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str  # the name users pass (--device h100-sxm)
    device_kinds: tuple  # what jax.devices()[0].device_kind says for it (prefix match)
    peak_flops: dict  # dtype name -> dense FLOP/s
    hbm_bw: float  # bytes/s
    hbm_bytes: int  # memory per device
    link_bw: float  # intra-node, bytes/s per direction per device
    network_bw: float  # inter-node, bytes/s per device
    source: str

    def peak(self, dtype: str = "bfloat16") -> float:
        """Dense peak FLOP/s for ``dtype`` ("bfloat16", "float16", "float32", "tf32")."""
        key = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
        if key not in self.peak_flops:
            raise ValueError(
                f"no peak FLOP/s for dtype {dtype!r} on {self.name}; "
                f"known: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[key]


def _gpu(name, kinds, bf16, tf32, fp32, hbm_tbs, hbm_gib, link_gbs, source, network_gbs=50.0):
    return Accelerator(
        name=name,
        device_kinds=tuple(kinds),
        peak_flops={
            "bfloat16": bf16 * TERA,
            "float16": bf16 * TERA,
            "tf32": tf32 * TERA,
            "float32": fp32 * TERA,
        },
        hbm_bw=hbm_tbs * TERA,
        hbm_bytes=int(hbm_gib * 2**30),
        link_bw=link_gbs * GIGA,
        network_bw=network_gbs * GIGA,
        source=source,
    )


# NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional = 450 GB/s per direction; NVLink 3 (A100): 600
# bidirectional = 300 per direction; PCIe parts without an NVLink bridge: PCIe Gen5 x16 64 GB/s,
# Gen4 x16 32 GB/s per direction.
ACCELERATORS = {
    a.name: a
    for a in (
        _gpu(
            "h100-sxm",
            ["NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", "NVIDIA H100"],
            989.4,
            494.7,
            66.9,
            3.35,
            80,
            450,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989.4 TFLOP/s bf16 dense, 3.35 TB/s",
        ),
        _gpu(
            "h100-pcie",
            ["NVIDIA H100 PCIe"],
            756.5,
            378.0,
            51.2,
            2.0,
            80,
            64,
            "NVIDIA H100 datasheet (PCIe): 756 TFLOP/s bf16 dense, 2.0 TB/s",
        ),
        _gpu(
            "h200",
            ["NVIDIA H200"],
            989.4,
            494.7,
            66.9,
            4.8,
            141,
            450,
            "NVIDIA H200 datasheet (SXM): 989 TFLOP/s bf16 dense, 4.8 TB/s, 141 GB",
        ),
        _gpu(
            "a100",
            ["NVIDIA A100"],
            312.0,
            156.0,
            19.5,
            2.039,
            80,
            300,
            "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 2.039 TB/s",
        ),
        _gpu(
            "l40s",
            ["NVIDIA L40S"],
            362.05,
            183.0,
            91.6,
            0.864,
            48,
            32,
            "NVIDIA L40S datasheet: 362 TFLOP/s bf16 dense (733 sparse), 864 GB/s, no NVLink",
        ),
    )
}
# device_kind prefixes are tried longest first, so "NVIDIA H100 PCIe" is not taken for the SXM part
_BY_KIND = sorted(
    ((kind, acc) for acc in ACCELERATORS.values() for kind in acc.device_kinds),
    key=lambda item: -len(item[0]),
)


def lookup(name: str) -> Accelerator:
    """The accelerator a user named (``h100-sxm``, ``H100``, ``a100``...); ValueError if unknown."""
    key = name.strip().lower().replace("_", "-")
    aliases = {"h100": "h100-sxm", "h200-sxm": "h200", "a100-sxm": "a100"}
    key = aliases.get(key, key)
    if key not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {', '.join(sorted(ACCELERATORS))}")
    return ACCELERATORS[key]


def from_device_kind(device_kind: str) -> Accelerator | None:
    """The table entry for ``jax.devices()[0].device_kind``; None for a CPU or an unknown part."""
    for kind, acc in _BY_KIND:
        if device_kind.startswith(kind):
            return acc
    return None


def mfu(flops_per_second_per_device: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved / peak, or None when the peak is unknown (a CPU)."""
    if not peak_flops:
        return None
    return flops_per_second_per_device / peak_flops


def device_peak(
    device_kind: str, dtype: str = "bfloat16", peak_tflops: float | None = None
) -> float | None:
    """Dense peak FLOP/s for MFU: ``peak_tflops`` (the user's ``--peak_tflops``) when given, else
    the table's entry for ``device_kind`` at ``dtype``; None for a CPU or an unknown part (MFU
    shows n/a)."""
    if peak_tflops:
        return float(peak_tflops) * TERA
    acc = from_device_kind(device_kind or "")
    if acc is None:
        return None
    try:
        return acc.peak(dtype)
    except ValueError:
        return None
