"""The docs' Benchmarks plot, drawn from the measurements recorded in benchmarks/RESULTS.md.

    python benchmarks/run.py --plot out.png     # or: python benchmarks/results_plot.py out.png

Nothing is run: the tables of RESULTS.md are the data. A panel finds its table by the table's
column names (not by its heading, so the log can be reordered), and a table that is gone is an
error naming the columns looked for. tools/mkdocs_hooks.py calls :func:`render` at each docs
build; the PNG is generated, never committed.
"""

from __future__ import annotations

import io
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "RESULTS.md")


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table of ``text``: (header cells, rows of cells)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.match(r"^\|\s*:?-", lines[i + 1]):
            header = _cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append((header, rows))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _number(cell: str) -> float | None:
    m = re.match(r"^\**([0-9][0-9,]*\.?[0-9]*)", cell.strip())
    return float(m.group(1).replace(",", "")) if m else None


def find_table(text: str, *columns: str):
    """The last table whose header has a cell containing each of ``columns`` (the most recent
    measurement of that kind), with the index of each such column."""
    found = None
    for header, rows in tables(text):
        idx = []
        for col in columns:
            hit = [j for j, h in enumerate(header) if col.lower() in h.lower()]
            if not hit:
                break
            idx.append(hit[0])
        else:
            found = (rows, idx)
    if found is None:
        raise LookupError(f"{RESULTS}: no table with the columns {columns!r}")
    return found


def compile_time_by_depth(text: str) -> dict[str, list[tuple[int, float]]]:
    """First training step's CPU seconds against depth, scan vs loop (compile_time.py)."""
    rows, (d, m, t) = find_table(text, "depth", "mode", "first step CPU s")
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        depth, value = _number(row[d]), _number(row[t])
        if depth is not None and value is not None:
            series.setdefault(row[m].strip("`* "), []).append((int(depth), value))
    return {k: sorted(v) for k, v in series.items()}


def spmd_bytes(text: str) -> list[tuple[str, float]]:
    """Parameter bytes on the fullest device, per SPMD configuration (spmd.py)."""
    rows, (c, p) = find_table(text, "configuration", "parameters / device")
    return [(row[c], _number(row[p]) / 2**20) for row in rows if _number(row[p]) is not None]


def host_cost(text: str) -> list[tuple[str, float]]:
    """(record + mark_step) / eager step of the seed recipe's step, latest table (host_cost.py):
    model and optimizer -> the median of the head's runs."""
    rows, (m, o, h) = find_table(text, "model", "optimizer", "head")
    out = []
    for row in rows:
        runs = [float(x) for x in re.findall(r"[0-9]+\.[0-9]+", row[h])]
        if runs:
            out.append((f"{row[m]}\n{row[o]}", statistics.median(runs)))
    return out


def render(results: str = RESULTS) -> bytes:
    """The plot as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(results) as f:
        text = f.read()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for mode, points in compile_time_by_depth(text).items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=mode)
    ax.set(xlabel="layers (GPT, d=256)", ylabel="first step, CPU s", title="Compile time vs depth")
    ax.legend(title="layers as")
    ax = axes[1]
    spmd = spmd_bytes(text)
    ax.bar([s[0] for s in spmd], [s[1] for s in spmd], color="tab:green")
    ax.set(ylabel="MiB per device", title="GPT-2 124M parameters per device (SPMD)")
    ax.tick_params(axis="x", labelsize=8)
    ax = axes[2]
    cost = host_cost(text)
    ax.barh([c[0] for c in cost], [c[1] for c in cost], color="tab:orange")
    ax.axvline(1.0, color="grey", ls="--", lw=1)
    ax.set(xlabel="(record + mark_step) / eager step", title="Host cost per step")
    ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("2-core CPU box (XLA:CPU); benchmarks/RESULTS.md has commands and dates", y=1.0)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python benchmarks/results_plot.py OUT.png")
    with open(argv[0], "wb") as f:
        f.write(render())
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
