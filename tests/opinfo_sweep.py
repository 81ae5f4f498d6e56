"""OpInfo sweeps: PyTorch's own OpInfo samples (``op_db``) run on the torchacc device against
eager CPU.

Two samples of op_db:

- ``op_db_ops()``: every OpInfo (less the test-only variants in EXCLUDED), one seeded float32
  sample each. This is the coverage figure (issue 32): the share of ops whose sample matches
  eager and the share that runs fully lowered, whatever family the op is in.
- ``claimed_ops()``: the OpInfos torchacc claims (each op_db entry whose ATen op has a lowering
  rule, and every other one outside the NOT_CLAIMED families), used for the bfloat16 sweep.

For each OpInfo and dtype that eager CPU supports, the first ``SAMPLES`` sample inputs (seeded) are
run eagerly on CPU and on the torchacc device (one sync per chunk of samples). A sample is

- *lowered* when it ran without any ``aten::*`` fallback counter moving (torchacc.metrics);
- *matching* when every tensor output equals eager's (dtype-aware tolerances, NaNs equal);
- *error* when torchacc raised (eager's own errors drop the sample).

Random ops (their values are not eager's stream) are compared on shape and dtype only.

Run ``python tests/opinfo_sweep.py [op ...]`` for the claimed sweep's report and
``python tests/opinfo_sweep.py --op-db`` for the float32 op_db sweep's.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import sys
import time
import warnings

import torch

SAMPLES = 1  # per (op, dtype): the sweep must stay ~1 minute of CPU time
CHUNK = 24  # samples recorded per sync (one compile each)
DTYPES = (torch.float32, torch.bfloat16)
TOL = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
# values drawn from torch's RNG: compared on shape/dtype only
RANDOM = {
    "bernoulli",
    "cauchy",
    "empty",
    "empty_like",
    "empty_permuted",
    "empty_strided",
    "exponential",
    "multinomial",
    "nn.functional.fractional_max_pool2d",  # F draws the window offsets with torch.rand
    "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
    "pca_lowrank",  # random projections
    "svd_lowrank",
    "geometric",
    "log_normal",
    "new_empty",
    "new_empty_strided",
    "normal",
    "rand_like",
    "randint",
    "randint_like",
    "randn",
    "randn_like",
    "uniform",
}
# OpInfos that sweep something other than the op's values (or that eager itself cannot run
# reproducibly on CPU); each with the reason
EXCLUDED = {
    "bmm.triton_optimized": "a CUDA Triton variant of bmm (same op as `bmm`)",
    "as_strided.partial_views": "checks storage overlap of views, not values (as_strided runs)",
    "sparse.mm.reduce": "sparse CSR input (sparse layouts are not claimed)",
}
# Samples whose torchacc result differs from eager CPU's on purpose (or for a known limitation),
# by (OpInfo variant, dtype) -> reason. Any other mismatch fails the sweep's test.
_HALF_ACC = "bf16: accumulates in float32 and rounds once; eager CPU rounds partial sums to bf16"
_STATS = "saved mean/rstd are float32 for half inputs, as the meta kernel and CUDA say (CPU: bf16)"
KNOWN_MISMATCH = {
    ("addbmm", torch.bfloat16): _HALF_ACC,
    ("cross", torch.bfloat16): _HALF_ACC,
    ("linalg.cross", torch.bfloat16): _HALF_ACC,
    (
        "matrix_exp",
        torch.bfloat16,
    ): "eager CPU's bf16 kernel gives NaN here (torchacc: fp32, finite)",
    ("nn.functional.conv_transpose2d", torch.bfloat16): _HALF_ACC,
    ("nn.functional.conv_transpose3d", torch.bfloat16): _HALF_ACC,
    ("grid_sampler_2d", torch.bfloat16): "torch's decomposition interpolates in bf16 (eager: fp32)",
    ("native_batch_norm", torch.bfloat16): _STATS,
    ("_native_batch_norm_legit", torch.bfloat16): _STATS,
    ("_batch_norm_with_update", torch.bfloat16): _STATS,
    ("native_layer_norm", torch.bfloat16): _STATS,
    ("sort", torch.bfloat16): "ties (8000 bf16 values): torchacc sorts stably, eager does not",
    ("argsort", torch.bfloat16): "ties (8000 bf16 values): torchacc sorts stably, eager does not",
    ("resize_", torch.float32): "in-place resize of a device tensor is not supported",
    ("resize_", torch.bfloat16): "in-place resize of a device tensor is not supported",
    ("linalg.eigh", torch.float32): "eigenvectors: each one's sign is LAPACK-build dependent",
    ("chalf", torch.float32): "complex32: XLA has no such type (a TypeError names the op)",
    ("to_sparse", torch.float32): "sparse layouts are not supported on the device",
    ("sparse.sampled_addmm", torch.float32): "sparse layouts are not supported on the device",
}
# Ops whose non-input tensor arguments stay on the CPU (torch requires them there on any device)
CPU_ARGS = {"tensor_split": "tensor_indices_or_sections must be a CPU tensor"}


@dataclasses.dataclass
class Result:
    op: str
    dtype: torch.dtype
    index: int
    lowered: bool
    matched: bool
    fallbacks: tuple = ()
    error: str = ""


def _variant(op):
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


# Op families torchacc does not claim (an op among them that has a lowering rule is still claimed):
# each runs as a counted CPU fallback if used.
NOT_CLAIMED = {
    "sparse.": "sparse layouts",
    "signal.": "window functions (host-side setup, not training steps)",
    "jiterator_": "CUDA-only test ops",
    "torch._scaled_mm": "CUDA-only fp8 matmul",
    "torch.ops.aten._flash_attention_forward": "CUDA-only kernel",
    "torch.ops.aten._efficient_attention_forward": "CUDA-only kernel",
}
NOT_CLAIMED_OPS = {"to_sparse": "sparse layouts", "chalf": "complex32 (XLA has no such type)"}


def _not_claimed(op):
    name = _variant(op)
    for prefix, reason in NOT_CLAIMED.items():
        if name.startswith(prefix):
            return reason
    return NOT_CLAIMED_OPS.get(op.name) or EXCLUDED.get(name)


def op_db_ops():
    """Every op_db OpInfo except the EXCLUDED test-only variants, sorted by variant name."""
    from torch.testing._internal.common_methods_invocations import op_db

    return sorted((op for op in op_db if _variant(op) not in EXCLUDED), key=_variant)


def claimed_ops():
    """The OpInfos torchacc claims, sorted by variant name: every op_db entry with a lowering rule
    for its ATen op, and every other one outside the NOT_CLAIMED families."""
    from torch.testing._internal.common_methods_invocations import op_db

    from torchacc.lowering import RULES

    packets = {getattr(o, "overloadpacket", None) for o in RULES}
    names = {p.__name__ for p in packets if p is not None}
    out = []
    for op in op_db:
        candidates = {op.aten_name, op.name, op.name.replace(".", "_"), op.name.split(".")[-1]}
        ruled = bool(candidates & names)
        if _variant(op) in EXCLUDED or (not ruled and _not_claimed(op)):
            continue
        out.append(op)
    return sorted(out, key=_variant)


def _to(x, device):
    if isinstance(x, torch.Tensor):
        return x.detach().to(device)
    if isinstance(x, (list, tuple)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _compare(got, want, dtype, random):
    got_t, want_t = _tensors(got), _tensors(want)
    if len(got_t) != len(want_t):
        return f"{len(got_t)} tensor outputs, eager gives {len(want_t)}"
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        g = g.cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {g.dtype}{list(g.shape)} vs eager {w.dtype}{list(w.shape)}"
        if random:
            continue
        try:
            torch.testing.assert_close(g, w, equal_nan=True, **TOL[dtype])
        except AssertionError as e:
            lines = str(e).splitlines()
            detail = [x.strip() for x in lines if x.startswith(("Mismatched", "Greatest"))]
            return f"output {i}: {'; '.join(detail) or str(e).splitlines()[0]}"
    if not got_t and got != want:
        return f"{got!r} vs eager {want!r}"
    return ""


def _fallback_counts(metrics):
    return {n: metrics.counter_value(n) for n in metrics.executed_fallback_ops()}


def _samples(op, dtype, samples):
    """The first ``samples`` sample inputs, seeded. (Calls the OpInfo's generator directly: its
    ``sample_inputs`` wrapper walks the Python stack per sample, costing more than the sweep.)"""
    torch.manual_seed(0)
    gen = iter(op.sample_inputs_func(op, "cpu", dtype, False))
    out = []
    for _ in range(samples):
        sample = next(gen, None)
        if sample is None:
            break
        out.append(sample)
    return out


class _Pending:
    """One sample recorded on the device, compared after the chunk's sync."""

    def __init__(self, op, dtype, index, sample):
        self.op, self.dtype, self.index, self.sample = op, dtype, index, sample
        self.name = _variant(op)

    def eager(self):
        s = self.sample
        try:
            self.want = self.op.op(s.input, *s.args, **s.kwargs)
        except Exception:
            return False  # eager rejects the sample: nothing to compare
        return True

    def record(self, device, metrics):
        s = self.sample
        before = _fallback_counts(metrics)
        try:
            if self.op.name in CPU_ARGS:
                args, kwargs = s.args, s.kwargs
            else:
                args, kwargs = _to(s.args, device), _to(s.kwargs, device)
            self.got = self.op.op(_to(s.input, device), *args, **kwargs)
            self.error = ""
        except Exception as e:  # a torchacc failure is a result of the sweep, not a crash
            self.got, self.error = None, f"{type(e).__name__}: {e}"[:300]
        after = _fallback_counts(metrics)
        self.fell = tuple(sorted(n for n, v in after.items() if v != before.get(n)))

    def result(self):
        if self.error:
            return Result(self.name, self.dtype, self.index, False, False, self.fell, self.error)
        try:
            mismatch = _compare(self.got, self.want, self.dtype, self.op.name in RANDOM)
        except Exception as e:
            mismatch = f"{type(e).__name__}: {e}"[:300]
        self.got = None
        lowered = not self.fell
        return Result(self.name, self.dtype, self.index, lowered, not mismatch, self.fell, mismatch)


def _run_chunk(chunk, device, metrics, sync):
    """Record every sample of ``chunk``, sync once, compare. If the sync fails (a lowering error),
    redo the samples one sync each so the failure lands on its op."""
    for p in chunk:
        p.record(device, metrics)
    try:
        sync()
    except Exception as e:
        for p in chunk:  # drop the failed graph's tensors: a later sync would compile it again
            p.got = None
        gc.collect()
        if len(chunk) == 1:
            chunk[0].error = f"sync: {type(e).__name__}: {e}"[:300]
            return [chunk[0].result()]
        return [r for p in chunk for r in _run_chunk([p], device, metrics, sync)]
    return [p.result() for p in chunk]


def sweep(ops=None, samples=SAMPLES, dtypes=DTYPES, chunk=CHUNK) -> list[Result]:
    import torchacc
    from torchacc import metrics

    device = torchacc.device()
    pending = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops if ops is not None else claimed_ops():
            for dtype in dtypes:
                if dtype not in op.supported_dtypes("cpu"):
                    continue
                for index, sample in enumerate(_samples(op, dtype, samples)):
                    p = _Pending(op, dtype, index, sample)
                    if p.eager():
                        pending.append(p)
        results = []
        for i in range(0, len(pending), chunk):
            results += _run_chunk(pending[i : i + chunk], device, metrics, torchacc.sync)
    return results


def lowered_fraction(results) -> float:
    return sum(r.lowered for r in results) / max(len(results), 1)


def matched_fraction(results) -> float:
    return sum(r.matched for r in results) / max(len(results), 1)


def report(results) -> str:
    lines = []
    n = len(results)
    ops = len({r.op for r in results})
    lines.append(
        f"{n} samples of {ops} ops: lowered {sum(r.lowered for r in results)} "
        f"({lowered_fraction(results):.1%}), matching {sum(r.matched for r in results)} "
        f"({sum(r.matched for r in results) / max(n, 1):.1%})"
    )
    by_fallback = collections.defaultdict(set)
    for r in results:
        for f in r.fallbacks:
            by_fallback[f].add(f"{r.op}[{str(r.dtype)[6:]}]")
    for f in sorted(by_fallback):
        lines.append(f"  fallback {f}: {', '.join(sorted(by_fallback[f]))}")
    for r in results:
        if not r.matched:
            lines.append(f"  mismatch {r.op}[{str(r.dtype)[6:]}#{r.index}]: {r.error}")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    picked, names = None, [a for a in sys.argv[1:] if a != "--op-db"]
    universe = op_db_ops() if "--op-db" in sys.argv else claimed_ops()
    if names or "--op-db" in sys.argv:
        picked = [op for op in universe if not names or _variant(op) in names]
    default = "float32" if "--op-db" in sys.argv else "float32,bfloat16"
    dtypes = os.environ.get("SWEEP_DTYPES", default).split(",")
    samples = int(os.environ.get("SWEEP_SAMPLES", SAMPLES))
    res = sweep(picked, samples=samples, dtypes=[getattr(torch, d) for d in dtypes])
    print(report(res))
    print(f"{time.perf_counter() - start:.1f}s")
