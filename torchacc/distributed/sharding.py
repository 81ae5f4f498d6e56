"""``torchacc.distributed.sharding``: the sharding engine's API, now ``torchacc.sharding.api``
(this name stays for scripts that import it)."""

import sys

from torchacc.sharding import api

sys.modules[__name__] = api
