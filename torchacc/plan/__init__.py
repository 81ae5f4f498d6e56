"""Size a training job before launching it: ``torchacc.plan.plan(...)`` / ``python -m
torchacc.plan`` compile one training step for a mesh of N virtual devices, from abstract shapes
only, and report per-device memory, collective traffic per mesh axis, FLOPs and a roofline step
time / MFU for a named accelerator.

Note [What the plan measures and what it estimates]
Measured by XLA on the compiled, partitioned step (Note [What the planner compiles] in
compile.py): the step's argument / output / aliased / temp bytes per device
(``memory_analysis()``), FLOPs and bytes accessed per device (``cost_analysis()``), and every
collective of the HLO with its size and replica group (mapped to mesh axes).
Exact by construction: parameter, gradient (fp32, as the step returns them) and optimizer-state
bytes per device, from each tensor's partition spec, padding included.
Estimates: "activations" (forward values the backward reads, from the traced graph, split over
the data axes where their leading dimension is the batch: a breakdown of ``temp``, which already
holds them); depth extrapolation (a model deeper than ``full_depth_max`` layers is compiled at 1
and 2 layers and every number extended linearly to its depth: layers are identical, so each adds
the same bytes, FLOPs and collectives; under pp the whole pipelined model is compiled at pp
and 2 pp layers, one and two per stage); and
the step time: ``max(FLOPs / peak, bytes accessed / HBM bandwidth) + sum over collectives of
their ring-algorithm bytes / link bandwidth`` (no overlap of communication with compute; a mesh
axis whose devices lie within one node of ``gpus_per_node`` uses the intra-node link, else the
network). XLA:CPU's fusion differs from XLA:GPU's, so bytes accessed is the CPU compiler's count.

Note [scan_layers in a plan]
``scan_layers`` is recorded in the plan, and the planned program runs the layers as the unrolled
loop: the gallery's ``ScannedLayers`` runs the same blocks with the same weights (stacked), so
the step's bytes, FLOPs and collectives are those of the loop up to XLA's scheduling; what scan
buys a real run (a compile flat in depth) the planner gets from depth extrapolation.

Pipeline parallel (pp > 1) is ``ta.dist.PipelineParallel``'s own compiled step (Note [What the
planner compiles under pp] in pipeline.py): its memory, its pp sends and its executed FLOPs
(bubble ticks included, Note [FLOPs of the pipelined step]) are measured like any other step's.

Note [Layouts]
Without pp the mesh has axes (dp, fsdp, cp, tp), tp innermost (devices numbered row-major);
with pp it is ta.dist.PipelineParallel's (dp, fsdp, pp) mesh (TorchAcc's topology order), each
stage's parameters one packed row split over (pp, fsdp). dp and fsdp split the batch (dim 0);
cp splits the sequence (dim 1), attention running as dist.sp's region (Note [Context parallel
in a plan] in compile.py); fsdp splits each parameter's dim 0 (the sharding engine's FSDP spec,
distributed/fsdp.py) and its gradient and optimizer state alike; tp splits Megatron pairs:
column layers (q/k/v, gate/up, c_attn, c_fc, lm_head; and the token embedding) on dim 0, row
layers (o_proj, down_proj, c_proj) on dim 1; with fsdp and tp, fsdp takes the dimension tp
left. Without cp, activations whose dim 0 is the batch are constrained to the data axes (Note
[Activation layout] in compile.py). XLA's partitioner inserts every collective, as in a real
SPMD run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from torchacc import hardware
from torchacc.plan import roofline
from torchacc.plan.models import PlanError, known_models, resolve
from torchacc.plan.pipeline import pipelinable, why_not_pipelinable
from torchacc.plan.roofline import format_table
from torchacc.plan.runner import run_worker as _run_worker

__all__ = [
    "Plan",
    "PlanError",
    "plan",
    "search",
    "parse_mesh",
    "parse_bytes",
    "known_models",
    "format_table",
]

AXES = ("dp", "fsdp", "tp", "pp", "cp")
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "sgd")
FULL_DEPTH_MAX = 4  # deeper models are compiled at 1 and 2 layers and extrapolated
GiB = 2**30


@dataclasses.dataclass
class Plan:
    """One layout's plan. Bytes are per device; ``collective_bytes`` is per mesh axis per step
    (per device: what each device sends/receives as XLA's ops name it, Note [What the plan
    measures and what it estimates]); times in seconds."""

    model: str
    devices: int
    mesh: dict
    batch_size: int  # global batch of one optimizer step
    seq_len: int
    precision: str
    optimizer: str
    gc: bool
    scan_layers: bool
    device: str
    gpus_per_node: int
    n_params: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # estimate: forward values kept for the backward (part of xla_temp)
    xla_temp: int
    batch_bytes: int
    total: int  # arguments + outputs - aliased + temp, per device
    collective_bytes: dict  # axis (or "dp+fsdp") -> bytes per device per step
    collective_time: dict  # axis -> seconds (ring algorithm at the axis' bandwidth)
    flops: float  # per device per step (XLA cost analysis)
    model_flops: float  # per step, all devices: (6N + 12 L d T) x tokens
    bytes_accessed: float
    compute_time: float
    memory_time: float
    step_time: float
    mfu: float
    tokens_per_s_per_device: float
    fits: bool | None
    memory_limit: int | None
    extrapolated_from: list | None  # depths compiled when the depth was extrapolated
    microbatches: int
    compile_s: float
    host_peak_bytes: int

    def to_dict(self):
        return dataclasses.asdict(self)

    def table(self):
        return format_table([self])


def parse_bytes(text):
    """'80GiB', '24 GB', '512MiB', '1e9' -> bytes; :class:`PlanError` naming the text else."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", str(text), re.I)
    if not m:
        raise PlanError(
            f"memory {text!r} is not a size; write e.g. 80GiB, 24GB, 512MiB or a byte count"
        )
    unit = (m.group(2) or "B").upper().rstrip("B") or ""
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2**10, "MI": 2**20}
    scale.update({"GI": 2**30, "TI": 2**40})
    return int(float(m.group(1)) * scale[unit])


def parse_mesh(text):
    """'dp=2,fsdp=4,tp=8' (or a dict) -> {axis: size} over dp, fsdp, tp, pp, cp (missing: 1)."""
    if isinstance(text, dict):
        items = list(text.items())
    else:
        items = []
        for part in str(text).split(","):
            if not part.strip():
                continue
            k, sep, v = part.partition("=")
            if not sep:
                raise PlanError(f"mesh entry {part!r} in {text!r}: write axis=size, e.g. fsdp=8")
            items.append((k.strip(), v.strip()))
    mesh = dict.fromkeys(AXES, 1)
    for k, v in items:
        if k not in AXES:
            raise PlanError(f"mesh axis {k!r} in {text!r}: known axes are {', '.join(AXES)}")
        try:
            n = int(v)
        except (TypeError, ValueError):
            raise PlanError(
                f"mesh axis {k}={v!r} in {text!r}: the size must be a whole number"
            ) from None
        if n < 1:
            raise PlanError(f"mesh axis {k}={n} in {text!r}: the size must be at least 1")
        mesh[k] = n
    return mesh


def _check_layout(spec, mesh, devices, batch_size, seq_len, microbatches):
    n = math.prod(mesh.values())
    if n != devices:
        raise PlanError(
            f"mesh {_mesh_str(mesh)} has {n} devices (the product of its sizes), but the job "
            f"has {devices} devices"
        )
    data = mesh["dp"] * mesh["fsdp"] * microbatches
    if batch_size % (mesh["dp"] * mesh["fsdp"]) or batch_size % data:
        raise PlanError(
            f"batch_size {batch_size} (the global batch of one step) does not divide over "
            f"dp x fsdp = {mesh['dp'] * mesh['fsdp']}"
            + (f" x {microbatches} micro-batches" if microbatches > 1 else "")
        )
    if spec.kind == "lm":
        if spec.n_head and mesh["tp"] > 1:
            if spec.n_head % mesh["tp"]:
                raise PlanError(
                    f"tp={mesh['tp']} does not divide {spec.name}'s {spec.n_head} heads"
                )
            kv = spec.n_kv_head or spec.n_head
            if kv % mesh["tp"]:  # Megatron splits whole heads, as dist.tp does (recipes.py)
                raise PlanError(
                    f"tp={mesh['tp']} does not divide {spec.name}'s {kv} key/value heads"
                )
        if mesh["pp"] > 1:  # Note [What the planner compiles under pp] in pipeline.py
            if spec.n_layer and spec.n_layer % mesh["pp"]:
                raise PlanError(
                    f"pp={mesh['pp']} does not divide {spec.name}'s {spec.n_layer} layers (each "
                    "stage takes the same number of blocks)"
                )
            if mesh["tp"] > 1 or mesh["cp"] > 1:
                raise PlanError(
                    f"pp={mesh['pp']} with tp={mesh['tp']}, cp={mesh['cp']}: pipeline parallel "
                    "(ta.dist.PipelineParallel) composes with dp and fsdp only"
                )
            if not spec.layer_prefix:
                raise PlanError(
                    f"pp={mesh['pp']}: {spec.name} names no repeated blocks to cut into stages"
                )
        if mesh["cp"] > 1 and seq_len % (2 * mesh["cp"]):
            raise PlanError(
                f"cp={mesh['cp']} needs seq_len divisible by 2 x cp = {2 * mesh['cp']} (context "
                f"parallel's load-balanced causal split), got seq_len {seq_len}"
            )
        if spec.max_seq and seq_len > spec.max_seq:
            raise PlanError(f"seq_len {seq_len} > {spec.name}'s context of {spec.max_seq}")
    elif mesh["tp"] > 1 or mesh["pp"] > 1 or mesh["cp"] > 1:
        raise PlanError(f"{spec.name}: only dp and fsdp layouts are planned for this model")


def _mesh_str(mesh):
    return ",".join(f"{a}={mesh[a]}" for a in AXES)


def _accelerator(name):
    try:
        return hardware.lookup(name)
    except (KeyError, ValueError) as e:
        raise PlanError(
            f"unknown accelerator {name!r}; known: {', '.join(sorted(hardware.ACCELERATORS))}"
        ) from e


def _host_memory():
    env = os.environ.get("TORCHACC_PLAN_HOST_MEMORY")
    if env:
        return parse_bytes(env)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# calibrated on the 2-core box (RESULTS.md "Planning a job"): the worker's baseline (torch + JAX
# + torchacc) and its growth per compiled layer and per device of the mesh
_HOST_BASE = 1.0 * GiB
_HOST_PER_LAYER = 64 * 2**20
_HOST_PER_DEVICE = 2 * 2**20


def host_estimate(layers_compiled, devices):
    """Host bytes the worker needs to compile steps with ``layers_compiled`` layers in all."""
    return int(_HOST_BASE + _HOST_PER_LAYER * layers_compiled + _HOST_PER_DEVICE * devices)


def plan(
    model,
    batch_size,
    seq_len=None,
    mesh=None,
    precision="bf16",
    optimizer="adamw",
    gc=False,
    scan_layers=False,
    device="h100-sxm",
    *,
    devices=None,
    gpus_per_node=8,
    memory=None,
    microbatches=None,
    full_depth=False,
    progress=None,
):
    """Plan one layout; returns a :class:`Plan`.

    ``model``: a gallery model name (``gpt2``, ``llama-tiny``, ``resnet50``, ...), a shape-only
    config (``llama-7b``, ``llama-13b``, ``llama-70b``, ``llama3-8b``, ``gpt2-xl``) or
    ``"module:factory"`` (a function returning an ``nn.Module`` mapping token ids (B, T) to
    logits). ``batch_size``: the global batch of one optimizer step. ``seq_len``: tokens per
    sample (default: the model's context). ``mesh``: ``"dp=2,fsdp=4,tp=8,pp=1,cp=1"`` or a dict
    (missing axes 1; default: fsdp over ``devices``). ``precision``: ``"bf16"`` (autocast, fp32
    master weights) or ``"fp32"``. ``optimizer``: ``"adamw"`` or ``"sgd"`` (momentum). ``gc``:
    gradient checkpointing of every block. ``scan_layers``: the gallery models' scanned layers.
    ``device``: an accelerator of :mod:`torchacc.hardware` for the roofline. ``devices``: the
    device count (default: the mesh's product). ``gpus_per_node``: devices per node (NVLink
    inside, network across). ``memory``: per-device budget (bytes or ``"80GiB"``) for ``fits``.
    ``microbatches``: pipeline micro-batches (default 2 x pp). ``full_depth``: compile every
    layer instead of extrapolating from 1 and 2 (Note [What the plan measures and what it
    estimates]). ``progress``: a callable getting progress lines (default: stderr).
    """
    return _plan_many(
        model, batch_size, seq_len, [mesh], precision, optimizer, gc, scan_layers, device,
        devices, gpus_per_node, memory, microbatches, full_depth, progress,
    )[0]  # fmt: skip


def plan_batch(jobs, devices=None, gpus_per_node=8, device="h100-sxm", progress=None):
    """Plan several (model, layout) jobs in one worker process: ``jobs`` is a list of dicts of
    :func:`plan`'s keyword arguments (``model``, ``batch_size``, ``seq_len``, ``mesh``,
    ``precision``, ``optimizer``, ``gc``, ``scan_layers``, ``memory``, ``microbatches``,
    ``full_depth``); returns their :class:`Plan` s in order."""
    prepared = [
        _prepare(
            j["model"], j["batch_size"], j.get("seq_len"), j.get("mesh"),
            j.get("precision", "bf16"), j.get("optimizer", "adamw"), j.get("gc", False),
            j.get("scan_layers", False), j.get("device", device), devices,
            j.get("gpus_per_node", gpus_per_node), j.get("memory"), j.get("microbatches"),
            j.get("full_depth", False),
        )
        for j in jobs
    ]  # fmt: skip
    return _run(prepared, progress)


def _plan_many(
    model, batch_size, seq_len, meshes, precision, optimizer, gc, scan_layers, device, devices,
    gpus_per_node, memory, microbatches, full_depth, progress,
):  # fmt: skip
    prepared = [
        _prepare(
            model, batch_size, seq_len, mesh, precision, optimizer, gc, scan_layers, device,
            devices, gpus_per_node, memory, microbatches, full_depth,
        )
        for mesh in meshes
    ]  # fmt: skip
    return _run(prepared, progress)


def _prepare(
    model, batch_size, seq_len, mesh, precision, optimizer, gc, scan_layers, device, devices,
    gpus_per_node, memory, microbatches, full_depth,
):  # fmt: skip
    """Validate one job (every bad value a PlanError naming it); the worker's request."""
    spec = resolve(model)
    acc = _accelerator(device)
    if precision not in PRECISIONS:
        raise PlanError(f"precision {precision!r}: known {', '.join(PRECISIONS)}")
    if optimizer not in OPTIMIZERS:
        raise PlanError(f"optimizer {optimizer!r}: known {', '.join(OPTIMIZERS)}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise PlanError(f"batch_size {batch_size!r} must be a positive whole number")
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise PlanError(f"gpus_per_node {gpus_per_node!r} must be a positive whole number")
    if seq_len is None:
        seq_len = spec.max_seq or 0
    limit = parse_bytes(memory) if memory is not None else None
    m = parse_mesh(mesh if mesh is not None else {"fsdp": devices or 1})
    n = math.prod(m.values())
    if devices is not None and n != devices:
        _check_layout(spec, m, devices, batch_size, seq_len, 1)
    if microbatches is not None and (
        not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1
    ):
        raise PlanError(f"microbatches {microbatches!r} must be a positive whole number")
    mb = (microbatches or 2 * m["pp"]) if m["pp"] > 1 else 1
    _check_layout(spec, m, n, batch_size, seq_len, mb)
    if m["pp"] > 1:
        why = why_not_pipelinable(spec)
        if why:
            raise PlanError(f"pp={m['pp']}: {spec.name} cannot be cut into stages: {why}")
    stage_layers = spec.n_layer // m["pp"] if spec.n_layer else None
    if stage_layers and not full_depth and stage_layers > FULL_DEPTH_MAX:
        depths = [1, 2]  # layers per stage; the whole model has pp x as many
    else:
        depths = [stage_layers] if stage_layers else [None]
    if m["pp"] > 1:  # the whole pipelined model is compiled: depths count all its layers
        depths = [d * m["pp"] for d in depths]
    req = dict(
        model=model, batch_size=batch_size, seq_len=seq_len, precision=precision,
        optimizer=optimizer, gc=bool(gc), scan_layers=bool(scan_layers), microbatches=mb,
        layout={a: m[a] for a in ("dp", "fsdp", "cp", "tp", "pp")}, depths=depths,
    )  # fmt: skip
    ctx = dict(
        spec=spec, acc=acc, mesh=m, micro=mb, depths=depths, gpus_per_node=gpus_per_node,
        limit=limit, devices=n, device=device,
    )  # fmt: skip
    return req, ctx


def _run(prepared, progress):
    n_total = max(ctx["devices"] for _, ctx in prepared)
    compiled_layers = sum(sum(d or 1 for d in req["depths"]) for req, _ in prepared)
    need = host_estimate(compiled_layers, n_total)
    have = _host_memory()
    if have is not None and need > have:
        names = sorted({ctx["spec"].name for _, ctx in prepared})
        raise PlanError(
            f"planning {', '.join(names)} on {n_total} devices needs about {need / GiB:.1f} GiB "
            f"of host memory (compiling {compiled_layers} layers), but this machine has "
            f"{have / GiB:.1f} GiB available; drop full_depth / --full-depth (compile 1 and 2 "
            "layers and extrapolate) or plan on a larger machine"
        )
    raws = _run_worker([req for req, _ in prepared], n_total, progress)
    plans = []
    for j, (req, ctx) in enumerate(prepared):
        mine = [r for r in raws if r["job"] == j]
        plans.append(
            roofline.assemble(
                ctx["spec"], req, ctx["mesh"], ctx["micro"], mine, ctx["depths"], ctx["acc"],
                ctx["gpus_per_node"], ctx["limit"], ctx["devices"], ctx["device"],
            )
        )  # fmt: skip
    return plans


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(spec, devices, batch_size, seq_len, gpus_per_node, max_pp=4, pp=None):
    """Every (dp, fsdp, tp, pp, cp) whose product is ``devices`` and that the model and batch
    allow (tp within a node and dividing the heads, pp dividing the layers, cp the sequence;
    pp at most ``max_pp``, and only where the model is pipelinable: ``pp`` True/False, None to
    ask :func:`pipelinable`)."""
    if pp is None:
        pp = pipelinable(spec)
    max_pp = max_pp if pp else 1
    out = []
    for tp in _divisors(devices):
        if tp > gpus_per_node:
            continue
        for p in _divisors(devices // tp):
            if p > max_pp:
                continue
            for cp in _divisors(devices // tp // p):
                rest = devices // tp // p // cp
                for dp in _divisors(rest):
                    m = dict(dp=dp, fsdp=rest // dp, tp=tp, pp=p, cp=cp)
                    mb = 2 * p if p > 1 else 1
                    try:
                        _check_layout(spec, m, devices, batch_size, seq_len, mb)
                    except PlanError:
                        continue
                    if spec.kind != "lm" and (tp > 1 or p > 1 or cp > 1):
                        continue
                    out.append(m)
    return out


def _analytic_score(spec, m, batch_size, seq_len):
    """A cheap pre-ranking: per-device state bytes (fp32 params, grads, 2 moments) and a
    communication proxy; the planner compiles the best few."""
    n = 12 * (spec.n_layer or 1) * (spec.d_model or 1) ** 2 + 2 * (spec.vocab or 0) * (
        spec.d_model or 0
    )
    state = 16 * n / (m["fsdp"] * m["tp"] * m["pp"])
    comm = 0.0
    comm += 3 * 4 * n / (m["tp"] * m["pp"]) * (1 if m["fsdp"] > 1 else 0)
    comm += 2 * 4 * n / (m["tp"] * m["pp"] * m["fsdp"]) * (1 if m["dp"] > 1 else 0)
    comm += 4 * batch_size * seq_len * (spec.d_model or 0) * (spec.n_layer or 1) * (m["tp"] > 1)
    comm /= m["dp"] * m["fsdp"] * m["cp"]
    comm += 1e9 * (m["pp"] - 1) + 1e9 * (m["cp"] - 1)
    return state, comm


def search(
    model, devices, batch_size, seq_len=None, memory="80GiB", precision="bf16",
    optimizer="adamw", gc=False, scan_layers=False, device="h100-sxm", gpus_per_node=8,
    top=4, progress=None,
):  # fmt: skip
    """Rank the layouts of ``devices`` that fit ``memory`` per device by estimated step time.
    The candidates (every divisor split, :func:`candidate_layouts`) are pre-ranked by an
    analytic state-bytes and traffic proxy; the ``top`` best are compiled and planned. Returns
    the plans that fit, fastest first, then those that do not."""
    jobs = _search_jobs(
        model, devices, batch_size, seq_len, memory, precision, optimizer, gc, scan_layers,
        device, gpus_per_node, top,
    )  # fmt: skip
    return _rank(_run(jobs, progress))


def _search_jobs(
    model, devices, batch_size, seq_len, memory, precision, optimizer, gc, scan_layers, device,
    gpus_per_node, top,
):  # fmt: skip
    """:func:`search`'s candidates to compile (validated worker requests)."""
    spec = resolve(model)
    _accelerator(device)
    limit = parse_bytes(memory)
    if not isinstance(devices, int) or devices < 1:
        raise PlanError(f"devices {devices!r} must be a positive whole number")
    if seq_len is None:
        seq_len = spec.max_seq or 0
    cands = candidate_layouts(spec, devices, batch_size, seq_len, gpus_per_node)
    if not cands:
        raise PlanError(
            f"no layout of {devices} devices fits {spec.name} with batch_size {batch_size} and "
            f"seq_len {seq_len} (the batch must divide over dp x fsdp, tp the heads, pp the "
            "layers)"
        )
    scored = sorted(cands, key=lambda m: _analytic_score(spec, m, batch_size, seq_len)[1])
    fitting = [m for m in scored if _analytic_score(spec, m, batch_size, seq_len)[0] < limit]
    chosen = (fitting or scored)[:top]
    return [
        _prepare(
            model, batch_size, seq_len, mesh, precision, optimizer, gc, scan_layers, device,
            devices, gpus_per_node, limit, None, False,
        )
        for mesh in chosen
    ]  # fmt: skip


def _rank(plans):
    """Plans that fit first, fastest first; then those that do not."""
    return sorted(plans, key=lambda p: (not p.fits, p.step_time))
