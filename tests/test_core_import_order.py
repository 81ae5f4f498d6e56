"""Backward works on the torchacc device whether a backward ran before `import torchacc` or not.

See Note [Autograd engine sized before torchacc registered] in torchacc/lazy/autograd_engine.py.
Each case runs in a fresh process: the autograd engine sizes its device queues once per process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from gallery_harness import child_env

EAGER_BACKWARD = """
x = torch.randn(3, requires_grad=True); (x * 2).sum().backward()
assert x.grad.tolist() == [2.0, 2.0, 2.0]
"""

TORCHACC_BACKWARD = """
import threading
import torchacc
from torchacc.lazy import autograd_engine as _autograd_engine
dev = torchacc.device()
w = torch.randn(3, requires_grad=True, device=dev); (w * 2).sum().backward()
result = {"grad": w.grad.cpu().tolist()}
def other_thread():
    v = torch.ones(2, requires_grad=True, device=dev)
    (g,) = torch.autograd.grad((v * v).sum(), v)
    result["thread_grad"] = g.cpu().tolist()
t = threading.Thread(target=other_thread); t.start(); t.join()
y = torch.randn(2, requires_grad=True); (y * 5).sum().backward()  # eager still fine
result["eager_after"] = y.grad.tolist()
result["caller_thread"] = _autograd_engine.caller_thread_backward()
result["cuda"] = torch.cuda.is_available()
print("RESULT " + json.dumps(result))
"""


def _run(body: str) -> dict:
    code = "import json, torch\n" + textwrap.dedent(body)
    p = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("eager_first", [True, False], ids=["backward-then-import", "import-first"])
def test_backward_works_in_either_import_order(eager_first):
    body = EAGER_BACKWARD + TORCHACC_BACKWARD if eager_first else TORCHACC_BACKWARD + EAGER_BACKWARD
    r = _run(body)
    assert r["grad"] == [2.0, 2.0, 2.0]
    assert r["thread_grad"] == [2.0, 2.0]  # a backward from another thread works too
    assert r["eager_after"] == [5.0, 5.0]
    # The engine's queues are only missing when a backward ran before torchacc registered and no
    # other accelerator (CUDA) had sized them; only then does backward move to the caller thread.
    assert r["caller_thread"] == (eager_first and not r["cuda"])
