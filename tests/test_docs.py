"""The documentation: the mkdocs site builds with ``--strict`` (no broken link or anchor, the
Benchmarks plot generated, the API pages rendered), and every ```python block of README.md and
docs/*.md runs on the CPU (Note [Docs code blocks] in tests/docs_blocks.py), one process per page,
pages in parallel. A failing block fails its page's test naming the page and line; the suite's
summary says how many blocks ran."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from docs_blocks import ROOT, Block, DocsMarkupError, pages, parse, run_page

# the blocks that run today (README + docs pages); a page that loses its examples fails this
MIN_BLOCKS_RUN = 40


def _page_id(path) -> str:
    return str(path.relative_to(ROOT))


def _runnable_pages():
    out = []
    for path in pages():
        try:
            blocks = parse(path)
        except DocsMarkupError:
            blocks = [Block(_page_id(path), 0, "")]  # test_docs_markup names the error
        if any(b.skip is None for b in blocks):
            out.append(path)
    return out


def test_docs_markup_and_block_count(record_property):
    """Every directive is understood, every skip says why, and enough blocks run."""
    errors, run, skipped = [], 0, []
    for path in pages():
        try:
            blocks = parse(path)
        except DocsMarkupError as e:
            errors.append(str(e))
            continue
        run += sum(b.skip is None for b in blocks)
        skipped += [f"{b.where} ({b.skip})" for b in blocks if b.skip is not None]
    assert errors == []
    print(f"docs: {run} python blocks to run, {len(skipped)} skipped: " + "; ".join(skipped))
    record_property("docs_blocks_skipped", len(skipped))
    assert run >= MIN_BLOCKS_RUN, f"only {run} docs code blocks run (expected >= {MIN_BLOCKS_RUN})"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", _runnable_pages(), ids=_page_id)
def test_docs_page_blocks_run(path, tmp_path, record_property):
    blocks = parse(path)
    ran, _ = run_page(blocks, str(tmp_path))
    record_property("docs_blocks_ran", ran)
    assert ran == sum(b.skip is None for b in blocks)


@pytest.mark.timeout(300)
def test_mkdocs_build_strict(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs / mkdocs-material not installed (pip install -e '.[test]')")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    site = tmp_path / "site"
    assert (site / "benchmarks" / "index.html").exists() or (site / "benchmarks.html").exists()
    plot = site / "img" / "benchmarks.png"
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no benchmarks plot"
    api = (site / "api" / "index.html").read_text()
    names = ("torchacc.accelerate", "torchacc.Config", "torchacc.parallel", "torchacc.horovod")
    for name in (*names, "torchacc.plan"):
        assert name in api, f"the API page does not document {name}"


def _slug(heading: str) -> str:
    """mkdocs' (Python-Markdown toc's) anchor of a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_resolve():
    """The README is not part of the site, so its links to pages and anchors are checked here."""
    readme = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else ROOT / "README.md"
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+\s+(.*)$", file.read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == [], f"README links to missing files or anchors: {broken}"


def test_a_failing_block_names_its_page_and_line(tmp_path):
    """A docs example that raises fails with the page and the line that raised."""
    page = tmp_path / "docs" / "bad.md"
    page.parent.mkdir()
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n```python\ny = x + 1\nraise KeyError(y)\n```\n"
    )
    blocks = parse_outside(page)
    with pytest.raises(AssertionError) as e:
        run_page(blocks, str(tmp_path))
    msg = str(e.value)
    assert "bad.md:7: docs code block failed" in msg, msg
    assert "line 9" in msg and "KeyError: 2" in msg, msg


def parse_outside(page):
    """parse() for a page outside the repository (the test above)."""
    import docs_blocks

    saved = docs_blocks.ROOT
    docs_blocks.ROOT = page.parent.parent
    try:
        blocks = parse(page)
    finally:
        docs_blocks.ROOT = saved
    for b in blocks:  # the runner resolves pages against the repository root
        b.page = str(page)
    return blocks


@pytest.mark.parametrize(
    "comment, error",
    [
        ("<!-- docs: skip -->", "needs a reason|write"),
        ("<!-- docs: skip (reason: ) -->", "needs a reason"),
        ("<!-- docs: devices four -->", "unknown docs directive"),
        ("<!-- docs: launch mpirun -np 2 -->", "knows `torchrun ...` and `python`"),
        ("<!-- docs: devices 2; launch python x.py -->", "knows `torchrun ...` and `python`"),
    ],
)
def test_bad_directives_are_refused(tmp_path, comment, error):
    page = tmp_path / "docs" / "bad.md"
    page.parent.mkdir()
    page.write_text(f"# t\n{comment}\n```python\nx = 1\n```\n")
    with pytest.raises(DocsMarkupError, match=error):
        parse_outside(page)


def test_a_directive_must_touch_its_block(tmp_path):
    page = tmp_path / "docs" / "bad.md"
    page.parent.mkdir()
    page.write_text("# t\n<!-- docs: devices 2 -->\n\n```python\nx = 1\n```\n")
    with pytest.raises(DocsMarkupError, match="bad.md:2: a docs directive must be"):
        parse_outside(page)


def test_benchmarks_plot_is_drawn_from_the_log(tmp_path):
    """``benchmarks/run.py --plot`` runs nothing and draws the docs' plot from RESULTS.md's
    tables; a table it needs that is gone is an error naming its columns."""
    out = tmp_path / "plot.png"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run.py"), "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import results_plot
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    series = results_plot.compile_time_by_depth(text)
    assert {"scan", "loop"} <= set(series) and len(series["scan"]) >= 3
    with pytest.raises(LookupError, match="depth"):
        results_plot.compile_time_by_depth("| a | b |\n|---|---|\n| 1 | 2 |\n")
