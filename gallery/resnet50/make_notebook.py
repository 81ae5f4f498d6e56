"""Build ``resnet50.ipynb`` (the DSW/Jupyter walk-through) with nbformat.

    python -m gallery.resnet50.make_notebook          # rewrites gallery/resnet50/resnet50.ipynb

The notebook's cells carry tags: ``setup``, ``prepare``, ``baseline``, ``torchacc``, ``compare``,
``curves`` (the runs' TensorBoard scalars, read back from their event files), ``accelerate``
(TorchAcc's ``ta.accelerate`` front door: the LLaMA gallery model on variable-length batches with
bucketing, eager and lazy side by side) and ``axes`` (dp, fsdp, tp and cp side by side on 4 CPU
devices, gallery/accelerate/axes.py).
"""

from __future__ import annotations

import os
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

INTRO = """\
# TorchAcc: accelerating ResNet-50 distributed training

This notebook follows the PAI TorchAcc ResNet-50 example: it prepares a mock ImageNet-like data
set, trains ResNet-50 with plain PyTorch (the **baseline**: eager + DDP + AMP O1) and with
**TorchAcc** (`--compiler-opt`: the same training step compiled through XLA + AMP O1), then
compares throughput and memory.

The four runs of the original example are, from a terminal in the checkout root:

```bash
# PyTorch eager (baseline), one GPU and eight GPUs
python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --batch_size=128
python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --batch_size=128
# TorchAcc (PAI-Opt), one GPU and eight GPUs
python launch_single_task.py --nproc_per_node=1 --amp_level=O1 --compiler-opt --batch_size=128
python launch_single_task.py --nproc_per_node=8 --amp_level=O1 --compiler-opt --batch_size=128
```

`--batch_size` is per process: lower it on GPUs with less memory. `--nproc_per_node` can be
anything from 1 to the number of GPUs of the machine. The cells below run the same commands with
a fixed number of steps and collect each run's metrics (`--output run.json`) and, when the
`tensorboard` package is installed, its TensorBoard scalars (`--tensorboard DIR`): section 5
draws the loss and throughput curves of the runs from those event files."""

SETUP = """\
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

# The checkout root: the directory holding launch_single_task.py.
ROOT = pathlib.Path.cwd().resolve()
while not (ROOT / "launch_single_task.py").exists() and ROOT != ROOT.parent:
    ROOT = ROOT.parent
LAUNCHER = ROOT / "launch_single_task.py"
WORK = pathlib.Path(os.environ.get("TORCHACC_NB_WORKDIR", "work")).resolve()
WORK.mkdir(parents=True, exist_ok=True)

try:
    import torch

    NUM_GPUS = torch.cuda.device_count()
except ImportError:
    NUM_GPUS = 0

TINY = os.environ.get("TORCHACC_NB_TINY") == "1"  # seconds on a CPU (used by the tests)
if TINY:  # resnet-tiny: ResNet-50's code with 2-1-1-1 blocks (half of ResNet-50's compile)
    BATCH_SIZE, IMAGE_SIZE, STEPS, NUM_IMAGES, NUM_CLASSES = 2, 32, 4, 8, 4
    PROCS = [1]
    EXTRA = ["--model=resnet-tiny", "--amp_level=O0", "--workers=0", "--log_interval=1"]
else:
    BATCH_SIZE, IMAGE_SIZE, STEPS, NUM_IMAGES, NUM_CLASSES = 128, 224, 300, 5000, 1000
    PROCS = sorted({1, max(NUM_GPUS, 1)})  # one process, then one per GPU
    EXTRA = ["--amp_level=O1", "--log_interval=20"]
DATA = WORK / "mock_imagenet"
TB = WORK / "tensorboard"  # one TensorBoard run per launch: tensorboard --logdir work/tensorboard
HAVE_TB = importlib.util.find_spec("tensorboard") is not None
RESULTS = {}


def run(cmd, cwd=ROOT):
    \"\"\"Run a command, streaming its output into the notebook; raise if it fails.\"\"\"
    print("$", " ".join(str(c) for c in cmd), flush=True)
    cmd = [str(c) for c in cmd]
    out = subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"command failed with exit code {proc.returncode}")


def launch(name, *flags):
    \"\"\"launch_single_task.py with `flags`; returns and records the run's metrics.\"\"\"
    out = WORK / f"{name}.json"
    sizes = [f"--batch_size={BATCH_SIZE}", f"--image_size={IMAGE_SIZE}", f"--max_steps={STEPS}"]
    sizes += [f"--data={DATA}", *EXTRA, f"--output={out}"]
    tb = [f"--tensorboard={TB / name}"] if HAVE_TB else []
    run([sys.executable, LAUNCHER, *flags, *sizes, *tb])
    RESULTS[name] = json.loads(out.read_text())
    return RESULTS[name]


print(f"checkout: {ROOT}\\nwork dir: {WORK}\\nGPUs: {NUM_GPUS}, runs with {PROCS} process(es)")"""

PREPARE_MD = """\
## 1. Prepare the data

The original example runs `bash prepare.sh` to fetch a mock ImageNet-1k-like data set. Here
`prepare` writes one: an ImageFolder tree (`DIR/train/<class>/<image>`) of real image files, read
by the training's DataLoader workers like real ImageNet would be. (Without `--data`, training uses
an in-memory mock set instead and measures the training step alone.)

```bash
python -m gallery.resnet50.data prepare --out work/mock_imagenet --num-images 5000
```"""

PREPARE = """\
prepare = [sys.executable, "-m", "gallery.resnet50.data", "prepare", "--out", DATA]
sizes = ["--num-images", NUM_IMAGES, "--num-classes", NUM_CLASSES, "--image-size", IMAGE_SIZE + 32]
run([*prepare, *sizes])"""

BASELINE_MD = """\
## 2. Baseline: PyTorch eager + DDP + AMP O1

`DistributedDataParallel`, `torch.autocast` (bf16 where the GPU supports it, else fp16 with a
`GradScaler`), channels_last and `cudnn.benchmark`, fused AdamW. Each run prints a progress line
every `--log_interval` steps (loss, ms/step, samples/s over all processes, peak memory, ETA) and
a final `[summary]` line."""

BASELINE = """\
for n in PROCS:
    launch(f"baseline_{n}p", f"--nproc_per_node={n}")"""

TORCHACC_MD = """\
## 3. TorchAcc (PAI-Opt): `--compiler-opt`

The same script with one more flag: the training step is recorded on torchacc's lazy XLA device
and compiled (the first steps include compilation); gradients are all-reduced inside the compiled
program, and the AMP optimizer is the sync-free AdamW."""

TORCHACC = """\
for n in PROCS:
    launch(f"torchacc_{n}p", f"--nproc_per_node={n}", "--compiler-opt")"""

COMPARE_MD = """\
## 4. Compare

Steady-state throughput leaves out the warm-up steps (for TorchAcc, those include compilation,
shown separately as the time of the first step)."""

COMPARE = """\
columns = ["samples/s", "ms/step", "first step s", "peak GiB", "speedup"]
header = f"{'run':<16}" + "".join(f"{c:>14}" for c in columns)
print(header)
print("-" * len(header))
for name, r in RESULTS.items():
    s = r["summary"]
    base = RESULTS.get("baseline_" + name.split("_", 1)[1])
    speedup = float("nan")
    if base:
        speedup = s["steady_samples_per_sec"] / base["summary"]["steady_samples_per_sec"]
    step_ms = (s["steady_step_time_s"] or float("nan")) * 1000
    sps, first, mem = s["steady_samples_per_sec"], s["first_step_time_s"], s["peak_mem_gib"]
    print(f"{name:<16}{sps:>14.1f}{step_ms:>14.1f}{first:>14.2f}{mem:>14.2f}{speedup:>13.2f}x")
if not any(k.startswith("torchacc") for k in RESULTS):
    print("(no torchacc run yet: run section 3)")"""


CURVES_MD = """\
## 5. Curves

Each run above wrote its TensorBoard scalars to `work/tensorboard/<run>` (rank 0, from the values
its progress lines already read: no extra device synchronization). `tensorboard --logdir
work/tensorboard` shows them live; here they are read back from the event files with
TensorBoard's `EventAccumulator`: one loss point per step, and the samples/s of each progress
line (the first one includes the compile of the first step)."""

CURVES = """\
if not HAVE_TB:
    print("no curves: the tensorboard package is not installed (pip install tensorboard)")
else:
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, result in RESULTS.items():
        acc = EventAccumulator(str(TB / name), size_guidance={"scalars": 0})
        acc.Reload()
        for ax, tag in zip(axes, ["train/loss", "train/samples_per_sec"]):
            points = [(e.step, e.value) for e in acc.Scalars(tag)]
            ax.plot(*zip(*points), marker="o", label=name)
            ax.set(title=tag, xlabel="step")
        loss = [e.value for e in acc.Scalars("train/loss")]
        same = all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(loss, result["losses"]))
        same = same and len(loss) == len(result["losses"])
        print(f"{name}: {len(loss)} loss points, equal to its --output losses: {same}")
    axes[0].legend()
    fig.tight_layout()
    plt.show()"""

ACCELERATE_MD = """\
## 6. TorchAcc's `accelerate()` on variable-length batches (LLaMA)

LLM fine-tuning scripts use TorchAcc's one-call front door: `model, loader =
ta.accelerate(model, loader, config)`, no `.to(device)` and no `mark_step`. Batches of an SFT
data set have a different length each; `config.dataloader.buckets` pads each batch up to the
smallest bucket that holds it (labels with -100, ignored by the loss), so the lazy device compiles
one program per bucket instead of one per length. `gallery/accelerate/main.py` trains the LLaMA
gallery model on such batches with `backend='eager'` and `backend='lazy'` from the same weights
and prints both side by side: median step time, programs compiled, losses (equal up to rounding).

```bash
python -m gallery.accelerate.main --model llama-tiny --steps 20 --buckets 16,32,64
python -m gallery.accelerate.main --model llama-1b --bf16 --gc --buckets 512,1024,2048 \\
    --max-len 2048 --batch 4 --steps 50        # on a GPU
```"""

ACCELERATE = """\
if TINY:
    flags = ["--model=llama-tiny", "--steps=4", "--warmup=1", "--buckets=16,64", "--max-len=64"]
elif NUM_GPUS:
    flags = ["--model=llama-1b", "--bf16", "--gc", "--buckets=512,1024,2048", "--max-len=2048"]
    flags += ["--batch=4", "--steps=50"]
else:
    flags = ["--model=llama-tiny", "--steps=20", "--buckets=16,32,64"]
run([sys.executable, "-m", "gallery.accelerate.main", *flags])"""


AXES_MD = """\
## 7. The parallel axes side by side (4 CPU devices)

`ta.accelerate`'s `Config.dist` puts every axis on one mesh: data parallel and FSDP
(`dist.dp`, `dist.fsdp`), Megatron tensor parallel (`dist.tp`: attention heads and MLP split
column->row) and context parallel (`dist.sp`: the sequence split, attention as Ulysses or ring
attention). `gallery/accelerate/axes.py` runs a GPT-2-shaped tiny model under each on 4 virtual
CPU devices (`CPU_NUM_DEVICES=4`, its own process) and prints each mesh's parameter bytes per
device, the loss against eager PyTorch's, and the collectives XLA put in the compiled program.
Pipeline parallel (`dist.pp`) is not in the table yet.

```bash
PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 python -m gallery.accelerate.axes   # a training step each
```"""

AXES = """\
import os

env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", JAX_PLATFORMS="cpu")
axes = [sys.executable, "-m", "gallery.accelerate.axes"]
if TINY:  # the forward of four meshes: seconds
    axes += ["--forward-only", "--seq=8", "--only=dp 2 x fsdp 2,fsdp 4,tp 4,cp 4 (sp)"]
done = subprocess.run(axes, cwd=ROOT, env=env, capture_output=True, text=True)
print(done.stdout)
if done.returncode:
    raise RuntimeError(done.stderr[-3000:])"""


def build() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}

    def code(src: str, tag: str):
        return new_code_cell(src, metadata={"tags": [tag]})

    def md(src: str, tag: str):
        return new_markdown_cell(src, metadata={"tags": [tag]})

    nb.cells = [
        md(INTRO, "intro"),
        code(SETUP, "setup"),
        md(PREPARE_MD, "prepare"),
        code(PREPARE, "prepare"),
        md(BASELINE_MD, "baseline"),
        code(BASELINE, "baseline"),
        md(TORCHACC_MD, "torchacc"),
        code(TORCHACC, "torchacc"),
        md(COMPARE_MD, "compare"),
        code(COMPARE, "compare"),
        md(CURVES_MD, "curves"),
        code(CURVES, "curves"),
        md(ACCELERATE_MD, "accelerate"),
        code(ACCELERATE, "accelerate"),
        md(AXES_MD, "axes"),
        code(AXES, "axes"),
    ]
    for i, cell in enumerate(nb.cells):  # stable ids keep the file diff-friendly
        cell["id"] = f"cell-{i:02d}-{cell.metadata['tags'][0]}"
    return nb


def main(argv: list[str] | None = None) -> int:
    out = (argv or [None])[0] or os.path.join(HERE, "resnet50.ipynb")
    nb = build()
    nbformat.validate(nb)
    nbformat.write(nb, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
