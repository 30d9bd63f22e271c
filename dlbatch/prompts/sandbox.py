"""The Jinja sandbox prompt templates render in, and the bounds of one render.

A template runs once per (document, task) and comes from a job file, so no template may hang
or exhaust the process's memory. The sandbox is Jinja's ``ImmutableSandboxedEnvironment``
(no ``_`` attributes, no mutation) with these bounds, all held by one :class:`RenderBudget`
per render (a context variable, so nested and concurrent renders each have their own):

* **steps**: loop iterations and ``range()`` items, all loops together, at most
  ``MAX_LOOP_STEPS``; ``range()`` at most ``MAX_RANGE`` items; a wall-time deadline
  (``MAX_RENDER_SECONDS``) checked at every step. Every ``{% for %}`` is compiled with a guard.
* **values**: every value the template builds is at most ``max_chars`` characters, measured
  as its text would be (:func:`measure`: a list or mapping counts the text of what it holds,
  at any depth). The size is checked *before* the value is built wherever one operation can
  grow it past any multiple of its operands: ``~`` (every concatenation is compiled to a
  guard), ``+`` and ``*`` of strings and lists, ``%`` and ``str.format`` (each field's
  argument and width counted), the ``replace``, ``join``, ``indent`` and ``wordwrap`` filters
  and the ``replace``, ``join``, ``expandtabs`` methods, ``lipsum``; integers are bounded to
  ``MAX_INT_BITS`` bits before ``*`` and ``**``. The result of every other filter and call is
  measured after it returns (each grows its input by a small factor at most).
* **written**: what the template writes, its output and every captured block (``{% set %}``
  blocks, macros, ``{% filter %}``, ``{% call %}``), literal text included, at most
  ``WRITTEN_FACTOR * max_chars`` characters in all; every output node is compiled to a guard.
* the rendered prompt itself at most ``max_chars`` (checked piece by piece as it streams).

``max_chars`` is ``MAX_RENDER_CHARS`` plus four times what the render is given (the measure
of its context: the document's text, the row's columns, ...), so a longer document may build
proportionally more and a template that builds values unrelated to its input is bounded by a
constant. A bound that is hit raises :class:`RenderLimit` naming it; the callers
(dlbatch/prompts/templates.py) turn it, and a MemoryError, into the task's TemplateError:
at load for the sample document (the template is refused), at run time that document's task
error.

Integer arguments of calls and filters are at most ``MAX_ARGUMENT`` and a format's widths and
precisions at most six digits, so no single argument asks for a huge value either.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import re
import string
import time
from collections.abc import Mapping

from jinja2 import nodes, pass_context
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

MAX_LOOP_STEPS = 100_000      # loop iterations + range() items of one render, all loops together
MAX_RANGE = 10_000            # items of one range()
MAX_RENDER_SECONDS = 10.0     # wall time of one render, checked at every loop step
MAX_RENDER_CHARS = 1 << 20    # characters of one value or rendered prompt beyond 4x the render's input
WRITTEN_FACTOR = 4            # characters written (output + captured blocks): this many times max_chars
MAX_ARGUMENT = 1_000_000      # an integer argument of a filter or method call (widths, counts)
MAX_INT_BITS = 1 << 16        # an integer built by * or ** (about 19,700 digits)
MAX_LIPSUM_WORDS = 100_000    # lipsum(n, html, min, max): n * max words at most
_WIDE_FORMAT = re.compile(r"[0-9]{7,}")  # a width or precision of 7+ digits in a format string
_PERCENT = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])")

LOOP_GUARD = "dlbatch loop guard"      # guard filters: names no template can spell
CONCAT_GUARD = "dlbatch concat guard"
OUTPUT_GUARD = "dlbatch output guard"


class RenderLimit(Exception):
    """A render went past one of the bounds of :class:`RenderBudget` (message names it)."""


class RenderBudget:
    """What one render may spend: loop steps, wall time, the size of each value it builds and
    the characters it writes."""

    def __init__(self, max_chars: int = MAX_RENDER_CHARS, steps: int = MAX_LOOP_STEPS,
                 seconds: float = MAX_RENDER_SECONDS):
        self.max_chars = max_chars
        self.steps_left = steps
        self.steps = steps
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.written = 0

    def charge(self, n: int) -> None:
        self.steps_left -= n
        if self.steps_left < 0:
            raise RenderLimit(f"loops and range() ran more than {self.steps} steps")
        if time.monotonic() > self.deadline:
            raise RenderLimit(f"the render ran longer than {self.seconds:g} s")

    def check_size(self, n: int, what: str = "the rendered prompt") -> None:
        if n > self.max_chars:
            raise RenderLimit(f"{what} would be {n} characters, over {self.max_chars}")

    def write(self, n: int) -> None:
        self.written += n
        limit = WRITTEN_FACTOR * self.max_chars
        if self.written > limit:
            raise RenderLimit(f"the template wrote more than {limit} characters (output and captured blocks)")


def budget_for(context: Mapping) -> RenderBudget:
    """A fresh budget for a render given ``context``: ``max_chars`` from what it holds (the
    row's columns once, not again under their plain names)."""
    row = context.get("row")
    aliases = {id(v) for v in row.values()} if isinstance(row, Mapping) else set()
    given = sum(_given_size(v) for k, v in context.items() if k == "row" or id(v) not in aliases)
    return RenderBudget(max_chars=MAX_RENDER_CHARS + 4 * given)


def _given_size(value) -> int:
    """The size of one input of a render: a string's length, else its JSON text's (C speed:
    a row's columns are measured once per render), else :func:`measure`."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (Mapping, list, tuple)):
        import json

        try:
            return len(json.dumps(value, ensure_ascii=False, default=str))
        except (TypeError, ValueError):  # keys JSON cannot spell, a cycle
            pass
    return measure(value)


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("dlbatch_render_budget", default=None)


def current_budget() -> RenderBudget:
    budget = _BUDGET.get()
    return budget if budget is not None else RenderBudget()  # outside a render: each operation bounded alone


@contextlib.contextmanager
def bounded(budget: RenderBudget):
    """``with bounded(budget):`` what renders inside charges ``budget``."""
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


# ------------------------------------------------------------------ sizes


def measure(value, cap: int | None = None) -> int:
    """About the characters ``str(value)`` has: a string's length, a container's items at any
    depth (two more for each item's separator or quotes), small for anything else. Counting
    stops once past ``cap``: the walk costs at most about ``cap`` steps (a cycle adds at least
    two per turn), so a value over the bound costs no more to refuse than one under it."""
    total, stack = 0, [(value, False)]
    while stack:
        v, inside = stack.pop()
        if isinstance(v, str):
            total += len(v) + (2 if inside else 0)
        elif isinstance(v, (bytes, bytearray)):
            total += len(v) + 3
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 1
        elif isinstance(v, Mapping) or isinstance(v, Namespace):
            items = v._Namespace__attrs if isinstance(v, Namespace) else v
            total += 2 + 2 * len(items)
            stack.extend((x, True) for kv in items.items() for x in kv)
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(v)
            stack.extend((x, True) for x in v)
        else:
            total += 8
        if cap is not None and total > cap:
            return total
    return total


def _int_bits(left, right, operator: str) -> None:
    if isinstance(left, bool) or isinstance(right, bool) or not (isinstance(left, int) and isinstance(right, int)):
        return
    if operator == "*":
        bits = left.bit_length() + right.bit_length()
    elif abs(left) > 1 and right > 0:
        bits = left.bit_length() * right
    else:
        return
    if bits > MAX_INT_BITS:
        raise RenderLimit(f"{_short(left)} {operator} {_short(right)} is too large (over {MAX_INT_BITS} bits)")


def _short(value, limit: int = 30) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 100 else f"<{value.bit_length()}-bit int>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _replace_size(s, old, new, count=None) -> int:
    s, old, new = str(s), str(old), str(new)
    n = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * (len(new) - len(old))


def _join_size(items: list, sep) -> int:
    return measure(items, current_budget().max_chars) + len(str(sep)) * max(len(items) - 1, 0)


def _percent_size(fmt: str, args) -> int:
    """An upper bound of ``len(fmt % args)``: each conversion's argument and width counted."""
    positional = list(args) if isinstance(args, tuple) else [args]
    size = len(fmt)
    for key, width, precision, conversion in _PERCENT.findall(fmt):
        if conversion == "%":
            continue
        for n in (width, precision):
            if n == "*":
                size += abs(positional.pop(0)) if positional and isinstance(positional[0], int) else 0
            elif n:
                size += int(n)
        if key:
            value = args.get(key) if isinstance(args, Mapping) else None
        else:
            value = positional.pop(0) if positional else None
        size += measure(value)
    return size


def _format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """An upper bound of ``len(fmt.format(*args, **kwargs))``: each field's argument (the
    whole of it for ``{0.a}`` / ``{0[k]}``) and the widths in its spec counted."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return len(fmt)  # the format itself raises
    size, auto = 0, 0
    for literal, name, spec, _ in fields:
        size += len(literal)
        if name is None:
            continue
        root = re.split(r"[.\[]", name, maxsplit=1)[0]
        if root == "":
            value, auto = (args[auto] if auto < len(args) else None), auto + 1
        elif root.isdigit():
            value = args[int(root)] if int(root) < len(args) else None
        else:
            value = kwargs.get(root)
        size += measure(value) + sum(int(d) for d in re.findall(r"\d+", spec or ""))
        if spec and "{" in spec:
            size += MAX_ARGUMENT
    return size


def _wrap_size(s, width, wrapstring) -> int:
    s = str(s)
    return len(s) + (len(s) + 1) * len(str(wrapstring or "\n"))


def _indent_size(s, width=4) -> int:
    s = str(s)
    w = len(width) if isinstance(width, str) else int(width) if isinstance(width, int) else 0
    return len(s) + (s.count("\n") + 1) * abs(w)


def _check_arguments(args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARGUMENT:
            raise RenderLimit(f"argument {_short(a)} is over {MAX_ARGUMENT}")


def check_format(fmt) -> None:
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise RenderLimit(f"format {fmt[:40]!r} has a width or precision over 6 digits")


def _check_result(value, what: str):
    budget = current_budget()
    budget.check_size(measure(value, budget.max_chars), what)
    return value


# ------------------------------------------------------------------ guards compiled into every template


@pass_context
def _loop_guard(context, iterable):
    budget = current_budget()
    for item in iterable:
        budget.charge(1)
        yield item


@pass_context
def _concat_guard(context, parts):
    budget = current_budget()
    budget.check_size(sum(measure(p, budget.max_chars) for p in parts), "a ~ concatenation")
    return "".join(map(str, parts))


@pass_context
def _output_guard(context, value):
    budget = current_budget()
    n = measure(value, budget.max_chars)
    budget.check_size(n, "a value written")
    budget.write(n)
    return value


class _Guards(NodeTransformer):
    """Compiles the guards in: every loop's iterable, every ``~``, every output node's parts
    (literal text as a constant, so it is charged too). The guards take the context, so Jinja's
    optimizer never runs them at compile time."""

    @staticmethod
    def _guard(node: nodes.Expr, name: str, lineno: int) -> nodes.Filter:
        return nodes.Filter(node, name, [], [], None, None, lineno=lineno)

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = self._guard(node.iter, LOOP_GUARD, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return self._guard(nodes.List(node.nodes, lineno=node.lineno), CONCAT_GUARD, node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        node = self.generic_visit(node)
        node.nodes = [self._guard(nodes.Const(c.data, lineno=c.lineno) if isinstance(c, nodes.TemplateData) else c,
                                  OUTPUT_GUARD, c.lineno) for c in node.nodes]
        return node


def _bounded_range(*args):
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise RenderLimit(f"range{args} has {len(r)} items, over {MAX_RANGE}")
    current_budget().charge(len(r))
    return r


def _bounded_lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 (lipsum's own argument names)
    if isinstance(n, int) and isinstance(max, int) and n > 0 and n * max > MAX_LIPSUM_WORDS:
        raise RenderLimit(f"lipsum({n}, max={max}) would write up to {n * max} words, over {MAX_LIPSUM_WORDS}")
    return generate_lorem_ipsum(n, html, min, max)


_FILTER_SIZES = {  # filter -> the size of its result from its bound arguments, known before it runs
    "replace": lambda a: _replace_size(a["s"], a["old"], a["new"], a.get("count")),
    "indent": lambda a: _indent_size(a["s"], a.get("width", 4)),
    "wordwrap": lambda a: _wrap_size(a["s"], a.get("width", 79), a.get("wrapstring")),
    "format": lambda a: _percent_size(str(a["value"]), a.get("kwargs") or a.get("args") or ()),
    "join": lambda a: _join_size(a["value"], a.get("d", "")),
}


def _bounded_filter(name: str, f):
    """``f`` with its integer arguments bounded, its result's size checked before it runs where
    :data:`_FILTER_SIZES` knows it, and measured after it returns."""
    skip = 2 if getattr(f, "jinja_pass_arg", None) is not None else 1  # (context,) value, then arguments
    try:
        sig = inspect.signature(f) if name in _FILTER_SIZES else None
    except (TypeError, ValueError):
        sig = None

    @functools.wraps(f)
    def run(*args, **kwargs):
        _check_arguments(args[skip:], kwargs)
        if name == "format":
            check_format(args[skip - 1])
        if sig is not None:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return f(*args, **kwargs)  # wrong arguments: the filter's own error names them
            if name == "join" and "value" in bound.arguments:
                bound.arguments["value"] = list(bound.arguments["value"])  # a generator is read once
            current_budget().check_size(_FILTER_SIZES[name](bound.arguments), f"the {name} filter's result")
            args, kwargs = bound.args, bound.kwargs
        return _check_result(f(*args, **kwargs), f"the {name} filter's result")
    return run


def _str_method(receiver: str, method: str, args: tuple, kwargs: dict) -> tuple:
    """Check the size of a growing ``str`` method's result before it runs; returns the
    arguments to call it with (``join``'s iterable read into a list)."""
    budget = current_budget()
    if method == "replace" and len(args) >= 2:
        size = _replace_size(receiver, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
    elif method == "join" and len(args) == 1:
        args = (list(args[0]),)
        size = _join_size(args[0], receiver)
    elif method == "format":
        size = _format_size(receiver, args, kwargs)
    elif method == "format_map" and len(args) == 1 and isinstance(args[0], Mapping):
        size = _format_size(receiver, (), args[0])
    elif method == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        size = len(receiver) + receiver.count("\t") * (tab if isinstance(tab, int) else 0)
    else:
        return args
    budget.check_size(size, f"the result of str.{method}()")
    return args


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with the render bounds (module docstring): guarded loops,
    concatenations and output; bounded ``range`` and ``lipsum``; the operators, filters and
    calls that build values checked."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.globals["range"] = _bounded_range
        self.globals["lipsum"] = _bounded_lipsum
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update({LOOP_GUARD: _loop_guard, CONCAT_GUARD: _concat_guard, OUTPUT_GUARD: _output_guard})

    def _generate(self, source, name, filename, defer_init=False):
        # every compile passes here (templates and compile_expression's expressions alike)
        return super()._generate(_Guards().visit(source), name, filename, defer_init=defer_init)

    def call_binop(self, context, operator, left, right):
        budget = current_budget()
        cap = budget.max_chars
        if operator == "+":
            if isinstance(left, str) and isinstance(right, str):
                budget.check_size(len(left) + len(right), "a + of strings")
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                budget.check_size(measure(left, cap) + measure(right, cap), "a + of lists")
        elif operator == "*":
            _int_bits(left, right, "*")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                    budget.check_size(measure(seq, cap) * max(n, 0), f"{type(seq).__name__} * {n}")
        elif operator == "**":
            _int_bits(left, right, "**")
        elif operator == "%" and isinstance(left, str):
            check_format(left)
            budget.check_size(_percent_size(left, right), "a % format")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _check_arguments(args, kwargs)
        method = getattr(__obj, "__name__", "")
        receiver = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if method in ("format", "format_map"):  # str.format's receiver is the format
            check_format(receiver)
        if isinstance(receiver, str):
            args = _str_method(receiver, method, args, kwargs)
        if isinstance(__obj, LoopContext) and args:  # loop(children) of a recursive loop: charged like a loop
            args = (_loop_guard(__context, args[0]), *args[1:])
        return _check_result(super().call(__context, __obj, *args, **kwargs), f"the result of {method or 'a call'}()")
