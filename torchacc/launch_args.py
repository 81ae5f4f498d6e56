"""The launcher's command line: flags, their value types and checks, and the worker's argv.

``torchacc.launch`` parses with ``parse_args`` and hands ``worker_argv`` to each worker. The
``--model`` names come from the model registry (``torchacc/launch_registry.py``), which the
gallery (or any package) fills; this module knows no model.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _load_registry():
    """``torchacc.launch_registry``: already loaded by the launcher (from its file, without the
    ``torchacc`` package), else imported."""
    mod = sys.modules.get("torchacc.launch_registry")
    return mod if mod is not None else importlib.import_module("torchacc.launch_registry")


registry = _load_registry()
# --model name -> worker (a read-only view of the registry)
MODELS = registry.MODELS

# Flags a training script may be launched with (they set TORCHACC_COMPILER_OPT/KERNEL_OPT).
_SCRIPT_FLAGS = ("compiler_opt", "kernel_opt")

# Flags that only the launcher reads; everything else is forwarded to the workers.
LAUNCH_ONLY = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "max_restarts",
    "oversubscribe",
    "script",
    "script_args",
)


# ----------------------------------------------------------------------------- value types
def _int_at_least(lo: int, what: str):
    def conv(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{what}: must be >= {lo}, got {value}")
        return value

    conv.__name__ = what
    return conv


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _nproc(text: str) -> int | str:
    if text in ("auto", "gpu", "cpu"):
        return text
    return _int_at_least(1, "nproc_per_node")(text)


def _port(text: str) -> int:
    value = _int_at_least(1, "master_port")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"master_port: must be <= 65535, got {value}")
    return value


def _data(text: str) -> str:
    if text == "mock":
        return text
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither 'mock' nor an existing directory (an ImageFolder tree: "
            "DIR/<class>/<image> or DIR/train/<class>/<image>)"
        )
    return os.path.abspath(text)


def _profile_window(text: str) -> str:
    """``START:STOP``: two integers >= 0 (their order and --max_steps are checked at start-up,
    with one line, by ``launch_checks.observe_errors``)."""
    start, sep, stop = text.partition(":")
    try:
        a, b = int(start), int(stop)
    except ValueError:
        a = b = -1
    if not sep or a < 0 or b < 0:
        raise argparse.ArgumentTypeError(
            f"expected START:STOP (two integers >= 0, e.g. 10:13), got {text!r}"
        )
    return f"{a}:{b}"


def profile_window(text: str) -> tuple[int, int]:
    """``(START, STOP)`` of a ``--profile`` value."""
    start, _, stop = text.partition(":")
    return int(start), int(stop)


_DEFAULT_MODEL = "resnet50"


def _model(text: str) -> str:
    """A registered ``--model`` name, or ``MODULE:FUNCTION`` (a training entry of one's own)."""
    if text in MODELS or registry.is_entry(text) or text == _DEFAULT_MODEL:
        return text  # the default is checked after parsing, and only when no script is given
    known = ", ".join(repr(n) for n in sorted(MODELS))
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {known}, or give MODULE:FUNCTION)"
    )


def _existing_path(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"checkpoint {text!r} does not exist")
    return os.path.abspath(text)


# ----------------------------------------------------------------------------- parser
class _HelpFormatter(argparse.HelpFormatter):
    """Show a flag's default unless its help already says it (or there is none worth saying)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (
            "default" not in text
            and action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_single_task.py",
        description=(
            "Train a registered model (the gallery's) as eager PyTorch (DDP + AMP; the baseline) "
            "or, with --compiler-opt, through torchacc's lazy XLA device; or run a training "
            "script of one's own in every worker. Workers are started with "
            "torch.distributed.run, or run in place under mpirun/torchrun."
        ),
        allow_abbrev=False,
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("processes (torchrun semantics)")
    g.add_argument(
        "--nproc_per_node",
        type=_nproc,
        default=1,
        help="worker processes on this node (an int, or 'auto'/'gpu': one per GPU, 'cpu': 1)",
    )
    g.add_argument("--nnodes", type=_int_at_least(1, "nnodes"), default=1, help="number of nodes")
    g.add_argument(
        "--node_rank", type=_int_at_least(0, "node_rank"), default=0, help="rank of this node"
    )
    n = _int_at_least(0, "max_restarts")
    g.add_argument("--max_restarts", type=n, default=0, help="torchrun's --max-restarts N")
    g.add_argument("--master_addr", default=None, help="rendezvous host (default 127.0.0.1)")
    g.add_argument(
        "--master_port",
        type=_port,
        default=None,
        help="rendezvous port (default: a free port on one node, 29500 on several)",
    )
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        help="allow more processes than CPU cores on a CPU-only node (GPUs: one process each)",
    )

    g = p.add_argument_group("model and mode")
    g.add_argument(
        "--model",
        type=_model,
        default=_DEFAULT_MODEL,
        metavar="NAME",
        help="a registered model (the gallery's: "
        + ", ".join(sorted(MODELS))
        + ") or MODULE:FUNCTION, called in each worker with the training flags' argv",
    )
    g.add_argument(
        "--compiler-opt",
        "--compiler_opt",
        dest="compiler_opt",
        action="store_true",
        help="run the training step through torchacc (lazy XLA device); without it: eager DDP",
    )
    g.add_argument(
        "--compile_mode",
        choices=("lazy", "dynamo"),
        default="lazy",
        help="with --compiler-opt: 'lazy' records every step on the lazy XLA device; 'dynamo' "
        "keeps tensors on the eager device and runs the step through torchacc.dynamo.compile_step "
        "(traced once, one program with the gradient all-reduce and GradScaler)",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="fully sharded data parallel for the gpt/llama models: with --compiler-opt FSDPv2 "
        "through XLA's SPMD partitioner over every device this process drives (one process per "
        "node; on a CPU set CPU_NUM_DEVICES=N); without it torch's FSDP2 (fully_shard)",
    )
    g.add_argument(
        "--mesh",
        default=None,
        metavar="DATA,FSDP",
        help="with --fsdp --compiler-opt: a data x fsdp mesh (e.g. 2,2; x --tp x --cp x --pp "
        "devices); default 1,<the rest>, but <the rest>,1 under --pp with --tp/--cp (no fsdp)",
    )
    for name, text in (  # the axes of --fsdp --compiler-opt's mesh (launch_registry.axes_error)
        ("tp", "with --fsdp --compiler-opt: Megatron tensor parallel (heads, MLP) over N devices"),
        ("cp", "with --fsdp --compiler-opt: context parallel (the sequence split) over N devices"),
        ("pp", "with --fsdp --compiler-opt: pipeline stages (the blocks cut evenly) on N devices"),
    ):
        g.add_argument(f"--{name}", type=_int_at_least(1, name), default=1, metavar="N", help=text)
    for flags, kw in (  # TorchAcc's Config.dist.pp names
        (("--num_micro_batches", "--pp_microbatches"), {"type": _int_at_least(1, "M")}),
        (("--pp_schedule",), {"choices": ("1F1B", "GPipe"), "default": "1F1B"}),
    ):
        what = "M micro-batches per step (default: --pp)" if "type" in kw else "its schedule"
        m = "M" if "type" in kw else None
        g.add_argument(*flags, dest=flags[0][2:], metavar=m, **kw, help=f"with --pp: {what}")
    g.add_argument(
        "--parallel_mode",
        choices=("data_parallel", "semi_auto", "auto"),
        default=None,
        help="with --compiler-opt: torchacc.parallel's MindSpore-style mode over every device "
        "this process drives (one process per node; on a CPU set CPU_NUM_DEVICES=N)",
    )
    g.add_argument(
        "--strategy_file",
        default=None,
        metavar="YAML",
        help="with --parallel_mode semi_auto/auto: layer name -> strategy, e.g. "
        "'h.*.mlp.c_fc: {weight: [2, 1], bias: [2]}'",
    )
    g.add_argument(
        "--device_memory_budget",
        type=int,
        default=None,
        metavar="BYTES",
        help="with --parallel_mode auto: per-device bytes the searched layout must fit",
    )
    g.add_argument(
        "--kernel-opt",
        "--kernel_opt",
        dest="kernel_opt",
        action="store_true",
        help="gpt and llama models use torchacc_ops' fused kernels (attention, RMSNorm, rotary, "
        "SwiGLU, cross-entropy) on either path (sets TORCHACC_KERNEL_OPT=1)",
    )
    g.add_argument(
        "--scan-layers",
        "--scan_layers",
        dest="scan_layers",
        action="store_true",
        help="gpt and llama models: with --compiler-opt the blocks run as one scan_layers (one "
        "lax.scan, compiled once whatever the depth); without it, as the same plain loop",
    )
    g.add_argument(
        "--packing",
        action="store_true",
        help="llama model: padding-free packed rows (several sequences of random length per row, "
        "position ids restarting at each; attention stays inside each sequence), SFT style",
    )
    g.add_argument(
        "--torch_compile",
        action="store_true",
        help="eager path only: wrap the model in torch.compile (Inductor) for comparison",
    )
    g.add_argument(
        "--amp_level",
        choices=("O0", "O1"),
        default="O1",
        help="O0: float32; O1: autocast (+ GradScaler for fp16)",
    )
    g.add_argument(
        "--amp_dtype",
        choices=("bf16", "fp16"),
        default=None,
        help="autocast dtype for O1 (default: bf16 where the device supports it, else fp16)",
    )

    g = p.add_argument_group("training")
    g.add_argument(
        "--batch_size", type=_int_at_least(1, "batch_size"), default=128, help="per process"
    )
    g.add_argument(
        "--max_steps",
        type=_int_at_least(1, "max_steps"),
        default=None,
        help="total optimizer steps (overrides --epochs)",
    )
    g.add_argument(
        "--epochs", type=_int_at_least(1, "epochs"), default=1, help="passes over the data"
    )
    g.add_argument(
        "--lr",
        type=_positive_float,
        default=None,
        help="AdamW learning rate (default: 1e-3 for the resnets, 6e-4 for the gpt models)",
    )
    g.add_argument(
        "--weight_decay",
        type=_nonneg_float,
        default=None,
        help="AdamW weight decay (default: 1e-4 for the resnets, 0.1 for the gpt models)",
    )
    g.add_argument(
        "--image_size",
        type=_int_at_least(16, "image_size"),
        default=224,
        help="resnet50, resnet-tiny only",
    )
    g.add_argument(
        "--seq_len",
        type=_int_at_least(2, "seq_len"),
        default=None,
        help="gpt, llama: tokens per sample (default: the model's block size, 1024 for gpt2)",
    )
    g.add_argument(
        "--data",
        type=_data,
        default="mock",
        help="'mock' (in-memory synthetic data) or, for the resnets, an ImageFolder directory",
    )
    g.add_argument(
        "--mock_samples",
        type=_int_at_least(1, "mock_samples"),
        default=None,
        help="mock dataset size (default: 1,281,167 images like ImageNet-1k train; gpt: 2**20)",
    )
    g.add_argument(
        "--workers",
        type=_int_at_least(0, "workers"),
        default=None,
        help="DataLoader workers per process for ImageFolder data (default: min(8, cpus/procs))",
    )
    g.add_argument(
        "--seed", type=_int_at_least(0, "seed"), default=42, help="model init, data order, RNG"
    )

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument(
        "--log_interval",
        type=_int_at_least(1, "log_interval"),
        default=10,
        help="steps between progress lines (the loss is read from the device only then)",
    )
    g.add_argument("--output", default=None, help="write metrics as JSON to this file (rank 0)")
    g.add_argument("--save_dir", default=None, help="directory for checkpoints (rank 0 writes)")
    g.add_argument(
        "--save_interval",
        type=_int_at_least(0, "save_interval"),
        default=0,
        help="save every N steps (0: only at the end); needs --save_dir",
    )
    g.add_argument(
        "--resume",
        type=_existing_path,
        default=None,
        help="checkpoint file, or a directory: its latest checkpoint",
    )
    g.add_argument(
        "--warmup_steps",
        type=_int_at_least(0, "warmup_steps"),
        default=None,
        help="steps left out of the steady-state samples/s (default: min(5, steps // 2))",
    )

    g = p.add_argument_group("observing a run (TensorBoard, profiles)")
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="rank 0 writes TensorBoard scalars (loss, samples/s, tokens/s, step time, lr, peak "
        "memory, compiles, loss scale, TFLOP/s per device and MFU) and the run's flags as hparams "
        "to DIR (needs the tensorboard or tensorboardX package)",
    )
    g.add_argument(
        "--peak_tflops",
        type=_positive_float,
        default=None,
        metavar="TFLOPS",
        help="the device's dense peak TFLOP/s for the MFU in the log (default: from the device "
        "kind, e.g. 989.4 for an H100 SXM in bf16; a CPU has none: MFU n/a)",
    )
    g.add_argument(
        "--profile",
        metavar="START:STOP",
        type=_profile_window,
        default=None,
        help="rank 0 profiles steps START+1..STOP (the log's step numbers): jax.profiler with "
        "--compiler-opt, torch.profiler on the eager path",
    )
    g.add_argument(
        "--profile_dir",
        metavar="DIR",
        default=None,
        help="where --profile writes (default: the --tensorboard DIR, where TensorBoard's "
        "profile plugin finds it)",
    )

    g = p.add_argument_group("a training script of one's own (instead of --model)")
    g.add_argument(
        "script",
        nargs="?",
        default=None,
        help="a Python script each worker runs (as torchrun would), with the flags after it",
    )
    g.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.save_interval and not args.save_dir:
        parser.error("--save_interval needs --save_dir")
    if args.node_rank >= args.nnodes:
        parser.error(f"--node_rank {args.node_rank} must be < --nnodes {args.nnodes}")
    if args.nnodes > 1 and args.master_addr is None and "MASTER_ADDR" not in os.environ:
        parser.error("--nnodes > 1 needs --master_addr (the address of node 0)")
    _check_script(parser, args)
    err = (
        None
        if args.script is not None
        else registry.flag_error(args.model, args.seq_len, args.data)
    )
    if err:
        parser.error(err)
    if args.torch_compile and args.compiler_opt:
        parser.error(
            "--torch_compile is for the eager path; it cannot be combined with --compiler-opt"
        )
    if args.compile_mode == "dynamo" and not args.compiler_opt:
        parser.error("--compile_mode=dynamo needs --compiler-opt (it selects the compiler path)")
    _check_fsdp(parser, args)
    err = registry.axes_flag_error(args)  # --tp / --cp / --pp
    if err:
        parser.error(err)
    if args.profile is not None and args.profile_dir is None:
        args.profile_dir = args.tensorboard  # None too: observe_errors says what is missing
    _check_parallel(parser, args)
    return args


def _check_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--parallel_mode: the lazy compiler path, one process per node, not with --fsdp;
    --strategy_file and --device_memory_budget only with the modes that use them."""
    mode = args.parallel_mode
    if args.strategy_file is not None and mode not in ("semi_auto", "auto"):
        parser.error("--strategy_file needs --parallel_mode semi_auto or auto")
    if args.device_memory_budget is not None and mode != "auto":
        parser.error("--device_memory_budget needs --parallel_mode auto")
    if mode is None:
        return
    if not args.compiler_opt or args.compile_mode != "lazy" or args.nproc_per_node != 1:
        parser.error(
            "--parallel_mode runs one lazy process per node that drives all its devices "
            "(--compiler-opt, --nproc_per_node=1, --compile_mode=lazy)"
        )
    if args.fsdp:
        parser.error("--parallel_mode and --fsdp are two ways to shard: pick one")
    if args.strategy_file is not None and not os.path.isfile(args.strategy_file):
        parser.error(f"--strategy_file {args.strategy_file}: no such file")


def _check_fsdp(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--fsdp: language models only; with --compiler-opt the lazy path (each of the
    --nproc_per_node processes drives its share of the node's devices and loads its share of the
    data); --mesh DATA,FSDP only with both."""
    if args.mesh is not None and not (args.fsdp and args.compiler_opt):
        parser.error("--mesh is for --fsdp --compiler-opt (the SPMD mesh of the sharded step)")
    if not args.fsdp:
        return
    if not registry.lookup(args.model).shards:
        parser.error(f"--fsdp shards the gpt and llama models, not {args.model}")
    if args.compiler_opt and args.compile_mode == "dynamo":
        parser.error("--fsdp --compiler-opt runs on the lazy path (--compile_mode=lazy)")
    if args.mesh is not None:
        try:
            data, fsdp = (int(x) for x in args.mesh.split(","))
        except ValueError:
            parser.error(f"--mesh {args.mesh!r}: expected DATA,FSDP (two whole numbers)")
        if data < 1 or fsdp < 1:
            parser.error(f"--mesh {args.mesh!r}: both sizes must be at least 1")


def _check_script(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A script runs with its own flags (those after its path): the launcher's training flags,
    which only registered models and entries read, are refused rather than dropped."""
    if args.script is None:
        if args.script_args:
            parser.error(f"unrecognized arguments: {' '.join(args.script_args)}")
        return
    if not os.path.isfile(args.script):
        parser.error(f"{args.script}: no such script (a training script to run in each worker)")
    for action in parser._actions:
        if not action.option_strings or action.dest in LAUNCH_ONLY + _SCRIPT_FLAGS:
            continue
        if action.dest != "help" and getattr(args, action.dest) != action.default:
            parser.error(
                f"{action.option_strings[0]} is a flag of the launcher's models; a script takes "
                f"its own flags after its path ({args.script} ...)"
            )


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The training flags (launch-only ones removed), as the workers will parse them."""
    out: list[str] = []
    for action in build_parser()._actions:
        dest = action.dest
        if dest in LAUNCH_ONLY or dest == "help" or not action.option_strings:
            continue
        value = getattr(args, dest, None)
        flag = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif value is not None:
            out += [flag, str(value)]
    return out
