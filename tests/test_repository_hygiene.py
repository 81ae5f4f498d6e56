"""The repository holds source and documentation only: no binary artefact is tracked (a wheel,
a shared library, an archive, a checkpoint, a profile); ``.gitignore`` keeps the usual ones out."""

from __future__ import annotations

import subprocess

import pytest
from gallery_harness import ROOT

MAX_BYTES = 512 * 1024  # the largest tracked text file is far below this


def _tracked() -> list[str]:
    try:
        p = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, timeout=60, check=True
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout ({e})")
    return [f for f in p.stdout.decode().split("\0") if f]


def test_no_binary_file_is_tracked():
    offenders = []
    for name in _tracked():
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        with open(path, "rb") as f:
            head = f.read(8192)
        size = path.stat().st_size
        if b"\0" in head:
            offenders.append(f"{name}: binary ({size:,} bytes)")
        elif size > MAX_BYTES:
            offenders.append(f"{name}: {size:,} bytes (> {MAX_BYTES:,})")
    assert offenders == [], "binary artefacts are tracked; remove them: " + "; ".join(offenders)


def test_gitignore_keeps_binary_artefacts_out():
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", "py_spy-0.4.3-py2.py3-none-any.whl", "lib.so",
         "m.pt", "runs/events.out.tfevents.1.host", "p/plugins/profile/x/host.xplane.pb"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if ignored.returncode not in (0, 1):
        pytest.skip(f"git check-ignore failed: {ignored.stderr.strip()}")
    assert len(ignored.stdout.splitlines()) == 5, ignored.stdout
