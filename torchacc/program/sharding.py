"""Shardings of a step's program in SPMD mode: what its inputs and results are laid out as.

Note [SPMD mode] is in torchacc/runtime/mesh.py. Here, for one program:

- every array argument keeps the sharding it has (an argument on another mesh or on a single
  device, say the result of ``call_jax``, is first moved onto the engine mesh, replicated), and the
  two scalar vectors are replicated;
- every result that overwrites a tensor's previous data (its storage's ``start``: a parameter, an
  optimizer moment, a running statistic) keeps that data's sharding, so state does not drift to
  another layout between steps (which would compile a second program and move data every step);
  other results are left to XLA's sharding propagation;
- both go into the program's key, and the argument shardings into a known step's launch key.
"""

from __future__ import annotations

import jax

from torchacc.runtime import mesh


def active():
    return mesh._state.on


def normalize(loose):
    """Move loose input Values whose arrays are not on the engine mesh onto it (replicated)."""
    engine = mesh.engine_mesh()
    for v in loose:
        a = v.buf
        s = getattr(a, "sharding", None)
        if isinstance(s, jax.sharding.NamedSharding) and mesh.same_devices(s.mesh, engine):
            continue
        if isinstance(s, jax.sharding.NamedSharding):
            spec = s.spec
            names = set(engine.axis_names)
            used = {n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))}
            if not used <= names or s.mesh.devices.shape != engine.devices.shape:
                raise ValueError(
                    f"torchacc SPMD: a tensor of shape {tuple(a.shape)} is sharded as {spec} over "
                    f"mesh {dict(s.mesh.shape)} (devices {[d.id for d in s.mesh.devices.flat]}), "
                    f"but the step runs on mesh {dict(engine.shape)} (devices "
                    f"{[d.id for d in engine.devices.flat]}); use one mesh for a step's tensors"
                )
            v.buf = jax.device_put(a, jax.sharding.NamedSharding(engine, spec))
        else:
            v.buf = jax.device_put(a, mesh.replicated())


def in_shardings(arrays):
    """Shardings of a program's arguments: the two scalar vectors, then ``arrays``."""
    rep = mesh.replicated()
    return (rep, rep, *[a.sharding for a in arrays])


def out_shardings(outputs, starts):
    """Per result, the sharding of the data its storage held before the step, else None."""
    if starts is None:
        return (None,) * len(outputs)
    result = []
    for v, start in zip(outputs, starts):
        a = None if start is None else start.buf
        s = getattr(a, "sharding", None)
        result.append(s if s is not None and tuple(a.shape) == tuple(v.desc[0]) else None)
    return tuple(result)


def launch_key(loose):
    """The part of a known step's launch key that SPMD adds: its arguments' shardings."""
    if not mesh._state.on:
        return ()
    return tuple([getattr(v.buf, "sharding", None) for v in loose])
