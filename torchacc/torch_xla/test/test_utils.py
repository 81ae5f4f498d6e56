"""``torch_xla.test.test_utils`` on torchacc: the progress-printing and TensorBoard helpers of
torch_xla's example scripts (``print_training_update``, ``print_test_update``, summaries)."""

from __future__ import annotations

import multiprocessing
import time
import unittest
from datetime import datetime

from torchacc.torch_xla import runtime as xr


def mp_test(func):
    """Run a ``unittest.TestCase`` method in a separate process (its exit code must be 0)."""

    def wrapper(*args, **kwargs):
        proc = multiprocessing.Process(target=func, args=args, kwargs=kwargs)
        proc.start()
        proc.join()
        if args and isinstance(args[0], unittest.TestCase):
            args[0].assertEqual(proc.exitcode, 0)
        return proc.exitcode

    return wrapper


def _device_spec(device):
    return f"{device}/{xr.global_ordinal()}"


def write_to_summary(summary_writer, global_step=None, dict_to_write=None, write_xla_metrics=False):
    """Write ``dict_to_write``'s scalars (and, optionally, every counter) to a SummaryWriter."""
    if summary_writer is None:
        return
    for k, v in (dict_to_write or {}).items():
        summary_writer.add_scalar(k, v, global_step)
    if write_xla_metrics:
        from torchacc.torch_xla.debug import metrics as met

        aten_sum = 0
        for name in met.counter_names():
            value = met.counter_value(name)
            if name.startswith("aten::"):
                aten_sum += value
            summary_writer.add_scalar(name, value, global_step)
        summary_writer.add_scalar("aten_ops_sum", aten_sum, global_step)


def close_summary_writer(summary_writer):
    if summary_writer is not None:
        summary_writer.flush()
        summary_writer.close()


def get_summary_writer(logdir):
    """A TensorBoard ``SummaryWriter`` for ``logdir`` (torch's; None when ``logdir`` is empty)."""
    if not logdir:
        return None
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=logdir)
    write_to_summary(writer, 0, dict_to_write={"TensorboardStartTimestamp": time.time()})
    return writer


def now(format="%H:%M:%S"):
    return datetime.now().strftime(format)


def print_training_update(device, step, loss, rate, global_rate, epoch=None, summary_writer=None):
    parts = [
        "Training",
        f"Device={_device_spec(device)}",
        f"Epoch={epoch}" if epoch is not None else None,
        f"Step={step}",
        f"Loss={loss:.5f}",
        f"Rate={rate:.2f}",
        f"GlobalRate={global_rate:.2f}",
        f"Time={now()}",
    ]
    print("|", " ".join(p for p in parts if p), flush=True)
    if summary_writer:
        write_to_summary(
            summary_writer,
            dict_to_write={"examples/sec": rate, "average_examples/sec": global_rate},
        )


def print_test_update(device, accuracy, epoch=None, step=None):
    parts = [
        "Test",
        f"Device={_device_spec(device)}",
        f"Step={step}" if step is not None else None,
        f"Epoch={epoch}" if epoch is not None else None,
        f"Accuracy={accuracy:.2f}" if accuracy is not None else None,
        f"Time={now()}",
    ]
    print("|", " ".join(p for p in parts if p), flush=True)
