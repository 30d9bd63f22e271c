"""The tree's layering: which part of the code may import which, and no import circles.

Every import of the shipped code is read from its source (module level and inside
functions alike: a lazy import is still an arrow), mapped to the part it belongs to, and
checked against ALLOWED, the picture of docs/architecture.md:

    cli -> bench -> driver -> output, workers, backends, jobspec, prompts, router, solver, report
                    workers -> backends -> engine, transfer
                    jobspec -> backends, prompts -> engine, connectors
    records (request keys, result rows): imported by every stage, imports nothing

`engine`, `transfer`, `router`, `solver`, `report` and `connectors` import nothing of the
rest: the engine runs without Ray or the driver, the solver reads profiles, not engines,
transports own their payload format, connectors are sources and sinks. Besides the arrows
between parts, no two modules may import each other, however indirectly.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("dlbatch", "connectors", "pipelines")

# part -> the parts it may import (its own modules always)
ALLOWED = {
    "base": set(),  # dlbatch.cache, dlbatch.cbuild: the per-user cache and the C-kernel builder
    "records": set(),  # dlbatch.records: request keys, result and dead-letter rows, shared by every stage
    "engine": {"base"},
    "transfer": {"base"},
    "router": set(),
    "solver": set(),
    "report": set(),
    "connectors": set(),
    "testing": set(),
    "backends": {"records", "engine", "transfer", "base"},  # the engine backends behind the workers' one interface
    "output": {"records", "prompts", "connectors", "base"},  # the output folder: lease, stores, compaction, export, status
    "workers": {"records", "backends", "engine", "transfer", "testing", "base"},  # the Ray side (actors, pools, ...)
    "prompts": {"records", "engine", "connectors"},
    "jobspec": {"records", "backends", "prompts", "engine", "connectors"},  # backend names and rules; input formats
    "pipelines": {"records", "prompts", "connectors", "jobspec"},
    "driver": {"records", "output", "workers", "backends", "jobspec", "prompts", "router", "transfer", "engine", "solver", "report", "connectors",
               "pipelines", "testing", "base"},
    "bench": {"records", "output", "workers", "backends", "driver", "jobspec", "prompts", "router", "transfer", "engine", "solver", "report", "connectors",
              "pipelines", "base"},
    "cli": {"records", "output", "workers", "backends", "bench", "driver", "jobspec", "prompts", "router", "transfer", "engine", "solver", "report",
            "connectors", "pipelines", "base"},
}


def part_of(module: str) -> str | None:
    """The part a module name belongs to (None: not ours)."""
    parts = module.split(".")
    if parts[0] in ("connectors", "pipelines"):
        return parts[0]
    if parts[0] != "dlbatch":
        return None
    if len(parts) == 1:
        return "engine"  # the package re-exports the engine's API (LLM, SamplingParams)
    if parts[1] in ("cache", "cbuild"):
        return "base"
    if parts[1] == "jobspec":
        return "jobspec"
    return parts[1]


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    names = list(rel.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names)


def imports_of(path: pathlib.Path, modules: set[str], root: pathlib.Path = ROOT) -> set[str]:
    """Our modules that ``path`` imports (``from pkg import sub`` counts as importing pkg.sub)."""
    me = module_name(path, root)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in modules else base)
    return {m for m in out if part_of(m) is not None and m in modules}


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    modules = {module_name(p, root) for p in files}
    return {module_name(p, root): imports_of(p, modules, root) - {module_name(p, root)} for p in files}


def forbidden_arrows(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        src = part_of(mod)
        for dep in sorted(deps):
            dst = part_of(dep)
            if dst != src and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) imports {dep} ({dst})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_belongs_to_a_known_part():
    unknown = sorted({part_of(m) for m in import_graph()} - set(ALLOWED))
    assert not unknown, f"parts without a rule in ALLOWED: {unknown}"


def test_no_forbidden_arrows():
    bad = forbidden_arrows(import_graph())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_catch_a_circle_and_an_upward_arrow(tmp_path):
    """The checks fail on a deliberately introduced circle and on an engine importing the driver."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "dlbatch" / "engine").mkdir()
    (tmp_path / "dlbatch" / "engine" / "__init__.py").write_text("")
    (tmp_path / "dlbatch" / "engine" / "a.py").write_text("def f():\n    from dlbatch.engine import b\n")
    (tmp_path / "dlbatch" / "engine" / "b.py").write_text("from dlbatch.engine.a import f\n"
                                                          "import dlbatch.driver.loop\n")
    (tmp_path / "dlbatch" / "driver").mkdir()
    (tmp_path / "dlbatch" / "driver" / "__init__.py").write_text("")
    (tmp_path / "dlbatch" / "driver" / "loop.py").write_text("import time\n")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["dlbatch.engine.a", "dlbatch.engine.b"]]
    assert forbidden_arrows(graph) == ["dlbatch.engine.b (engine) imports dlbatch.driver.loop (driver)"]


@pytest.mark.parametrize("name", ["connectors", "pipelines"])
def test_connectors_and_pipelines_never_import_the_driver(name):
    graph = import_graph()
    bad = [f"{m} -> {d}" for m, deps in graph.items() if part_of(m) == name for d in deps
           if part_of(d) in ("driver", "cli", "bench")]
    assert not bad, bad
