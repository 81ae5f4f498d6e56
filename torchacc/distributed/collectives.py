"""``torchacc.distributed.collectives``: the collectives on torchacc tensors, now
``torchacc.sharding.collectives`` (this name stays for scripts and ``xm`` that import it)."""

import sys

from torchacc.sharding import collectives

sys.modules[__name__] = collectives
