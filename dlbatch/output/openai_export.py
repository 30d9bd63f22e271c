"""``output.format: openai_batch``: the committed rows as OpenAI Batch API output files.

The committed store stays the Parquet parts (exactly once, resume, compaction); when a run
completes, `export` writes from what is committed:

* ``<output>/results.jsonl``: one line per answered request,
  ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``,
  the body a ``chat.completion`` (url /v1/chat/completions) or ``text_completion`` object with
  n ``choices`` (index 0..n-1, the row's samples in order), their ``finish_reason`` ("stop" |
  "length"), ``logprobs`` in the API's shape when the request asked (else null) and ``usage``
  (the prompt counted once, every choice's tokens);
* ``<output>/errors.jsonl``: one line per dead-lettered line,
  ``{"id", "custom_id", "response": null, "error": {"code", "message"}}`` (code: the dead
  letter's error_type; custom_id read back from the request line, null when it has none).

Invariants: lines are in input order (file, then line number: the row's ``source``); the
files are a function of the committed rows only — ``id``/``request_id`` are hashes of the
custom_id (`connectors.openai_batch.line_hash`) and ``created`` is 0 — so a rerun, a resume or
a compaction writes identical files; each file is written whole to a temporary name and
renamed into place (`OutputFiles.write_file`, under the lease), so a reader never sees half a
file. The export reads the committed rows through the `Store` protocol only (``results``,
``errors``), so it writes the same files from Parquet parts or a Delta table.

Logprobs: chat ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}], "refusal": null}``; completions ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}`` (offsets into the generated text). The
entries are the engine's, one per generated token, EOS included when it ended the output.
"""
from __future__ import annotations

import json
import logging
import re

log = logging.getLogger("dlbatch.output.openai_export")

RESULTS_FILE = "results.jsonl"
ERRORS_FILE = "errors.jsonl"
_LINE = re.compile(r"^(.*)#line([0-9]+)$")
RESULT_READ = ["doc_id", "source", "task", "output", "prompt_tokens", "output_tokens", "finish_reason", "model",
               "samples", "logprobs", "custom_id", "url"]


def wanted(spec) -> bool:
    return getattr(spec.output, "format", None) == "openai_batch"


def order_key(source: str) -> tuple:
    """(input file, line number) of a row's source; a whole-file row sorts first in its file."""
    m = _LINE.match(source or "")
    return (m.group(1), int(m.group(2))) if m else (source or "", 0)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", "surrogatepass"))


def chat_logprobs(entries: list | None) -> dict | None:
    if entries is None:
        return None
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": _bytes(e["token"]),
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])}
                                          for t in e.get("top") or ()]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list | None) -> dict | None:
    if entries is None:
        return None
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top") or ()} for e in entries],
            "text_offset": offsets}


def response_line(row: dict) -> dict:
    """One committed result row (RESULT_READ columns) -> its results.jsonl line."""
    cid = row.get("custom_id") or row["doc_id"]
    h = line_hash(cid, row["source"])
    chat = row.get("url") != "/v1/completions"
    samples = row.get("samples") or [{"output": row.get("output") or "", "output_tokens": row.get("output_tokens"),
                                      "finish_reason": row.get("finish_reason"), "logprobs": row.get("logprobs")}]
    choices = []
    for i, s in enumerate(samples):
        finish = "length" if s.get("finish_reason") == "length" else "stop"
        text = s.get("output") or ""
        if chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": chat_logprobs(s.get("logprobs")), "finish_reason": finish})
        else:
            choices.append({"index": i, "text": text, "logprobs": completion_logprobs(s.get("logprobs")),
                            "finish_reason": finish})
    prompt = int(row.get("prompt_tokens") or 0)
    completion = sum(int(s.get("output_tokens") or 0) for s in samples)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{h}", "object": "chat.completion" if chat else "text_completion",
            "created": 0, "model": row.get("model"), "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
    return {"id": f"batch_req_{h}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{h}", "body": body}, "error": None}


def error_line(row: dict, custom_id: str | None) -> dict:
    """One dead letter (ERROR_COLUMNS) -> its errors.jsonl line."""
    return {"id": f"batch_req_{line_hash(custom_id, row['source'])}", "custom_id": custom_id, "response": None,
            "error": {"code": row.get("error_type") or "Error", "message": row.get("error") or ""}}


def line_hash(custom_id, source):
    from connectors.openai_batch import line_hash as h

    return h(custom_id, source)


def export(spec, store) -> dict:
    """Write results.jsonl and errors.jsonl under the output from its committed rows (see
    the module docstring); returns {"results": n, "errors": m}."""
    table = store.results()
    names = set(table.schema.names)
    rows = table.select([c for c in RESULT_READ if c in names]).to_pylist() if table.num_rows else []
    rows.sort(key=lambda r: order_key(r["source"]))
    errs = store.errors(columns=["doc_id", "source", "task", "stage", "error_type", "error"])
    errs = errs.to_pylist() if errs is not None and errs.num_rows else []
    errs.sort(key=lambda r: order_key(r["source"]))
    cids = _error_custom_ids(spec, errs)
    _write_lines(store, RESULTS_FILE, [response_line(r) for r in rows])
    _write_lines(store, ERRORS_FILE, [error_line(e, cids.get(e["source"])) for e in errs])
    log.info("wrote %d response lines and %d error lines under %s", len(rows), len(errs), store.files.url)
    return {"results": len(rows), "errors": len(errs)}


def _error_custom_ids(spec, errs: list[dict]) -> dict[str, str]:
    """{source: custom_id} of the dead letters, read back from their request lines (a file
    that cannot be read now gives none: those lines say custom_id null)."""
    from connectors.listing import _url_to_fs
    from connectors.openai_batch import custom_ids

    by_file: dict[str, set[int]] = {}
    for e in errs:
        path, line = order_key(e["source"])
        if line:
            by_file.setdefault(path, set()).add(line)
    out: dict[str, str] = {}
    for path, lines in by_file.items():
        try:
            fs, p = _url_to_fs(path, dict(spec.input.storage_options))
            for n, cid in custom_ids(p, fs, lines).items():
                out[f"{path}#line{n}"] = cid
        except OSError as err:
            log.warning("could not read %s for the custom_ids of its dead letters: %s", path, err)
    return out


def _write_lines(store, name: str, lines: list[dict]) -> None:
    """``name`` under the output, written whole under the lease (`OutputFiles.write_file`)."""
    data = "".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines).encode("utf-8", "surrogatepass")
    store.files.write_file(name, data)


def clear(store) -> None:
    """--fresh: the exported files go with the rows they were written from."""
    for name in (RESULTS_FILE, ERRORS_FILE):
        store.files.rm(store.files.path(name))


def missing(store) -> bool:
    """Whether the output lacks its exported results file."""
    return not store.files.exists(RESULTS_FILE)
