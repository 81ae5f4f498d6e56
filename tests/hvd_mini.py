"""A tiny torchacc.horovod script for the launcher tests (torchaccrun, a real mpirun).

    python tests/hvd_mini.py OUT [fail-rank]

Every rank averages ``rank + 1`` on CPU and on the torchacc device and writes
``OUT/mini-<rank>.json``; with ``fail-rank`` that rank exits with code 3 instead and the others
wait in ``hvd.init()`` and then a minute (the launcher must stop them).
"""

import json
import os
import sys
import time

import torch

import torchacc
import torchacc.horovod as hvd

if len(sys.argv) > 2:  # before hvd.init(): the other ranks then wait there to be stopped
    if os.environ["RANK"] == sys.argv[2]:
        sys.exit(3)
    hvd.init()
    time.sleep(60)
hvd.init()
out, me = sys.argv[1], hvd.rank()
x = torch.tensor([float(me + 1)])
want = sum(range(1, hvd.size() + 1)) / hvd.size()
cpu = hvd.allreduce(x).item()
dev = hvd.allreduce(x.to(torchacc.device())).cpu().item()
assert cpu == want and dev == want, (cpu, dev, want)
info = {
    "rank": me,
    "size": hvd.size(),
    "local_rank": hvd.local_rank(),
    "port": os.environ["MASTER_PORT"],
    "average": cpu,
}
with open(os.path.join(out, f"mini-{me}.json"), "w") as f:
    json.dump(info, f)
