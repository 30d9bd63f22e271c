"""`dlbatch status`: how far a job is, read from its output (no Ray, no model).

Done, failed and pending documents come from the committed parts' index files and the
input listing; only table inputs (JSONL, Parquet, HF), whose files hold many documents, are
read to count them.
"""
from __future__ import annotations


def job_status(spec) -> dict:
    """The job's counts: documents total/done/failed/pending, rows, tokens, complete."""
    from connectors import list_inputs
    from dlbatch.driver.output_store import OutputStore

    store = OutputStore(spec.output.path, dict(spec.output.storage_options))
    tasks = {t.name for t in spec.tasks}
    prog = store.progress(tasks=tasks)  # from the parts' index files
    done = {d for d, ts in prog["tasks_by_doc"].items() if ts >= tasks}
    files = list_inputs(spec.input.path, spec.input.format, dict(spec.input.storage_options))
    if spec.input.limit is not None and spec.input.format in ("pdf", "text"):
        files = files[:spec.input.limit]
    if spec.input.format in ("pdf", "text"):
        total = len(files)
    else:  # count documents without Ray
        from connectors import read_document_file

        total = 0
        for f in files:
            for _ in read_document_file(f, spec.input.format, text_field=spec.input.text_field,
                                        id_field=spec.input.id_field,
                                        storage_options=dict(spec.input.storage_options)):
                total += 1
        if spec.input.limit is not None:
            total = min(total, spec.input.limit)
    manifest = store.read_json("_manifest.json") or {}
    return {"job": spec.name, "output": spec.output.path, "docs_total": total, "docs_done": len(done),
            "docs_failed": len(prog["docs_failed"]), "docs_pending": max(0, total - len(done) - len(prog["docs_failed"])),
            "rows": prog["rows"], "duplicate_rows": prog["duplicates"], "prompt_tokens": prog["prompt_tokens"],
            "output_tokens": prog["output_tokens"], "complete": bool(manifest.get("complete"))}
