"""Checkpoints of parallel models: one merged file, or one slice file per device that merges and
re-slices for another device count or mode.

Note [Per-device checkpoint slices]
``save_checkpoint(..., integrated_save=False)`` writes ``device_<ordinal>.ckpt`` for every
device of the job (each process writes its own devices'), as MindSpore writes one file per card.
A file holds only that device's slices and their layout, all ``torch.load(weights_only=True)``
safe: ``{"format", "device", "device_num", "tensors": {name: slice}, "layout": {name: {"shape",
"index": [[start, stop], ...]}}}`` (device 0's file also holds the optimizer's ``param_groups``,
plain numbers). The slices come from the sharding engine (``local_shards``). A slice held by
several devices (a replicated tensor, or one split over fewer devices than the job has) is
written by one of them only, the owner rotating with the tensor's position, so the files
together hold each element once and their sizes sum to about the merged checkpoint's.

Loading reads every file, fills each tensor of the checkpoint from its slices by their indices
(an element no file covers is an error naming the tensor and the missing device files), and
copies the merged tensors into the model: a parameter keeps its current layout (the engine
re-slices the copied data to it), so the same files load on 4, 2 or 1 devices and
into STAND_ALONE. Files are written to a temporary name and renamed (``os.replace``): a crash
leaves the previous file or none, never half of one.
"""

from __future__ import annotations

import os

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.sharding import api as engine

FORMAT = "torchacc.parallel.checkpoint/1"
_OPT = "optimizer.state."


def _named_tensors(model, optimizer):
    out = dict(model.state_dict())
    groups = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        for idx, state in sd["state"].items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"{_OPT}{idx}.{k}"] = v
        groups = sd["param_groups"]
    return out, groups


def _atomic_save(obj, path):
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _is_lead_process():
    import jax

    return jax.process_index() == 0


def save_checkpoint(model, path, optimizer=None, integrated_save=True):
    """Save ``model`` (and ``optimizer``): one merged file at ``path``, or with
    ``integrated_save=False`` one slice file per device in the directory ``path``."""
    tensors, groups = _named_tensors(model, optimizer)
    if integrated_save:
        merged = {k: v.detach().cpu().clone() for k, v in tensors.items()}
        if _is_lead_process():
            _atomic_save(
                {"format": FORMAT, "tensors": merged, "param_groups": groups, "device_num": 1},
                path,
            )
        return [path]
    os.makedirs(path, exist_ok=True)
    n = engine.device_count() if engine.is_spmd() else 1
    files = {}
    for position, (name, t) in enumerate(tensors.items()):
        for data, index, owner, full_shape in _owned_slices(t, position, n):
            f = files.setdefault(owner, {"tensors": {}, "layout": {}})
            f["tensors"][name] = data.clone()
            f["layout"][name] = {"shape": list(full_shape), "index": index}
    written = []
    for ordinal in _local_ordinals(n):
        content = files.get(ordinal, {"tensors": {}, "layout": {}})
        obj = {"format": FORMAT, "device": ordinal, "device_num": n, **content}
        if ordinal == 0 and groups is not None:
            obj["param_groups"] = groups
        target = os.path.join(path, f"device_{ordinal}.ckpt")
        _atomic_save(obj, target)
        written.append(target)
    return written


def _local_ordinals(n):
    if not engine.is_spmd():
        return [0]
    from torchacc.sharding import api as runtime_mesh

    return [engine.ordinal(d) for d in runtime_mesh.local_devices()]


def _owned_slices(t, position, n):
    """(slice, [[start, stop], ...], owner ordinal, full shape) for the slices of ``t`` this
    process writes (Note [Per-device checkpoint slices])."""
    shape = tuple(t.shape)
    if not (engine.is_spmd() and t.device.type == DEVICE_TYPE):
        if _is_lead_process():
            yield t.detach().cpu(), [[0, s] for s in shape], position % n, shape
        return
    shards = engine.local_shards(t)
    sharding = engine.sharding_of(t)
    replicas = n
    if sharding is not None:
        indices = sharding.devices_indices_map(shape).values()
        distinct = {tuple(sl.indices(s)[:2] for sl, s in zip(ix, shape)) for ix in indices}
        replicas = n // max(len(distinct), 1)
    for data, index, replica_id, ordinal in shards:
        if replica_id == position % replicas:
            yield data, [[sl.start, sl.stop] for sl in index], ordinal, shape


def _read(path):
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"checkpoint file {path!r} does not exist") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a torchacc.parallel checkpoint ({FORMAT})")
    return obj


def merge_slices(ckpt_files, expected=()):
    """Read slice files and merge them: ``({name: full tensor}, param_groups)``; ``expected``
    names tensors the caller needs (named in the error when their files are missing)."""
    files = [_read(p) for p in ckpt_files]
    if not files:
        raise ValueError("load_distributed_checkpoint: no checkpoint files given")
    n = files[0]["device_num"]
    have = {f["device"] for f in files}
    missing = sorted(set(range(n)) - have)
    shapes, dtypes = {}, {}
    for f in files:
        for name, entry in f["layout"].items():
            shapes[name] = tuple(entry["shape"])
            dtypes[name] = f["tensors"][name].dtype
    merged, covered = {}, {}
    for name, shape in shapes.items():
        merged[name] = torch.empty(shape, dtype=dtypes[name])
        covered[name] = torch.zeros(shape, dtype=torch.bool)
    groups = None
    for f in files:
        groups = f.get("param_groups", groups)
        for name, entry in f["layout"].items():
            index = tuple(slice(a, b) for a, b in entry["index"])
            merged[name][index] = f["tensors"][name]
            covered[name][index] = True
    incomplete = [
        f"{name} {shapes[name]}: {int((~mask).sum())} elements"
        for name, mask in covered.items()
        if not bool(mask.all())
    ]
    incomplete += [f"{name}: absent" for name in expected if name not in shapes]
    if missing or incomplete:
        raise ValueError(
            f"load_distributed_checkpoint: the slice files of device(s) {missing} (of {n} saved) "
            f"are not in ckpt_files; missing slices: {incomplete}"
        )
    return merged, groups


def _copy_into(model, optimizer, merged, groups, where):
    with torch.no_grad():
        targets = dict(model.state_dict(keep_vars=True))
        missing = sorted(k for k in targets if k not in merged)
        if missing:
            raise ValueError(f"{where}: the checkpoint has no {missing}")
        for name, t in targets.items():
            src = merged[name]
            if tuple(src.shape) != tuple(t.shape):
                raise ValueError(
                    f"{where}: {name!r} has shape {tuple(src.shape)} in the checkpoint and "
                    f"{tuple(t.shape)} in the model"
                )
            layout = engine.sharding_of(t) if engine.is_spmd() else None
            t.copy_(src)
            if layout is not None and engine.sharding_of(t) != layout:
                engine.mark(t, layout, where)  # keep the model's current layout
        if optimizer is None:
            return
        if groups is None:
            raise ValueError(f"{where}: the checkpoint was saved without an optimizer")
        state: dict = {}
        for key, v in merged.items():
            if key.startswith(_OPT):
                idx, k = key[len(_OPT) :].split(".", 1)
                state.setdefault(int(idx), {})[k] = v.clone()
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        for p, st in optimizer.state.items():  # optimizer state keeps its parameter's layout
            sharding = engine.sharding_of(p) if engine.is_spmd() else None
            if sharding is None:
                continue
            for v in st.values():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape):
                    engine.mark(v, sharding, "load_distributed_checkpoint")


def load_checkpoint(path, model=None, optimizer=None):
    """The merged tensors ``{name: tensor}`` of a checkpoint (a merged file, or a directory of
    slice files); with ``model``/``optimizer`` also loads them (layouts kept)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".ckpt"))
        merged, groups = merge_slices(files)
    else:
        obj = _read(path)
        merged, groups = obj["tensors"], obj.get("param_groups")
    if model is not None:
        _copy_into(model, optimizer, merged, groups, "load_checkpoint")
    return {k: v for k, v in merged.items() if not k.startswith(_OPT)}


def load_distributed_checkpoint(model, ckpt_files, predict_strategy=None, optimizer=None):
    """Merge the slice files ``ckpt_files`` and load them into ``model`` (and ``optimizer``) for
    the current mode and device count. ``predict_strategy`` ``{parameter name: strategy}`` lays
    those parameters out first (semi-auto/auto modes); other parameters keep their layout."""
    merged, groups = merge_slices(list(ckpt_files), model.state_dict().keys())
    if predict_strategy:
        from torchacc.parallel import context, layout

        if not context.uses_strategies():
            raise ValueError(
                "load_distributed_checkpoint: predict_strategy needs SEMI_AUTO_PARALLEL or "
                f"AUTO_PARALLEL, the mode is {context.mode().value}"
            )
        matrix = context.device_matrix()
        params = dict(model.named_parameters())
        for name, strategy in predict_strategy.items():
            if name not in params:
                raise ValueError(f"load_distributed_checkpoint: predict_strategy names {name!r}")
            p = params[name]
            where = f"predict_strategy[{name!r}]"
            strategy = layout.check_strategy(where, strategy)
            spec = layout.tensor_layout(where, strategy, p.shape, matrix, False)
            layout.place_parameter(p, where, strategy, spec, matrix)
    _copy_into(model, optimizer, merged, groups, "load_distributed_checkpoint")
    return model
