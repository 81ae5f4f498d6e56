"""One benchmark run in this process: the launcher's in-place path plus compiler counters.

``python benchmarks/_worker.py METRICS_JSON -- <launch_single_task.py flags>``

With one process the launcher runs the gallery worker in place (RANK/WORLD_SIZE/LOCAL_RANK are
set here), so after training this wrapper can read what the metrics JSON of the launcher lacks:
``torchacc.metrics`` (compiles, cache hits, trace/execute/sync time per mark_step) and, for
``--torch_compile``, Dynamo's counters (graphs, recompiles), and the FLOPs of the last launched
program (``step_flops``: a training step's, from XLA's cost analysis). Written even when training
fails.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _torchacc_metrics() -> dict | None:
    m = sys.modules.get("torchacc.metrics")
    if m is None:
        return None
    out = {"counters": {n: m.counter_value(n) for n in m.counter_names()}, "timings": {}}
    for name in m.metric_names():
        data = m.metric_data(name)
        if data:
            out["timings"][name] = data[2]
    out["fallback_ops"] = m.executed_fallback_ops()
    if hasattr(m, "last_program_flops"):  # Note [Step FLOPs] in torchacc/metrics.py
        out["step_flops"] = m.last_program_flops()
        out["executed_flops"] = m.executed_flops()
    return out


def _dynamo_metrics() -> dict | None:
    if "torch._dynamo" not in sys.modules:
        return None
    try:
        from torch._dynamo.utils import counters
    except Exception:
        return None
    return {group: dict(values) for group, values in counters.items() if values}


def main() -> int:
    metrics_path = sys.argv[1]
    argv = sys.argv[3:] if sys.argv[2:3] == ["--"] else sys.argv[2:]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    sys.path.insert(0, ROOT)
    from gallery.common.launchlib import torchacc_launch

    rc, error = 1, None
    try:
        rc = torchacc_launch().main(argv)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised via the exit code
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
    finally:
        payload = {"torchacc": _torchacc_metrics(), "dynamo": _dynamo_metrics(), "error": error}
        with open(metrics_path, "w") as f:
            json.dump(payload, f, default=str)
    return rc if error is None else 1


if __name__ == "__main__":
    sys.exit(main())
