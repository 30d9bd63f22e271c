"""The code stays readable in one sitting (docs/development.md, "How the code is shaped"): no
class in the run, output or worker packages over 300 lines, no function outside the benches
over 80 lines. A class or function that grows past them is two concepts: split it."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_CLASS = 300  # lines of a class in dlbatch/driver, dlbatch/output, dlbatch/workers
MAX_FUNCTION = 80  # lines of a function or method anywhere in dlbatch/ outside dlbatch/bench
CLASS_PACKAGES = ("driver", "output", "workers")


def _defs(kinds):
    for path in sorted((ROOT / "dlbatch").rglob("*.py")):
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, kinds):
                yield rel, node, node.end_lineno - node.lineno + 1


def test_no_class_of_the_run_output_or_workers_is_over_300_lines():
    big = [f"{rel}:{n.lineno} {n.name}: {size} lines" for rel, n, size in _defs(ast.ClassDef)
           if rel.parts[1] in CLASS_PACKAGES and size > MAX_CLASS]
    assert not big, "classes over 300 lines:\n" + "\n".join(big)


def test_no_function_outside_the_benches_is_over_80_lines():
    big = [f"{rel}:{n.lineno} {n.name}: {size} lines"
           for rel, n, size in _defs((ast.FunctionDef, ast.AsyncFunctionDef))
           if rel.parts[1] != "bench" and size > MAX_FUNCTION]
    assert not big, "functions over 80 lines:\n" + "\n".join(big)


def test_the_measure_sees_a_long_function(tmp_path):
    """The walk counts a nested function's lines and a decorated method's body."""
    src = "class A:\n    @staticmethod\n    def f():\n" + "        x = 1\n" * 90
    (node,) = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef)]
    assert node.end_lineno - node.lineno + 1 == 91
