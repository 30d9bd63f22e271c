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

Backends are known by their registry only (`dlbatch.backends.REGISTRY`): no module outside
dlbatch/backends/ (and the bench, a leaf) names one (`backend_names_used`).
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
    "root": {"api", "engine"},  # dlbatch/__init__.py: lazy re-exports of the two entries
    "api": {"records", "driver", "output", "jobspec", "base"},  # dlbatch.api: run a job from Python
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
    "cli": {"root", "api", "records", "output", "workers", "backends", "bench", "driver", "jobspec", "prompts", "router", "transfer", "engine", "solver", "report",
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
        return "root"  # the package: the job API (dlbatch.api) and the engine's (LLM, SamplingParams)
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


# ------------------------------------------------------------------ backends are named in backends/ only
PROJECT = "dlbatch"  # also the name of the package, the program, its logger and cache: used as such, not a backend
# the project's name where a branch on a backend name would stand, used as the package's name
PROJECT_NAME_USES = {("dlbatch/cli/cluster.py", 'dirs["dlbatch"]'),  # the package's folder
                     ("dlbatch/cli/preflight.py", '{"dlbatch": "preflight"}')}  # a Ray job's metadata}
DEFAULTS = {"get": 1, "setdefault": 1, "pop": 1, "getattr": 2}  # call -> index of its default argument


def _docstrings(tree) -> set[int]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _target_names(node) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else "" for t in targets]


def _branch_position(node: ast.Constant, parent, grand, names: set[str]) -> str | None:
    """Why the project's name at ``node`` (child of ``parent``, grandchild of ``grand``)
    stands for a backend: compared, a table's key, a default, assigned as a backend."""
    if isinstance(parent, ast.Compare) or (isinstance(parent, (ast.Tuple, ast.List, ast.Set))
                                           and isinstance(grand, ast.Compare)):
        return "compared"
    if isinstance(parent, ast.Dict) and any(k is node for k in parent.keys):
        return "a dict key"
    if (isinstance(parent, ast.Subscript) and parent.slice is node) or (
            isinstance(parent, ast.Tuple) and isinstance(grand, ast.Subscript) and grand.slice is parent):
        return "a subscript"
    if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and any(
            isinstance(e, ast.Constant) and e.value in names - {PROJECT} for e in parent.elts):
        return "listed with other backend names"
    if isinstance(parent, ast.arguments) or isinstance(parent, ast.MatchValue):
        return "a default" if isinstance(parent, ast.arguments) else "a match case"
    if isinstance(parent, ast.keyword) and ("backend" in (parent.arg or "") or parent.arg == "default"):
        return f"the argument {parent.arg}="
    if isinstance(parent, ast.Call) and node in parent.args:
        if "backend" in _callee(parent).lower():
            return f"an argument of {_callee(parent)}()"
        if DEFAULTS.get(_callee(parent)) == parent.args.index(node):
            return f"the default of {_callee(parent)}()"
    if isinstance(parent, (ast.Assign, ast.AnnAssign)) and parent.value is node:
        if isinstance(grand, ast.ClassDef) or isinstance(parent, ast.AnnAssign):
            return "a field's default"
        if any("backend" in t.lower() for t in _target_names(parent)):
            return "assigned as a backend"
    return None


def backend_names_used(path: pathlib.Path, names: set[str], rel: str = "") -> list[str]:
    """Where the module at ``path`` names a backend (a string constant equal to a registered
    backend name, outside docstrings): any such constant, except the project's own name
    ``"dlbatch"``, which is flagged only where it would stand for the backend (`_branch_position`)."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    docs = _docstrings(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value in names) or id(node) in docs:
            continue
        parent = parents.get(id(node))
        grand = parents.get(id(parent)) if parent is not None else None
        why = "names a backend" if node.value != PROJECT else _branch_position(node, parent, grand, names)
        if why is None or (rel, ast.get_source_segment(source, parent)) in PROJECT_NAME_USES:
            continue
        found.append(f"{rel or path}:{node.lineno}: {node.value!r} {why}")
    return found


def test_no_module_outside_backends_names_a_backend():
    from dlbatch.backends import REGISTRY

    assert PROJECT in REGISTRY  # the rule above knows the project's name is a backend's
    found = []
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if not rel.startswith(("dlbatch/backends/", "dlbatch/bench/")):
                found += backend_names_used(p, set(REGISTRY), rel)
    assert not found, "backend names outside dlbatch/backends/ (ask the registry's class):\n" + "\n".join(found)


def test_the_backend_name_check_catches_the_branches_it_is_for(tmp_path):
    """Branches on a backend name as they were written before the registry: each is found."""
    src = tmp_path / "m.py"
    src.write_text('''"""dlbatch: a docstring may say dlbatch."""
import logging
from typing import Literal
log = logging.getLogger("dlbatch")
PACKAGES = ("dlbatch", "connectors")
BACKENDS = ("dlbatch", "vllm")


class Spec:
    backend: Literal["dlbatch", "vllm"] = "dlbatch"


def engine_config(spec, m):
    own = spec.model.engine_args if spec.model.backend == "dlbatch" else {}
    if getattr(m, "backend", "dlbatch") != "dlbatch":
        return {}
    fields = {**({"model.backend": m.backend} if m.backend != "dlbatch" else {})}
    return make(backend="dlbatch", own=own, fields=fields), backend_class("dlbatch"), ROLES["dlbatch"]
''')
    found = backend_names_used(src, {"dlbatch", "vllm"})
    lines = sorted(int(f.split(":")[-2]) for f in found)
    assert lines == [6, 6, 10, 10, 10, 14, 15, 15, 17, 18, 18, 18], found
    assert any("'vllm' names a backend" in f for f in found) and any("compared" in f for f in found)
