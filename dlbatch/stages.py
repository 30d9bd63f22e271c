"""Ray Data stages of the document pipelines: parse files into documents, render each
document's task prompts (sandboxed Jinja, chat template), tokenize, and handle long inputs.

Each stage is a plain function or callable class over rows/batches, so it runs in Ray
Data's workers and is unit-testable without Ray.
"""
from __future__ import annotations

import hashlib
import logging

log = logging.getLogger("dlbatch.stages")

REQUEST_COLUMNS = ["doc_id", "source", "title", "pages", "task", "task_index", "prompt_ids", "max_tokens",
                   "truncated", "seed", "text", "stage", "error_type", "error"]


def derive_seed(job_seed: int, doc_id: str, task: str) -> int:
    """Per-(document, task) seed: resumes and retries sample the same tokens."""
    h = hashlib.sha256(f"{job_seed}:{doc_id}:{task}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def parse_file(row: dict, fmt: str, text_field: str, id_field: str | None, storage_options: dict | None,
               max_pages: int | None) -> list[dict]:
    """flat_map: one input file -> its documents (error rows for bad ones, never raises
    for bad content; infrastructure errors after retries do raise and fail the job)."""
    from connectors import read_document_file

    url = row["url"]
    out = []
    try:
        for doc in read_document_file(url, fmt, text_field=text_field, id_field=id_field,
                                      storage_options=storage_options, max_pages=max_pages):
            out.append(doc)
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as e:  # a file the reader cannot handle becomes a dead letter
        from connectors.ids import content_id

        out.append({"doc_id": content_id(url.encode()), "source": url, "text": "", "title": None, "pages": None,
                    "error": f"{type(e).__name__}: {e}"[:500], "error_type": type(e).__name__})
    return [{"doc_id": str(d["doc_id"]), "source": str(d["source"]), "text": d.get("text") or "",
             "title": d.get("title"), "pages": d.get("pages"), "error": d.get("error"),
             "error_type": d.get("error_type")} for d in out]


class PromptStage:
    """map_batches: documents -> K request rows each (all of a document's rows in the same
    output batch, document first so the tasks share it as prefix)."""

    def __init__(self, spec_dict: dict, skip_doc_ids=None):
        from dlbatch.engine.loader import load_tokenizer
        from dlbatch.jobspec import parse_job
        from dlbatch.templates import compile_task_templates

        self.spec = parse_job(spec_dict, source="<job>")
        m = self.spec.model
        self.tok = load_tokenizer(m.name)
        self.chat = (self.tok.chat_template is not None) if m.chat is None else bool(m.chat)
        self.render = compile_task_templates(self.spec.tasks)
        self.skip = set(skip_doc_ids or ())
        if hasattr(skip_doc_ids, "__ray_ref__"):  # pragma: no cover
            self.skip = set()

    def _encode(self, prompt: str) -> list[int]:
        return self.tok.encode_prompt(prompt, self.chat)

    def __call__(self, batch):
        import pyarrow as pa

        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else batch
        out: list[dict] = []
        for doc in rows:
            if doc["doc_id"] in self.skip:
                continue
            out.extend(self.process(doc))
        return pa.Table.from_pylist(out, schema=request_schema())

    def process(self, doc: dict) -> list[dict]:
        spec = self.spec
        base = {"doc_id": doc["doc_id"], "source": doc["source"], "title": doc.get("title"),
                "pages": doc.get("pages"), "text": doc.get("text") if spec.output.include_text else None}
        if doc.get("error"):
            return [self._error(base, "parse", doc.get("error_type") or "ParseError", doc["error"])]
        if not (doc.get("text") or "").strip():
            return [self._error(base, "parse", "EmptyDocument", "document has no text")]
        tasks = spec.tasks
        limit = spec.model.max_model_len
        try:
            ctx = {"text": doc["text"], "title": doc.get("title") or "", "doc_id": doc["doc_id"],
                   "source": doc["source"], "pages": doc.get("pages") or 0}
            prompts = self.render(ctx)
            ids = [self._encode(p) for p in prompts]
            too_long = [(t, len(i)) for t, i in zip(tasks, ids) if len(i) > limit - t.max_tokens]
            truncated = False
            if too_long:
                t, n = too_long[0]
                if spec.long_inputs == "skip":
                    return [self._error(base, "prompt", "LongInput",
                                        f"task {t.name!r}: prompt of {n} tokens + max_tokens {t.max_tokens} exceeds "
                                        f"max_model_len {limit}")]
                ids = self._truncate(ctx, tasks, limit)
                truncated = True
        except Exception as e:
            return [self._error(base, "prompt", type(e).__name__, str(e)[:500])]
        out = []
        for k, (t, p) in enumerate(zip(tasks, ids)):
            out.append({**base, "task": t.name, "task_index": k, "prompt_ids": p, "max_tokens": t.max_tokens,
                        "truncated": truncated, "seed": derive_seed(spec.sampling.seed, doc["doc_id"], t.name),
                        "stage": None, "error_type": None, "error": None})
        return out

    def _truncate(self, ctx: dict, tasks, limit: int) -> list[list[int]]:
        """Keep the head of the document so every task fits; the same cut for all tasks
        keeps their shared prefix."""
        text_ids = self.tok.encode(ctx["text"], add_special_tokens=False)
        empty = self.render({**ctx, "text": ""})
        budget = min(limit - t.max_tokens - len(self._encode(e)) for t, e in zip(tasks, empty)) - 8
        if budget <= 0:
            raise ValueError(f"the task prompts alone need more than max_model_len {limit} tokens")
        n = min(len(text_ids), budget)
        while True:
            cut = self.tok.decode(text_ids[:n])
            ids = [self._encode(p) for p in self.render({**ctx, "text": cut})]
            if all(len(i) <= limit - t.max_tokens for t, i in zip(tasks, ids)) or n <= 0:
                return ids
            n -= max(8, n // 50)

    @staticmethod
    def _error(base: dict, stage: str, etype: str, msg: str) -> dict:
        return {**base, "task": None, "task_index": -1, "prompt_ids": [], "max_tokens": 0, "truncated": False,
                "seed": 0, "stage": stage, "error_type": etype, "error": msg}


def request_schema():
    import pyarrow as pa

    return pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("title", pa.string()),
                      ("pages", pa.int64()), ("task", pa.string()), ("task_index", pa.int64()),
                      ("prompt_ids", pa.list_(pa.int64())), ("max_tokens", pa.int64()), ("truncated", pa.bool_()),
                      ("seed", pa.int64()), ("text", pa.string()), ("stage", pa.string()),
                      ("error_type", pa.string()), ("error", pa.string())])
