"""The pipeline's layering stays true: imports flow one way, top to bottom, with no cycle.

Parses every module of ``torchacc/`` (and ``torchacc_ops/`` when present) with ``ast``, imports
inside functions included, and checks them against the stage order documented in
docs/architecture.md. A module may import its own stage or any stage below it, never above.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")

# top to bottom (docs/architecture.md); a prefix names a package or a module
STAGES = [
    (
        "public API",
        [
            "torchacc",
            "torchacc.alias",
            "torchacc.core",  # AlibabaPAI/torchacc's ta.* names (also torchacc.dist, .utils)
            "torchacc.dist",
            "torchacc.run_torch_xla",
            "torchacc.torch_xla",
            "torchacc.utils",
        ],
    ),
    (
        "launcher",
        [
            "torchacc.launch",
            "torchacc.launch_args",
            "torchacc.launch_registry",
            "torchacc.launch_worker",
            "torchacc.plan",  # python -m torchacc.plan: reads the registry's models
        ],
    ),
    (
        "libraries",
        [
            "torchacc.accel",
            "torchacc.amp",
            "torchacc.context_parallel",
            "torchacc.distributed",
            "torchacc.horovod",
            "torchacc.nn",
            "torchacc.parallel",
            "torchacc.pipeline",  # pipeline parallel: stages on the pp axis (shard_map region)
            "torchacc.sharding",  # the one engine's library half (api, collectives, regions)
            "torchacc_ops",
        ],
    ),
    ("frontends", ["torchacc.lazy", "torchacc.dynamo"]),
    ("engine", ["torchacc.engine"]),
    ("program", ["torchacc.program", "torchacc.sharding.layout", "torchacc.sharding.manual"]),
    ("ir", ["torchacc.ir"]),
    ("runtime", ["torchacc.runtime", "torchacc.sharding.mesh"]),
    ("lowering", ["torchacc.lowering", "torchacc.sharding.rules"]),
    (
        "base",
        [
            "torchacc.metrics",
            "torchacc._jaxconfig",
            "torchacc.launch_checks",
            "torchacc.mpi_env",
            "torchacc.hardware",
        ],
    ),
]
# frontends are independent of each other: the trace-once path reuses the stages below, not the
# lazy recorder (and the other way round)
SEPARATE = [("torchacc.dynamo", "torchacc.lazy"), ("torchacc.lazy", "torchacc.dynamo")]
# front doors of the one engine (Note [One mesh] in torchacc/sharding/__init__.py) import the engine
# (torchacc.sharding), never each other, and never the mesh's runtime half directly
FRONT_DOORS = {
    "torchacc.torch_xla.distributed.spmd": "torch_xla spmd",
    "torchacc.torch_xla.experimental.spmd_fully_sharded_data_parallel": "torch_xla spmd",
    "torchacc.parallel": "parallel",
    "torchacc.horovod": "horovod",
    "torchacc.accel": "accel",
    "torchacc.nn": "nn",
}


def _modules():
    mods = {}
    for package in ("torchacc", "torchacc_ops"):
        base = os.path.join(ROOT, package)
        if not os.path.isdir(base):
            continue
        for dirpath, _, files in os.walk(base):
            for f in files:
                if not f.endswith(".py"):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
                mods[name] = path
    return mods


MODULES = _modules()


def _resolve(name):
    """The module an imported dotted name refers to (a module, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name, path):
    tree = ast.parse(open(path).read(), path)
    is_package = path.endswith("__init__.py")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_resolve(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(_resolve(target) if target in MODULES else _resolve(base))
    found.discard(None)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _stage(module):
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = rank, len(p)
    return best


def test_every_module_has_a_stage():
    assert [m for m in MODULES if _stage(m) is None] == []


def test_imports_go_down_the_stages():
    wrong = []
    for mod, deps in GRAPH.items():
        for dep in deps:
            if _stage(dep) < _stage(mod):
                wrong.append(
                    f"{mod} ({STAGES[_stage(mod)][0]}) imports {dep} ({STAGES[_stage(dep)][0]})"
                )
    assert wrong == []


@pytest.mark.parametrize("importer,forbidden", SEPARATE)
def test_frontends_are_independent(importer, forbidden):
    wrong = [
        f"{mod} imports {dep}"
        for mod, deps in GRAPH.items()
        if mod.startswith(importer)
        for dep in deps
        if dep.startswith(forbidden)
    ]
    assert wrong == []


def _door(module):
    return next(
        (v for d, v in FRONT_DOORS.items() if module == d or module.startswith(d + ".")), None
    )


def test_front_doors_import_the_engine_not_each_other():
    wrong = []
    for mod, deps in GRAPH.items():
        door = _door(mod)
        if door is None:
            continue
        for dep in deps:
            other = _door(dep)
            if other is not None and other != door:
                wrong.append(f"{mod} imports {dep} (another front door)")
            if dep == "torchacc.sharding.mesh" or dep.startswith("torchacc.runtime.mesh"):
                wrong.append(f"{mod} imports {dep} (use torchacc.sharding.api)")
    assert wrong == []


def test_the_engine_has_one_home():
    # the per-process and SPMD engines were merged into torchacc/sharding/ (issue 40)
    for gone in ("torchacc.program.spmd", "torchacc.dynamo.spmd", "torchacc.runtime.mesh"):
        assert gone not in MODULES
    assert {"torchacc.sharding.mesh", "torchacc.sharding.manual", "torchacc.sharding.api"} <= set(
        MODULES
    )


def _cycles():
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    # a package's __init__ re-exporting its submodules is not a cycle of the pipeline
    cycles = [c for c in _cycles() if not _only_package_reexports(c)]
    assert cycles == []


def _only_package_reexports(component):
    packages = [m for m in component if MODULES[m].endswith("__init__.py")]
    if not packages:
        return False
    # the cycle goes only through packages importing their own submodules and back
    rest = [m for m in component if m not in packages]
    return all(any(m.startswith(p + ".") for p in packages) for m in rest) and all(
        not any(
            d in component and not d.startswith(m) and not m.startswith(d)
            for d in GRAPH[m]
            if d not in packages
        )
        for m in rest
    )


def _example_modules():
    """The gallery's and the benchmarks' modules (outside the package, held to the same sizes)."""
    out = {}
    for top in ("gallery", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    out[os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")] = path
    return out


def test_no_module_outside_the_rule_tables_is_long():
    long = []
    for name, path in {**MODULES, **_example_modules()}.items():
        if name.startswith("torchacc.lowering."):
            continue  # rule tables: one decorated function per overload
        n = sum(1 for _ in open(path))
        if n > 550:
            long.append(f"{name}: {n} lines")
    assert long == []


def test_every_module_says_what_it_owns():
    """A module's first lines (its docstring) say what it holds; an empty package marker is
    exempt."""
    silent = []
    for name, path in {**MODULES, **_example_modules()}.items():
        with open(path) as f:
            src = f.read()
        if not src.strip():
            continue
        doc = ast.get_docstring(ast.parse(src, path)) or ""
        if len(doc) < 40:
            silent.append(f"{name}: {doc!r}")
    assert silent == []


def _gallery_imports(path):
    """Where module ``path`` imports the gallery: ``import gallery...``, ``from gallery...``, or
    ``import_module("gallery...")`` / ``__import__`` with a literal or f-string name."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = getattr(func, "attr", None) or getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names = [arg.value]
                elif isinstance(arg, ast.JoinedStr) and arg.values:
                    head = arg.values[0]
                    names = [head.value] if isinstance(head, ast.Constant) else []
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] == "gallery"]
    return found


def test_torchacc_never_imports_the_gallery():
    """The package line: the gallery fills torchacc's registries (launch_registry.py); torchacc
    (the launcher, the planner) never imports it."""
    wrong = [f"{m} {hit}" for m, path in MODULES.items() for hit in _gallery_imports(path)]
    assert wrong == []


def test_the_gallery_checker_finds_a_dynamic_import(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        'import importlib\n\ndef f(x):\n    importlib.import_module(f"gallery.{x}.model")\n'
    )
    assert _gallery_imports(str(src)) == ["line 4: gallery."]


def test_the_checker_sees_function_level_imports():
    # guards the parser itself: a known function-level import must be found
    src = "def f():\n    from torchacc.engine import execute\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
    assert "torchacc.engine.execute" in GRAPH["torchacc.lazy.transfer"]
