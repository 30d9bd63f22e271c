"""docs/jobs.md against the job schema: every key of `JobSpec` is documented, nothing else
is, and each documented default is the schema's (so the reference cannot drift)."""
from __future__ import annotations

import pathlib
import re
import types
import typing

import yaml
from pydantic import BaseModel

from dlbatch.jobspec import JobSpec

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "jobs.md"
ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|")
# defaults written in words because the value is long text
WORDED = {"chunking.map_prompt": "the built-in map prompt", "chunking.reduce_prompt": "the built-in reduce prompt"}
REQUIRED, SECTION, LIST = "required", "(section)", "(list)"


def _unwrap(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _model(annotation):
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def schema_keys(model=JobSpec, prefix: str = "", defaults=None) -> dict:
    """{key path: default} of every key; a section's default is SECTION (LIST for a list of
    sections, None when the section is optional and off), a key without one REQUIRED.
    Defaults of keys inside a section come from the section's default value (a pool's chip
    differs between cluster.prefill and cluster.decode)."""
    out = {}
    for name, f in model.model_fields.items():
        path, ann = prefix + name, _unwrap(f.annotation)
        if defaults is not None:
            value = getattr(defaults, name)
        else:
            value = REQUIRED if f.is_required() else f.get_default(call_default_factory=True)
        item = _model(typing.get_args(ann)[0]) if typing.get_origin(ann) is list else None
        if _model(ann):
            out[path] = SECTION if isinstance(value, BaseModel) else value
            out.update(schema_keys(ann, path + ".", value if isinstance(value, BaseModel) else None))
        elif item is not None:
            out[path] = LIST
            out.update(schema_keys(item, path + "[].", None))
        else:
            out[path] = value
    return out


def documented() -> dict:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"docs/jobs.md documents {m.group(1)!r} twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def _same(key: str, doc: str, value) -> bool:
    if key in WORDED:
        return doc == WORDED[key]
    if doc in (REQUIRED, SECTION, LIST):
        return value == doc
    if not (doc.startswith("`") and doc.endswith("`")):
        return False
    given = yaml.safe_load(doc.strip("`"))
    if key in ("input.path", "output.path"):  # resolved against the current directory when loaded
        return isinstance(value, str) and value.endswith("/" + given)
    return given == value


def test_every_schema_key_is_documented_with_its_default():
    keys = schema_keys(JobSpec, "", JobSpec(name="x", pipeline="papers"))
    keys["name"], keys["pipeline"] = REQUIRED, REQUIRED
    keys["tasks"] = LIST  # the default tasks are shown in words
    docs = documented()
    missing = sorted(set(keys) - set(docs))
    extra = sorted(set(docs) - set(keys))
    assert not missing, f"keys of the schema missing from docs/jobs.md: {missing}"
    assert not extra, f"docs/jobs.md documents keys the schema does not have: {extra}"
    wrong = [f"{k}: documented {docs[k]}, schema {keys[k]!r}" for k in keys if not _same(k, docs[k], keys[k])]
    assert not wrong, "docs/jobs.md defaults differ from the schema:\n" + "\n".join(wrong)


def test_the_check_catches_a_wrong_default_and_a_missing_key():
    assert not _same("router.window", "`128`", 256)
    assert _same("router.window", "`256`", 256)
    assert not _same("model.chat", "`false`", None)
    keys = schema_keys(JobSpec, "", JobSpec(name="x", pipeline="papers"))
    assert "cluster.decode.chip" in keys and keys["cluster.decode.chip"] == "cheap"
    assert "tasks[].sampling.n" in keys
