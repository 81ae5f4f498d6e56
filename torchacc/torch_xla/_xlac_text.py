"""The pending graph as text for ``torch_xla._XLAC`` on torchacc: torch_xla's IR form
(``_get_xla_tensors_text``) and the HLO of the program torchacc would compile
(``_get_xla_tensors_hlo``, Note [HLO text like torch_xla's]); ``_XLAC`` names them from here so
that its own module stays short."""

from __future__ import annotations

import os
import re

import torch

from torchacc.lazy.device import DEVICE_TYPE


def _values(tensors):
    from torchacc.lazy.record import value_of

    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != DEVICE_TYPE:
            raise RuntimeError(f"expected torchacc tensors, got {type(t).__name__} on {t.device}")
    return [value_of(t) for t in tensors]


def _get_xla_tensors_text(tensors):
    """The pending graph computing ``tensors`` in torch_xla's IR text form: one line per data
    input (``%0 = f32[2,3] xla::device_data()``) and per recorded op (``%2 = f32[2,3]
    aten::add.Tensor(%0, %1)``), in the device's dtypes (Note [Device dtypes]); the line of the
    i-th tensor's value ends with ``, ROOT=i``."""
    return graph_text(_values(tensors))


def graph_text(values):
    """:func:`_get_xla_tensors_text` of the Values ``values``."""
    from torchacc import program as compiler

    pending = [v for v in values if v.node is not None]
    lines = ["IR {"]
    names, where = {}, {}
    n = 0
    if pending:
        graph = compiler.Graph(pending)
        for v in graph.inputs:
            names[id(v)] = f"%{n}"
            where[id(v)] = len(lines)
            lines.append(f"  %{n} = {_desc_text(v.desc)} xla::device_data()")
            n += 1
        for node in graph.order:
            args = ", ".join(_ref(v, names) for v in node.inputs)
            names[id(node)] = f"%{n}"
            where[id(node)] = len(lines)
            outs = [_desc_text(d) for d in node.op.descs if d is not None]
            outs = outs[0] if len(outs) == 1 else f"({', '.join(outs)})"
            lines.append(f"  %{n} = {outs} {_op_text(node.op.rule.name)}({args})")
            n += 1
    for i, v in enumerate(values):
        key = id(v) if v.node is None else id(v.node)
        if key not in where:  # a computed tensor: a data input of no pending graph
            names[key] = f"%{n}"
            where[key] = len(lines)
            lines.append(f"  %{n} = {_desc_text(v.desc)} xla::device_data()")
            n += 1
        lines[where[key]] += f", ROOT={i}"
    lines.append("}")
    return "\n".join(lines) + "\n"


def _ref(value, names):
    """``%n`` for a data input or a one-output node's value, ``%n.i`` for output i of several."""
    if value.node is None:
        return names[id(value)]
    several = sum(d is not None for d in value.node.op.descs) > 1
    return f"{names[id(value.node)]}.{value.index}" if several else names[id(value.node)]


def _desc_text(desc):
    from torchacc.lowering.dtypes import HLO_NAMES, TORCH_TO_JAX, stored_dtype

    shape, dtype = desc[0], desc[2]
    if dtype in TORCH_TO_JAX:
        dtype = stored_dtype(dtype)  # what the device holds (Note [Device dtypes])
    name = HLO_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    return f"{name}[{','.join(map(str, shape))}]"


def _op_text(rule_name):
    """``aten.add.Tensor`` -> ``aten::add.Tensor`` (torch_xla's IR names ops ``aten::add``)."""
    namespace, _, rest = rule_name.partition(".")
    return f"{namespace}::{rest}" if rest else rule_name


def _get_xla_tensors_hlo(tensors):
    """The program torchacc would compile for the pending ``tensors``, as HLO text before SPMD
    partitioning (the form torch_xla prints: ``f32[2,3]{1,0} multiply(...)``; after XLA's
    optimizations and partitioning with XLA_DUMP_POST_OPTIMIZATIONS=1): in SPMD mode the
    parameters carry their shardings and a ``mark_sharding`` of a pending value is a
    ``custom_call_target="Sharding"`` (Note [HLO text like torch_xla's]). Tensors with nothing
    pending give the program that returns their data (their parameters and shardings)."""
    return graph_hlo(_values(tensors))


def graph_hlo(values):
    """:func:`_get_xla_tensors_hlo` of the Values ``values``."""
    import jax

    fn, args, _ = program_of_values(values)
    if fn is None:
        return ""
    lowered = jax.jit(fn).lower(*args)
    if os.environ.get("XLA_DUMP_POST_OPTIMIZATIONS", "").lower() in ("1", "true"):
        # torch_xla's switch for the optimized program: here XLA's compiled (partitioned) HLO
        return _v1_shardings(lowered.compile().as_text(), _device_assignment(lowered))
    module = lowered.compiler_ir(dialect="hlo").get_hlo_module()
    text = _names_by_opcode(module.to_string(_hlo_print_options()))
    return _v1_shardings(text, _device_assignment(lowered))


def program_of_tensors(tensors):
    """``(fn, args, params)``: the program computing the pending ``tensors`` and its arguments
    (the float64 and int64 runtime scalar vectors, then the packs' and loose inputs' arrays), or,
    with nothing pending, the program returning their data; ``params`` has per argument what it
    holds (a scalar vector: None, a pack, a data Value). ``(None, [], [])`` for no data."""
    return program_of_values(_values(tensors))


def program_of_values(values):
    """:func:`program_of_tensors` of the Values ``values``."""
    import numpy as np

    from torchacc import program as compiler
    from torchacc.program.build import program_of

    pending = [v for v in values if v.node is not None]
    if pending:
        graph = compiler.Graph(pending)
        args = [np.asarray(graph.floats, dtype=np.float64), np.asarray(graph.ints, dtype=np.int64)]
        args += [p.array for p in graph.packs] + [v.array for v in graph.loose]  # logical, padded
        return program_of(graph), args, [None, None, *graph.packs, *graph.loose]
    seen = {}
    for v in values:
        a = v.array
        if a is not None and id(a) not in seen:
            seen[id(a)] = (a, v)
    if not seen:
        return None, [], []

    def fn(*arrays):
        return list(arrays)

    return fn, [a for a, _ in seen.values()], [v for _, v in seen.values()]


# Note [HLO text like torch_xla's]
# torch_xla's tests grep the HLO of a pending graph for what its XlaBuilder wrote. torchacc's is
# the real program JAX lowers (before SPMD partitioning), printed so that the same facts read the
# same way: instructions named after their opcode (``%add.1``), parameters ``%p<number>.<k>``,
# shardings in the V1 form with device ordinals (``{devices=[1,4]0,1,2,3}``, as
# ``_get_xla_sharding_spec`` says; JAX prints the iota form ``{devices=[1,4]<=[4]}``) and no
# Shardy attributes. Nothing is added that the program does not hold.

_IOTA = re.compile(r"devices=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_SDY = re.compile(r', frontend_attributes=\{xla\.sdy\.[^"]*"(?:[^"\\]|\\.)*"\}')
_MODULE_SDY = re.compile(r", frontend_attributes=\{xla\.sdy\.meshes=.*\}$", re.M)


def _device_assignment(lowered):
    """Global ordinals of the lowered program's devices, by position (None if unknown)."""
    try:
        from torchacc.sharding import api as engine

        devices = lowered._lowering.compile_args["device_assignment"]
        return [engine.ordinal(d) for d in devices]
    except Exception:
        return None


def _v1_shardings(text, ordinals):
    import numpy as np

    def expand(m):
        dims = m.group(1)
        shape = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(int(np.prod(shape))).reshape(shape)
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        ids = ids.reshape(-1).tolist()
        if ordinals is not None and len(ordinals) >= len(ids):
            ids = [ordinals[i] for i in ids]
        return f"devices=[{dims}]{','.join(str(i) for i in ids)}"

    text = _MODULE_SDY.sub("", _SDY.sub("", text))
    return _IOTA.sub(expand, text)


_DEFINITION = re.compile(r"^\s*(?:ROOT )?%([^\s=]+) = .*? ([a-z][a-z0-9-]*)\(", re.M)
_NAME = re.compile(r"%([^\s,()={}]+)")
_SIGNATURE = re.compile(r"^((?:ENTRY )?%\S+ )(\(.*\) -> )", re.M)
_PARAM = re.compile(r"([^\s,():]+):")
_PARAMETER = re.compile(r"(\d+)\)")


def _names_by_opcode(text):
    """Rename each instruction after its opcode (``%exponential.3``), as torch_xla's HLO (built
    by XlaBuilder) names them; JAX names them after its primitives (``%exp.1``)."""
    renames, counts = {}, {}
    for m in _DEFINITION.finditer(text):
        opcode = m.group(2)
        counts[opcode] = counts.get(opcode, 0) + 1
        renames[m.group(1)] = f"{opcode}.{counts[opcode]}"
        if opcode == "parameter":  # torch_xla's p<number>
            number = _PARAMETER.match(text, m.end())
            if number is not None:
                renames[m.group(1)] = f"p{number.group(1)}.{counts[opcode]}"
    text = _SIGNATURE.sub(
        lambda m: (
            m.group(1) + _PARAM.sub(lambda p: renames.get(p.group(1), p.group(1)) + ":", m.group(2))
        ),
        text,
    )
    return _NAME.sub(lambda m: "%" + renames.get(m.group(1), m.group(1)), text)


def _hlo_print_options():
    """torch_xla's HLO text form: ``%name = f32[2]{0} add(f32[2]{0} %a, f32[2]{0} %b)``
    (operand shapes and ``%`` names; no source metadata)."""
    from jaxlib import _hlo

    options = _hlo.HloPrintOptions()
    options.print_operand_shape = True
    options.print_percent = True
    options.print_metadata = False
    return options
