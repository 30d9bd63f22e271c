"""Structured task outputs in jobs: a task's `output:` (json_schema | regex | choices |
grammar) becomes the engine constraint of its requests, and each result row is checked and
typed here before it is committed.

Result layout (docs/structured.md): the raw text stays in ``output``; every row gets
``valid`` (null for free-text tasks, else whether the text matches the task's output spec)
and ``output_error`` (why not); a JSON-schema task ``t`` adds one struct column
``t_json`` typed from its schema (null on other tasks' rows and on invalid rows). One
column per structured task keeps every column's type fixed when tasks have different
schemas, so pandas, polars and DuckDB read the dataset as is.

The runner calls `task_constraints` (request items), `fold_keys` (duplicate folding must not
merge two tasks that differ only in their constraint), `row_fields` (per result row) and
`result_fields` (extra Parquet fields); checkpoint appends those fields to its schema.
"""
from __future__ import annotations

import json
import re
from typing import Any

_MAX_DEPTH = 16  # deeper (or recursive) schemas are stored as JSON text


def constraint_of(output) -> dict | None:
    """The engine constraint ({"kind", "spec"}) of a task's `output:` spec, or None."""
    if output is None:
        return None
    for kind in ("json_schema", "regex", "choices", "grammar"):
        v = getattr(output, kind, None)
        if v is not None:
            return {"kind": kind, "spec": list(v) if kind == "choices" else v}
    return None


def task_constraints(spec) -> dict[str, dict]:
    """{task name: constraint dict} for the tasks that declare an output."""
    out = {}
    for t in spec.tasks:
        c = constraint_of(getattr(t, "output", None))
        if c is not None:
            out[t.name] = c
    return out


def fold_keys(spec) -> dict[str, str]:
    """{task name: canonical constraint text}: part of a request's sampling key."""
    return {name: json.dumps(c, sort_keys=True) for name, c in task_constraints(spec).items()}


# ---- JSON schema -> Arrow type ---------------------------------------------------------------
def _resolve(node: dict, root: dict, seen: tuple) -> tuple[dict, tuple]:
    ref = node.get("$ref")
    if not isinstance(ref, str):
        return node, seen
    if not ref.startswith("#/") or ref in seen:
        return {}, seen  # remote or recursive: stored as JSON text
    target: Any = root
    for part in ref[2:].split("/"):
        target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
    return (target if isinstance(target, dict) else {}), seen + (ref,)


def _types(node: dict) -> list[str]:
    t = node.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if x != "null"]
    for key in ("enum", "const"):
        if key in node:
            vals = node[key] if key == "enum" else [node[key]]
            kinds = {("boolean" if isinstance(v, bool) else "integer" if isinstance(v, int) else "number"
                      if isinstance(v, float) else "string" if isinstance(v, str) else "json") for v in vals if v is not None}
            return sorted(kinds) if len(kinds) == 1 else ["json"]
    alts = node.get("anyOf") or node.get("oneOf")
    if isinstance(alts, list):
        real = [a for a in alts if not (isinstance(a, dict) and a.get("type") == "null")]
        if len(real) == 1 and isinstance(real[0], dict):
            return ["@" + json.dumps(real[0], sort_keys=True)]
    if "properties" in node:
        return ["object"]
    if "items" in node:
        return ["array"]
    return ["json"]


def arrow_type(schema: dict, root: dict | None = None, depth: int = 0, seen: tuple = ()):
    """The Arrow type that holds values of a JSON schema: string, int64, float64, bool,
    list<...>, struct<...> (all fields nullable); anything without one fixed type (unions,
    free-form objects, recursion) is a string holding the JSON text."""
    import pyarrow as pa

    root = schema if root is None else root
    node, seen = _resolve(schema if isinstance(schema, dict) else {}, root, seen)
    types = _types(node)
    if depth > _MAX_DEPTH or len(types) != 1:
        return pa.string()
    t = types[0]
    if t.startswith("@"):
        return arrow_type(json.loads(t[1:]), root, depth + 1, seen)
    simple = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_()}
    if t in simple:
        return simple[t]
    if t == "array":
        items = node.get("items")
        return pa.list_(arrow_type(items, root, depth + 1, seen) if isinstance(items, dict) else pa.string())
    if t == "object" and isinstance(node.get("properties"), dict) and node["properties"]:
        return pa.struct([pa.field(k, arrow_type(v, root, depth + 1, seen)) for k, v in node["properties"].items()])
    return pa.string()


def coerce(value, typ):
    """A validated JSON value shaped for `typ` (from `arrow_type`)."""
    import pyarrow as pa

    if value is None:
        return None
    if pa.types.is_struct(typ):
        if not isinstance(value, dict):
            return None
        return {typ.field(i).name: coerce(value.get(typ.field(i).name), typ.field(i).type) for i in range(typ.num_fields)}
    if pa.types.is_list(typ):
        return [coerce(v, typ.value_type) for v in value] if isinstance(value, list) else None
    if pa.types.is_string(typ):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if pa.types.is_int64(typ):
        return value if isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63 else None
    if pa.types.is_floating(typ):
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if pa.types.is_boolean(typ):
        return value if isinstance(value, bool) else None
    return None


def json_column(task_name: str) -> str:
    return f"{task_name}_json"


def result_fields(spec) -> list:
    """Extra Parquet fields of this job's result rows: valid, output_error, and one typed
    `<task>_json` struct per JSON-schema task."""
    import pyarrow as pa

    fields = [pa.field("valid", pa.bool_()), pa.field("output_error", pa.string())]
    for t in spec.tasks:
        out = getattr(t, "output", None)
        if out is not None and out.json_schema is not None:
            fields.append(pa.field(json_column(t.name), arrow_type(out.json_schema)))
    return fields


# ---- per result row -----------------------------------------------------------------------------
def check_output(output, text: str, finish_reason: str | None) -> tuple[bool, str | None, Any]:
    """(valid, reason if not, parsed value) of one generation against a task's output spec.
    A generation cut by max_tokens is never valid, whatever it looks like."""
    if finish_reason == "length":
        return False, "the generation hit max_tokens before the output was complete", None
    if finish_reason != "stop":
        return False, f"the generation ended with finish_reason={finish_reason!r}", None
    if output.json_schema is not None:
        import jsonschema

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return False, f"not JSON: {e}", None
        try:
            jsonschema.validate(value, output.json_schema)
        except jsonschema.ValidationError as e:
            return False, f"does not match the schema: {e.message}", None
        return True, None, value
    if output.regex is not None:
        ok = re.fullmatch(output.regex, text) is not None
        return ok, None if ok else "does not match the regex", text if ok else None
    if output.choices is not None:
        ok = text in output.choices
        return ok, None if ok else "not one of the choices", text if ok else None
    return True, None, text  # grammar: the engine's matcher accepted it


def row_fields(spec, task_name: str, result: dict) -> dict:
    """The extra columns of one result row (see `result_fields`)."""
    task = next((t for t in spec.tasks if t.name == task_name), None)
    out = getattr(task, "output", None)
    row = {"valid": None, "output_error": None}
    if out is None:
        return row
    valid, reason, value = check_output(out, result.get("output") or "", result.get("finish_reason"))
    row["valid"], row["output_error"] = valid, reason
    if out.json_schema is not None:
        row[json_column(task_name)] = coerce(value, arrow_type(out.json_schema)) if valid else None
    return row
