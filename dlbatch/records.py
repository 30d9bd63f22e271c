"""The records every stage shares: a request's key, a result row and a dead-letter row.

A document becomes request rows (dlbatch/prompts/stage.py), requests become results in
the workers, results become result rows (the driver, map-reduce), and result rows are
committed (dlbatch/output/). Each of those names and shapes is defined here, once.

`RequestKey`: which request a row is. A request is one (document, task) of the job, or a
part of one: a map or reduce request of a chunked task (``part``, dlbatch/prompts/
map_reduce.py) or sample i of a task drawing n samples (``sample``, dlbatch/prompts/
sampling.py). Its name in a request row's ``task`` column is ``<task>[#<part>][~<i>]``
(task names never hold ``#`` or ``~``: the job schema's pattern), and its id on the wire
to the workers is ``<doc_id>::<name>``.

`RESULT_FIELDS`: the columns every result row has, with their Arrow types; the store
appends ``text`` (``output.include_text``), the typed columns of structured and sampled
tasks, and the kept input columns. `result_row` builds one from a request row and its
result. `ERROR_COLUMNS`: a dead-letter row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

PART_SEP = "#"  # <task>#<part>: a map or reduce request of a chunked task
SAMPLE_SEP = "~"  # <task>~<i>: sample i of a task drawing n samples
ID_SEP = "::"  # <doc_id>::<request name>: a request's id in the workers' items


@dataclass(frozen=True)
class RequestKey:
    doc_id: str
    task: str  # the job's task name
    part: Optional[str] = None  # a chunked task's map/reduce request key, e.g. "map:summary:0:3"
    sample: int = 0  # sample i of a task drawing n samples (0: the task's own row)

    @property
    def name(self) -> str:
        """The request's name: a request row's ``task`` column."""
        out = self.task
        if self.part is not None:
            out += PART_SEP + self.part
        if self.sample:
            out += f"{SAMPLE_SEP}{self.sample}"
        return out

    @property
    def id(self) -> str:
        """The request's id in the items a worker takes and the results it returns."""
        return f"{self.doc_id}{ID_SEP}{self.name}"

    @classmethod
    def parse(cls, doc_id: str, name: str) -> "RequestKey":
        """The key of a request row's ``(doc_id, task)``."""
        sample = 0
        if SAMPLE_SEP in name:
            name, _, i = name.rpartition(SAMPLE_SEP)
            sample = int(i)
        task, sep, part = name.partition(PART_SEP)
        return cls(doc_id, task, part if sep else None, sample)

    @classmethod
    def of(cls, row: dict) -> "RequestKey":
        return cls.parse(row["doc_id"], row["task"])

    def with_sample(self, i: int) -> "RequestKey":
        return RequestKey(self.doc_id, self.task, self.part, i)

    def with_part(self, part: Optional[str]) -> "RequestKey":
        return RequestKey(self.doc_id, self.task, part, self.sample)


def prompt_length(row: dict) -> int:
    """A request row's prompt length in the engine: its token ids, each image's placeholder
    counted as the ``image_tokens`` the images take (dlbatch/prompts/multimodal.py)."""
    images = row.get("images")
    return len(row["prompt_ids"]) + ((row.get("image_tokens") or 0) - len(images) if images else 0)


def request_inputs(row: dict) -> dict:
    """What a request row sends a worker besides its token ids and sampling: its adapter's
    name (``adapter``) and its images (``images``: the compressed bytes, in prompt order,
    decoded only by the worker's engine); {} for a base-model text request."""
    out = {}
    if row.get("adapter"):
        out["adapter"] = row["adapter"]
    if row.get("images"):
        out["images"] = list(row["images"])
    return out


def prefix_salt(adapter: Optional[str], image_digests=()) -> Optional[str]:
    """What a request's prompt prefix is computed under besides its token ids: its LoRA
    adapter and its images (digests of their bytes, in prompt order); None for a base-model
    text request. Two requests share prefix KV only when their salts are equal: the router
    seeds its block hashes with it, the prefix order keys documents by it, folding compares it."""
    if not adapter and not image_digests:
        return None
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for part in (adapter or "", *image_digests):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def base_task(name: str) -> str:
    """The job's task a request name belongs to: ``keywords#map:keywords:0:3`` -> ``keywords``,
    ``keywords~2`` -> ``keywords``."""
    return name.split(PART_SEP, 1)[0].split(SAMPLE_SEP, 1)[0]


def request_id(row: dict) -> str:
    """A request row's id (`RequestKey.id`)."""
    return f"{row['doc_id']}{ID_SEP}{row['task']}"


def _result_fields():
    import pyarrow as pa

    return [("doc_id", pa.string()), ("source", pa.string()), ("task", pa.string()), ("output", pa.string()),
            ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()), ("finish_reason", pa.string()),
            ("truncated", pa.bool_()), ("model", pa.string()), ("ttft_s", pa.float64()), ("latency_s", pa.float64()),
            # long documents (docs/long_documents.md): the policy applied (null: the document fit),
            # its length, the tokens of it the model saw, the chunks of a map-reduce
            ("long_input_policy", pa.string()), ("doc_tokens", pa.int64()), ("kept_tokens", pa.int64()),
            ("chunks", pa.int64()),
            # a table row's version: the hash of what its prompts read (dlbatch/prompts/doc_identity.py)
            ("doc_version", pa.string())]


RESULT_COLUMNS = ["doc_id", "source", "task", "output", "prompt_tokens", "output_tokens", "finish_reason",
                  "truncated", "model", "ttft_s", "latency_s", "long_input_policy", "doc_tokens", "kept_tokens",
                  "chunks", "doc_version"]  # the names of `_result_fields`, importable without pyarrow
ERROR_COLUMNS = ["doc_id", "source", "task", "stage", "error_type", "error"]  # task None: the whole document
INDEX_COLUMNS = ["doc_id", "source", "task", "prompt_tokens", "output_tokens"]  # what progress reads
SAMPLE_INDEX = "sample_index"  # a row's sample with output.samples: rows (dlbatch/prompts/sampling.py)


def index_columns(names) -> list[str]:
    """The index columns of a table with column ``names``: INDEX_COLUMNS, and ``sample_index``
    where its rows are one per sample."""
    return INDEX_COLUMNS + ([SAMPLE_INDEX] if SAMPLE_INDEX in names else [])


def result_schema(include_text: bool, extra_fields=()):
    """The Arrow schema of committed result rows: RESULT_COLUMNS, ``text`` when the job keeps
    it, then ``extra_fields`` (pyarrow fields: structured and sampled tasks' columns)."""
    import pyarrow as pa

    fields = _result_fields() + ([("text", pa.string())] if include_text else [])
    return pa.schema(fields + [(f.name, f.type) for f in extra_fields])


def error_schema():
    import pyarrow as pa

    return pa.schema([(c, pa.string()) for c in ERROR_COLUMNS])


def result_row(request: dict, result: dict, model: str, *, task: Optional[str] = None,
               extra: Optional[Callable[[str, dict], dict]] = None, **overrides) -> dict:
    """One result row: the request row it answers (``doc_id``, ``source``, ``prompt_ids``, the
    long-input marks, ``text``, ``columns``), the engine's ``result`` (``output``, token
    counts, finish reason, timings) and ``extra(task, result)`` (typed columns). ``task``:
    the row's task when it is not the request's own name (a chunked task's final row);
    ``overrides``: fields whose value is not the request's (a chunked task's token sums)."""
    task = task or request["task"]
    row = {"doc_id": request["doc_id"], "source": request["source"], "task": task,
           "output": result.get("output", ""), "prompt_tokens": prompt_length(request),
           "output_tokens": result.get("output_tokens", 0), "finish_reason": result.get("finish_reason"),
           "truncated": bool(request.get("truncated")), "model": model, "ttft_s": result.get("ttft_s"),
           "latency_s": result.get("latency_s"), "text": request.get("text"),
           "long_input_policy": request.get("long_input_policy"), "doc_tokens": request.get("doc_tokens"),
           "kept_tokens": request.get("kept_tokens"), "chunks": None, "columns": request.get("columns"),
           "doc_version": request.get("doc_version"),
           # written where the job's rows carry images (multimodal.result_fields)
           "images": len(request["images"]) if request.get("images") else 0, "image_tokens": request.get("image_tokens") or 0}
    row.update(overrides)
    if extra is not None:
        row.update(extra(task, result))
    return row
