"""``torch_xla.core.dynamo_bridge``: the old import path of ``torch_xla._dynamo.dynamo_bridge``
(torch's ``"openxla"`` backend imports it from here)."""

from torchacc.torch_xla._dynamo.dynamo_bridge import extract_compiled_graph  # noqa: F401

__all__ = ["extract_compiled_graph"]
