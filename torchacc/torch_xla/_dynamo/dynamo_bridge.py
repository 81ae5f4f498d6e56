"""``torch_xla._dynamo.dynamo_bridge`` on torchacc: what torch's ``"openxla"`` backend calls.

torch's ``backend="openxla"`` (torch/_dynamo/backends/torchxla.py) runs AOTAutograd and hands
each forward/backward graph, with its first real arguments, to ``extract_compiled_graph``. On
torchacc that graph is lowered by the trace-once frontend like a ``backend="torchacc"`` graph
(torchacc/dynamo/lower.py: one jitted program per lowerable run, torchacc tensors in and out,
their shardings kept in SPMD mode; Note [torch.compile over torchacc tensors]). Counted as
``DynamoExtractCompiledGraph``, as in torch_xla.
"""

from __future__ import annotations

from torchacc import metrics


def extract_compiled_graph(xla_model, xla_args):
    """A callable running FX graph ``xla_model`` (AOTAutograd's) on arguments like ``xla_args``."""
    from torchacc.dynamo.aot import lower_graph

    metrics.counter_inc("DynamoExtractCompiledGraph")
    return lower_graph(xla_model, list(xla_args), "openxla")


__all__ = ["extract_compiled_graph"]
