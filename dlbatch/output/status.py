"""`dlbatch status`: how far a job is, read from its output (no Ray, no model).

Done, failed and pending documents come from the committed parts' index files and the
input listing; table inputs (JSONL, Parquet, HF), whose files hold many documents, are
counted without parsing them (`connectors.listing.count_rows`: JSONL lines, Parquet footers).
"""
from __future__ import annotations


def job_status(spec) -> dict:
    """The job's counts: documents total/done/failed/pending, rows, tokens, complete."""
    from connectors import list_inputs
    from dlbatch.output import open_store
    from dlbatch.output.files import MANIFEST

    store = open_store(spec.output)  # the format that wrote the output (its manifest), else the job's
    tasks = {t.name for t in spec.tasks}
    prog = store.progress(tasks=tasks)  # from the parts' index files
    files = list_inputs(spec.input.path, spec.input.format, dict(spec.input.storage_options))
    if spec.input.limit is not None and spec.input.format in ("pdf", "text"):
        files = files[:spec.input.limit]
    if spec.input.format in ("pdf", "text"):
        total = len(files)
    else:  # count documents without Ray and without parsing them: lines, Parquet footers
        from connectors.listing import count_rows

        stop = spec.input.limit if spec.input.limit is not None else 1 << 62
        total = 0
        for f in files:
            total += count_rows(f, spec.input.format, stop - total, dict(spec.input.storage_options),
                                text_field=spec.input.text_field, id_field=spec.input.id_field)
            if total >= stop:
                break
    manifest = store.files.read_json(MANIFEST) or {}
    return {"job": spec.name, "output": spec.output.path, "docs_total": total, "docs_done": prog["n_done"],
            "docs_failed": prog["n_failed"], "docs_pending": max(0, total - prog["n_done"] - prog["n_failed"]),
            "rows": prog["rows"], "duplicate_rows": prog["duplicates"], "prompt_tokens": prog["prompt_tokens"],
            "output_tokens": prog["output_tokens"], "complete": bool(manifest.get("complete"))}
