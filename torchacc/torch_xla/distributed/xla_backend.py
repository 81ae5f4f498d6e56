"""``torch_xla.distributed.xla_backend`` on torchacc: importing it registers the ``"xla"``
torch.distributed backend (see ``torchacc.distributed.xla_backend``)."""

from torchacc.distributed.xla_backend import ProcessGroupXla  # noqa: F401  (registers "xla")
