"""`dlbatch status`: how far a job is, read from its output (no Ray, no model).

Done, failed and pending documents come from the committed parts' index files and the
input listing; table inputs (JSONL, Parquet, HF), whose files hold many documents, are
counted without parsing them (the input-format table's counter: JSONL lines, Parquet
footers). ``complete`` means this job, as asked now, has nothing pending: a run that
completed under another ``input.limit`` (the manifest records it) left documents this job
still has to process, and status says so rather than calling the job complete.

Orphans (parts a process committed after it lost the lease, dlbatch/output/fence.py) are
never counted; status names those moved aside to ``_orphans/`` and those still in place,
which plain readers of the folder see until the next holder's commit moves them.
"""
from __future__ import annotations


def job_status(spec) -> dict:
    """The job's counts: documents total/done/failed/pending, rows, tokens, complete."""
    from connectors import list_inputs
    from connectors.formats import input_format
    from dlbatch.output import open_store
    from dlbatch.output.fence import orphan_report
    from dlbatch.output.files import MANIFEST

    store = open_store(spec.output)  # the format that wrote the output (its manifest), else the job's
    tasks = {t.name for t in spec.tasks}
    prog = store.progress(tasks=tasks)  # from the parts' index files
    files = list_inputs(spec.input.path, spec.input.format, dict(spec.input.storage_options))
    one_per_file = input_format(spec.input.format).one_doc_per_file
    if spec.input.limit is not None and one_per_file:
        files = files[:spec.input.limit]
    if one_per_file:
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
    pending = max(0, total - prog["n_done"] - prog["n_failed"])
    ran = bool(manifest.get("complete"))  # the last run finished what it was asked
    return {"job": spec.name, "output": spec.output.path, "docs_total": total, "docs_done": prog["n_done"],
            "docs_failed": prog["n_failed"], "docs_pending": pending,
            "rows": prog["rows"], "duplicate_rows": prog["duplicates"], "prompt_tokens": prog["prompt_tokens"],
            "output_tokens": prog["output_tokens"], "complete": ran and pending == 0,
            "last_run_complete": ran, "last_run_limit": manifest.get("limit"),
            **{f"orphan_parts_{k}": v for k, v in orphan_report(store.files).items()}}
