"""``torch_xla._XLAC.lowering``: ``LoweringContext``, the program of some pending tensors and its
parameters, and ``_get_graph_hash``.

torch_xla lowers the pending graph of the tensors given to ``build`` into one XLA computation
whose parameters are the device data it reads. torchacc's is the program its sync would compile
for those tensors (``_xlac_text.program_of_tensors``): parameters 0 and 1 are torchacc's two
runtime scalar vectors (float64, int64: Note [What a compiled step is keyed on] in
program/key.py), then the inputs' data (packs, then loose arrays) in the program's order. The
parameter mappings hold only the data parameters, as device tensors (no transfer) or CPU copies.
"""

from __future__ import annotations

import hashlib
import weakref

from torchacc.torch_xla._api import differs
from torchacc.torch_xla._xlac_text import _values, program_of_tensors

__all__ = ["LoweringContext"]

_NOTE = (
    "the program torchacc's sync would compile for the tensors: parameters 0 and 1 are its "
    "runtime scalar vectors; hlo_text() is HLO text (not the proto's text format); hlo_json() "
    "is not implemented"
)

# the coverage table's mark of the module (torchacc/torch_xla/_api.py's STATUS_ATTR)
__torchacc_status__ = ("differs", "LoweringContext: " + _NOTE)


@differs(_NOTE)
class LoweringContext:
    """The program computing some pending tensors (``build``), as HLO, with its parameters."""

    def __init__(self, name="LoweringContext", device=None):
        self._name = str(name)
        self._fn = None
        self._args = []
        self._params = []
        self._names = weakref.WeakKeyDictionary()  # tensor -> name

    def build(self, tensors, additional_inputs_list=()):
        """Lower the pending graph computing ``tensors`` (data tensors: the program returning
        them). ``additional_inputs_list`` is not supported (a ``ValueError`` if given)."""
        if additional_inputs_list:
            raise ValueError(
                "LoweringContext.build: additional_inputs_list is not supported by torchacc "
                f"(got {len(additional_inputs_list)} tensors); pass every tensor to compute"
            )
        self._fn, self._args, self._params = program_of_tensors(list(tensors))

    def _lowered(self):
        import jax

        if self._fn is None:
            raise RuntimeError(
                "LoweringContext: build(tensors) first (or the tensors held no data)"
            )
        fn = self._fn

        def program(*args):
            return fn(*args)

        program.__name__ = self._name  # the module's name in the HLO (torch_xla: the context's)
        return jax.jit(program, keep_unused=True).lower(*self._args)

    def hlo(self):
        """The serialized ``HloModuleProto``."""
        return self._lowered().compiler_ir(dialect="hlo").as_serialized_hlo_module_proto()

    def hlo_text(self):
        """The program as HLO text (torch_xla's parameter shardings in their V1 form)."""
        from torchacc.torch_xla import _xlac_text as form

        lowered = self._lowered()
        module = lowered.compiler_ir(dialect="hlo").get_hlo_module()
        text = form._names_by_opcode(module.to_string(form._hlo_print_options()))
        return form._v1_shardings(text, form._device_assignment(lowered))

    def hlo_json(self):
        raise NotImplementedError(
            "LoweringContext.hlo_json: the JSON form of the HloModuleProto is not implemented; "
            "hlo() gives the serialized proto and hlo_text() the HLO text"
        )

    def device_parameter_id_tensor_mapping(self):
        """{parameter number: device tensor with its data} for the data parameters (no
        transfer: the tensors share the parameters' arrays)."""
        from torchacc.ir import Value, contiguous_desc
        from torchacc.lazy.record import fresh

        out = {}
        for i, p in enumerate(self._params):
            if p is None:  # a runtime scalar vector
                continue
            if isinstance(p, Value):
                desc = contiguous_desc(tuple(p.desc[0]), p.desc[2])
            else:  # a pack: one flat array of several small values
                desc = contiguous_desc((p.size,), p.dtype)
            out[i] = fresh(Value(desc, array=p.array))
        return out

    def parameter_id_tensor_mapping(self):
        """{parameter number: CPU copy of its data} for the data parameters."""
        return {i: t.cpu() for i, t in self.device_parameter_id_tensor_mapping().items()}

    def tensor_parameter_id(self, tensor):
        """The parameter number holding ``tensor``'s data, or -1 (not an input of the program,
        say a pending value it computes)."""
        from torchacc.lazy.record import value_of

        value = value_of(tensor)
        buf = value.buf if value.node is None else None
        for i, p in enumerate(self._params):
            if p is None:
                continue
            if p is value or (type(buf) is tuple and buf[0] is p):
                return i
        return -1

    def set_name_string(self, tensor, name):
        self._names[tensor] = str(name)

    def get_name_string(self, tensor):
        return self._names.get(tensor, "")


def _get_graph_hash(tensors):
    """A 16-byte hash of the program computing the pending ``tensors`` (as torch_xla's): its ops
    with their static signatures, how they connect, the inputs' shapes and dtypes and, in SPMD
    mode, the inputs' shardings. Equal for equal graphs in this process; tensors with nothing
    pending hash their shapes and layouts."""
    from torchacc import program as compiler
    from torchacc.sharding import api as engine

    values = _values(list(tensors))
    pending = [v for v in values if v.node is not None]
    parts = []
    if pending:
        graph = compiler.Graph(pending)
        for node in graph.order:
            parts.append(repr(node.op.key))
            parts.append(
                repr([v.slot if v.node is None else v.node.slot + v.index for v in node.inputs])
            )
        parts.append(repr(graph.out_slots))
        inputs = graph.inputs
    else:
        inputs = values
    for v in inputs:
        parts.append(repr(v.desc))
        if engine.is_spmd() and v.node is None:
            parts.append(engine.hlo_text(getattr(v.array, "sharding", None), len(v.desc[0])))
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).digest()
