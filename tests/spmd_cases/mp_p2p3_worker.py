"""One rank of a 3-process SPMD job (2 CPU devices each): blocking ``dist.send``/``recv`` on the
``xla`` process group between two of the ranks while the third takes no part (Note [Send and
receive in SPMD mode] in torchacc/sharding/point_to_point.py). Not collected by the suite (a
3-process launch costs ~15 CPU-s; tests/test_sharding_regions.py checks the same exchange in a
2 x 2 job); run it by hand:

    PYTHONPATH=.:tests JAX_PLATFORMS=cpu PJRT_DEVICE=CPU CPU_NUM_DEVICES=2 python -m \\
        torch.distributed.run --nproc_per_node=3 --master_addr=127.0.0.1 \\
        tests/spmd_cases/mp_p2p3_worker.py

Each rank prints ``P2P rank <r>: <checks>`` and exits 0.
"""

import numpy as np
import torch
import torch.distributed as dist

import torchacc.torch_xla.runtime as xr

xr.use_spmd()

import torchacc  # noqa: E402
import torchacc.distributed.xla_backend  # noqa: E402, F401
import torchacc.torch_xla.distributed.spmd as xs  # noqa: E402

dist.init_process_group(backend="xla", init_method="env://")
W, r = dist.get_world_size(), dist.get_rank()
assert W > 2, W
dev = torchacc.device()
n = xr.global_runtime_device_count()
checks = []


def close(t, want, what):
    got = t.cpu()
    assert torch.equal(got, want), (what, r, got, want)


# a replicated tensor from rank 0 to the last rank and back doubled; rank 1 takes no part
buf = torch.full((3,), -1.0).to(dev)
if r == 0:
    dist.send((torch.arange(3.0) + 7).to(dev), dst=W - 1)
elif r == W - 1:
    dist.recv(buf, src=0)
    close(buf, torch.arange(3.0) + 7, "recv from rank 0")
if r == W - 1:
    dist.send(buf * 2, dst=0)
elif r == 0:
    dist.recv(buf, src=W - 1)
    close(buf, (torch.arange(3.0) + 7) * 2, "recv back")
checks.append("replicated")
# split over each process's local devices (a mesh row per process): rank 1 to rank 0
mesh = xs.Mesh(np.arange(n), (W, n // W), ("dp", "fsdp"))
x = (torch.arange(8.0).reshape(4, 2) + 100 * r).to(dev)
xs.mark_sharding(x, mesh, ("fsdp", None))
y = torch.zeros(4, 2).to(dev)
xs.mark_sharding(y, mesh, ("fsdp", None))
if r == 1:
    dist.send(x, dst=0)
elif r == 0:
    dist.recv(y, src=1)
    close(y, torch.arange(8.0).reshape(4, 2) + 100, "split recv")
checks.append("split")
# a receive buffer of another layout: a ValueError on both peers
if r in (0, 1):
    try:
        if r == 1:
            dist.send(x, dst=0)
        else:
            dist.recv(torch.zeros(4, 2).to(dev), src=1)
        raise AssertionError("a buffer of another layout was accepted")
    except ValueError as e:
        assert "same shape, dtype and layout" in str(e), e
    checks.append("other layout")
print(f"P2P rank {r}: {checks}", flush=True)
