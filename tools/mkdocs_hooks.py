"""mkdocs hooks of the documentation site (mkdocs.yml's ``hooks:``).

- The Benchmarks page's plot, ``img/benchmarks.png``, is drawn at every build from the tables of
  benchmarks/RESULTS.md (benchmarks/results_plot.py, also ``benchmarks/run.py --plot``): generated,
  never committed.
- The API page (docs/api.md) documents a module with a ``::: module`` line; a module of
  OPTIONAL_MODULES that does not exist in this tree (one another branch is adding) is left out
  with a sentence instead of failing the build.
"""

from __future__ import annotations

import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT = "img/benchmarks.png"


def _results_plot():
    spec = importlib.util.spec_from_file_location(
        "results_plot", os.path.join(ROOT, "benchmarks", "results_plot.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    from mkdocs.structure.files import File

    files.append(File.generated(config, PLOT, content=_results_plot().render()))
    return files


# modules documented on the API page that may not be in a tree yet (another branch adds them)
OPTIONAL_MODULES = ("torchacc.plan",)


def _module_exists(name: str) -> bool:
    base = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "api.md":
        return markdown
    out, skipping = [], False
    for line in markdown.splitlines():
        m = re.match(r"^:::\s+([\w.]+)", line)
        if m:
            name = m.group(1)
            skipping = name in OPTIONAL_MODULES and not _module_exists(name)
            if skipping:
                out.append(f"*`{name}` is not in this tree yet.*")
                continue
        elif skipping and (line.startswith(" ") or not line.strip()):
            continue  # the options of a left-out module
        else:
            skipping = False
        out.append(line)
    return "\n".join(out)
