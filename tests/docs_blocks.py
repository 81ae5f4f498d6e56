"""The executable code blocks of the documentation (README.md and docs/*.md): how they are marked
and how they run. tests/test_docs.py runs them; ``python tests/docs_blocks.py PAGE.md ...`` runs
the pages given (all of them without arguments) the same way, for writing docs.

Note [Docs code blocks]
~~~~~~~~~~~~~~~~~~~~~~~
Every ```python block of a page runs on the CPU (JAX_PLATFORMS=cpu). The blocks of one page run
in order in one fresh process, sharing their globals like a notebook's cells, with a temporary
directory as the working directory. The line right before a block may be one directive:

    <!-- docs: skip (reason: needs a GPU) -->            not run; the reason is mandatory
    <!-- docs: devices 4 -->                             the page's process has 4 CPU devices
    <!-- docs: launch torchrun --nproc_per_node 2 -->    the block is a script run by that launcher
    <!-- docs: devices 4; launch python -->              clauses combine, separated by ";"

A page's process gets the most devices any of its blocks asks for (XLA's device count is fixed
when JAX starts). A launched block runs on its own, in a fresh process (``launch python``) or
under torchrun, and shares nothing with the page's other blocks (e.g. an SPMD example, which must
switch SPMD mode on before any tensor is on the device). A block that raises fails with its page
and line: tracebacks name the Markdown file and its line numbers. Any other
``<!-- docs: ... -->`` comment, or one not right before a python block, is an error.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import prewarmed

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\s*<!--\s*docs:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
OK_MARK = "docs-block ok "


class DocsMarkupError(ValueError):
    """A docs directive that cannot be understood (names the page and line)."""


@dataclass
class Block:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None = None  # the reason
    devices: int = 1
    launch: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _directive(page: str, lineno: int, body: str, block: Block) -> None:
    clauses = [c.strip() for c in body.split(";")]
    if len(clauses) > 1:
        for clause in clauses:
            _directive(page, lineno, clause, block)
        return
    m = re.fullmatch(r"skip\s*\(reason:\s*(?P<reason>.*?)\s*\)", body)
    if m:
        if not m["reason"]:
            raise DocsMarkupError(f"{page}:{lineno}: `docs: skip` needs a reason: {body!r}")
        block.skip = m["reason"]
        return
    if body.startswith("skip"):
        raise DocsMarkupError(
            f"{page}:{lineno}: write `<!-- docs: skip (reason: WHY) -->`, got {body!r}"
        )
    m = re.fullmatch(r"devices\s+(?P<n>\d+)", body)
    if m:
        if int(m["n"]) < 1:
            raise DocsMarkupError(f"{page}:{lineno}: `docs: devices` needs N >= 1: {body!r}")
        block.devices = int(m["n"])
        return
    m = re.fullmatch(r"launch\s+(?P<cmd>.+)", body)
    if m:
        cmd = shlex.split(m["cmd"])
        if cmd[0] not in ("torchrun", "python") or cmd[0] == "python" and len(cmd) > 1:
            raise DocsMarkupError(
                f"{page}:{lineno}: `docs: launch` knows `torchrun ...` and `python`, got {cmd!r}"
            )
        block.launch = cmd
        return
    raise DocsMarkupError(
        f"{page}:{lineno}: unknown docs directive {body!r} (skip (reason: ...), devices N, "
        "launch torchrun ... | python)"
    )


def parse(path: Path) -> list[Block]:
    """The python blocks of one page, with their directives."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # a directive waiting for its block
    i = 0
    while i < len(lines):
        text = lines[i]
        d = DIRECTIVE.match(text)
        if d:
            if pending is not None:
                raise DocsMarkupError(f"{page}:{pending[0]}: docs directive not before a block")
            pending = (i + 1, d["body"])
            i += 1
            continue
        f = FENCE.match(text)
        if not f:
            if pending is not None:
                raise DocsMarkupError(
                    f"{page}:{pending[0]}: a docs directive must be the line right before a "
                    "```python block"
                )
            i += 1
            continue
        indent, fence, info = len(f["indent"]), f["fence"], f["info"].lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(
            rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[i]
        ):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # the closing fence
        if info in ("python", "py"):
            block = Block(page, start + 1, "\n".join(body) + "\n")
            if pending is not None:
                _directive(page, pending[0], pending[1], block)
            blocks.append(block)
        elif pending is not None and not pending[1].startswith("skip"):
            # (a skip before a bash block says nothing wrong: such blocks never run)
            raise DocsMarkupError(
                f"{page}:{pending[0]}: a docs directive must be the line right before a "
                f"```python block (this one is ```{info})"
            )
        pending = None
    if pending is not None:
        raise DocsMarkupError(f"{page}:{pending[0]}: docs directive not before a block")
    return blocks


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TORCHACC_CACHE_DIR", str(ROOT / ".pytest_cache" / "torchacc"))
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    if devices > 1:
        flags += f" --xla_force_host_platform_device_count={devices}"
    env["XLA_FLAGS"] = flags.strip()
    return env


def _launcher(cmd: list[str]) -> list[str]:
    if cmd == ["python"]:
        return [sys.executable]
    args = cmd[1:]  # torchrun's flags, run by this Python
    if not any(a.startswith(("--master", "--rdzv", "--standalone")) for a in args):
        args = ["--standalone", *args]
    return [sys.executable, "-m", "torch.distributed.run", *args]


def run_page(blocks: list[Block], workdir: str, timeout: float = 300) -> tuple[int, str]:
    """Run one page's blocks (the page process, then each launched block). Returns the number of
    blocks that ran and their output; raises AssertionError naming the page and line of a block
    that failed."""
    ran, out = 0, []
    here = [b for b in blocks if b.skip is None and not b.launch]
    jobs = []
    if here:
        jobs.append((None, here, max(b.devices for b in here)))
    jobs += [(b.launch, [b], b.devices) for b in blocks if b.skip is None and b.launch]
    for n, (launch, group, devices) in enumerate(jobs):
        spec = os.path.join(workdir, f"blocks{n}.json")
        with open(spec, "w") as f:
            json.dump([[b.page, b.line, b.code] for b in group], f)
        cmd = [*(_launcher(launch) if launch else [sys.executable]), __file__, "--exec", spec]
        try:
            if cmd[0] == sys.executable and cmd[1] == __file__:  # Note [Pre-warmed test processes]
                p = prewarmed.run(cmd[1:], _env(devices), workdir, timeout)
            else:
                p = subprocess.run(
                    cmd,
                    cwd=workdir,
                    env=_env(devices),
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{group[0].where}: docs blocks ran past {timeout:.0f} s") from e
        text = p.stdout + p.stderr
        out.append(text)
        done = {ln[len(OK_MARK) :].strip() for ln in text.splitlines() if ln.startswith(OK_MARK)}
        if p.returncode != 0 or len(done) != len(group):
            failed = next((b for b in group if b.where not in done), group[-1])
            tail = "\n".join(text.splitlines()[-40:])
            raise AssertionError(
                f"{failed.where}: docs code block failed (exit {p.returncode}"
                f"{', launched by ' + shlex.join(launch) if launch else ''}):\n{tail}"
            )
        ran += len(group)
    return ran, "".join(out)


def _exec(spec: str) -> None:
    """In the page's process: run the blocks in order in one namespace."""
    with open(spec) as f:
        blocks = json.load(f)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    for page, line, code in blocks:
        # pad so that the traceback's line numbers are the Markdown file's
        exec(compile("\n" * line + code, str(ROOT / page), "exec"), ns)
        sys.stdout.flush()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{OK_MARK}{page}:{line}", flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--exec"]:
        _exec(argv[1])
        return 0
    targets = [Path(a).resolve() for a in argv] or pages()
    total = 0
    for path in targets:
        blocks = parse(path)
        with tempfile.TemporaryDirectory() as d:
            ran, _ = run_page(blocks, d)
        skipped = sum(b.skip is not None for b in blocks)
        print(f"{path.relative_to(ROOT)}: {ran} ran, {skipped} skipped")
        total += ran
    print(f"{total} docs code blocks ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
