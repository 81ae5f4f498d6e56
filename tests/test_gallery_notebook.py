"""gallery/resnet50/resnet50.ipynb runs end to end (tiny sizes) under a Jupyter kernel."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import eager_device_type
from gallery_harness import ROOT, child_env

# TODO(issue 5): flip to True once --compiler-opt trains (torchacc.torch_xla compat + xla backend):
# the notebook's "torchacc" cells then run too and the comparison table gets a speedup column.
RUN_COMPILER_CELLS = True

NOTEBOOK = ROOT / "gallery" / "resnet50" / "resnet50.ipynb"


def test_notebook_matches_its_builder():
    nbformat = pytest.importorskip("nbformat")
    from gallery.resnet50.make_notebook import build

    on_disk = nbformat.read(str(NOTEBOOK), as_version=4)
    nbformat.validate(on_disk)
    built = build()
    assert [c.source for c in on_disk.cells] == [c.source for c in built.cells], (
        "resnet50.ipynb is stale: run python -m gallery.resnet50.make_notebook"
    )
    tags = [c.metadata["tags"][0] for c in on_disk.cells]
    assert {"setup", "prepare", "baseline", "torchacc", "compare", "curves", "accelerate"} <= set(
        tags
    )


def readme_notebook_command() -> str:
    """The headless notebook command of the README's Quickstart, exactly as written there."""
    text = (ROOT / "README.md").read_text()
    found = [ln for ln in text.splitlines() if ln.startswith("TORCHACC_NB_TINY=1 jupyter execute")]
    assert len(found) == 1, "the README's headless notebook command is gone"
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_notebook_executes(tmp_path):
    """The README's headless command runs the notebook end to end (tiny sizes); its outputs."""
    nbformat = pytest.importorskip(
        "nbformat", reason="nbformat not installed (pip install .[test])"
    )
    if shutil.which("jupyter-execute") is None:
        pytest.skip("jupyter execute (nbclient) not installed (pip install .[test])")
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        pytest.skip("no Jupyter python3 kernel (pip install .[test] installs ipykernel)")

    command = readme_notebook_command()
    env = child_env({"TMPDIR": str(tmp_path), "TORCHACC_NB_WORKDIR": str(tmp_path / "work")})
    p = subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    assert p.returncode == 0, p.stderr[-6000:]
    nb = nbformat.read(str(tmp_path / "resnet50-tiny.ipynb"), as_version=4)
    if not RUN_COMPILER_CELLS:
        nb.cells = [c for c in nb.cells if "torchacc" not in c.metadata.get("tags", [])]

    text = {}
    for cell in nb.cells:
        if cell.cell_type == "code":
            text[cell.metadata["tags"][0]] = "".join(o.get("text", "") for o in cell.outputs)
    assert "wrote 8 " in text["prepare"] and " images in 4 classes" in text["prepare"]
    assert f"[summary] resnet-tiny eager x1 {eager_device_type()} O0/fp32" in text["baseline"]
    assert "baseline_1p" in text["compare"]
    assert (tmp_path / "work" / "baseline_1p.json").exists()
    if RUN_COMPILER_CELLS:
        assert "[summary] resnet-tiny torchacc x1" in text["torchacc"]
        assert "torchacc_1p" in text["compare"]
    # accelerate(): the LLaMA page's side-by-side table, both backends
    table = text["accelerate"]
    assert "| backend | step ms (median) | programs |" in table
    assert "| eager |" in table and "| lazy |" in table
    # the parallel axes side by side on 4 CPU devices: each mesh's loss equals eager's
    axes = text["axes"]
    for name in ("dp 2 x fsdp 2", "fsdp 4", "tp 4", "cp 4 (sp)"):
        (row,) = [ln for ln in axes.splitlines() if ln.startswith(f"| {name} |")]
        assert float(row.split("|")[4]) <= 1e-5, row
    assert "all-to-all" in axes and "| tp 4 | " in axes
    # the curves of both runs, read back from their TensorBoard event files (4 steps each)
    pytest.importorskip("tensorboard", reason="tensorboard not installed (pip install .[test])")
    runs = ["baseline_1p", "torchacc_1p"] if RUN_COMPILER_CELLS else ["baseline_1p"]
    for name in runs:
        assert f"{name}: 4 loss points, equal to its --output losses: True" in text["curves"]
    (curves,) = [c for c in nb.cells if c.cell_type == "code" and "curves" in c.metadata.tags]
    assert any("image/png" in o.get("data", {}) for o in curves.outputs)  # the figure
