"""What an output's committed rows say is done: the one reading both stores give `progress`.

Computed in Arrow from the committed rows' index columns and the dead letters: the driver
holds no Python object per row, so a resume of a million documents costs columns, not sets
of strings.
"""
from __future__ import annotations


def committed_progress(index, errors, tasks: set[str] | None = None) -> dict:
    """``index``: every committed result row's (doc_id, source, task, prompt_tokens,
    output_tokens); ``errors``: every counted dead letter (doc_id, source, task; a task of
    None: the whole document; parts written before the task column lack it). Returns:

    ``done_ids``   documents whose outcomes cover every task of ``tasks`` (a result row,
                   or a dead letter of that task alone); any result row when None
    ``failed_ids`` documents dead-lettered whole (no result row)
    ``n_done``, ``n_failed``, ``rows``, ``prompt_tokens``, ``output_tokens``,
    ``duplicates`` (result rows beyond one per (document, task))
    ``sources``    input files with committed rows (`connectors.versions.source_file`)
    ``sources_done`` one-document files (pdf, text) whose document is done or failed"""
    import pyarrow as pa
    import pyarrow.compute as pc

    from connectors.versions import source_files

    def strings(t, c):
        return (t.column(c).cast(pa.string()) if c in t.column_names else pa.nulls(t.num_rows, pa.string()))

    res = pa.table({c: strings(index, c) for c in ("doc_id", "source", "task")})
    errs = pa.table({c: strings(errors, c) for c in ("doc_id", "source", "task")})
    with_rows = pc.unique(res["doc_id"])
    alone = errs.filter(pc.and_(pc.is_valid(errs["task"]), pc.is_in(errs["doc_id"], value_set=with_rows)))
    if tasks is None:
        done = with_rows
    else:  # a task that failed alone has its outcome: the document is not redone for it
        outcomes = pa.concat_tables([res.select(["doc_id", "task"]), alone.select(["doc_id", "task"])])
        outcomes = outcomes.filter(pc.is_in(outcomes["task"], value_set=pa.array(sorted(tasks), pa.string())))
        per = outcomes.group_by("doc_id").aggregate([("task", "count_distinct")])
        done = per.filter(pc.equal(per["task_count_distinct"], len(set(tasks))))["doc_id"].combine_chunks()
    failed = pc.unique(errs.filter(pc.invert(pc.is_in(errs["doc_id"], value_set=with_rows)))["doc_id"])
    pairs = pa.concat_tables([res.select(["source", "doc_id"]), errs.select(["source", "doc_id"])])
    files = pc.unique(source_files(pairs["source"]).drop_null())
    whole = pairs.filter(pc.equal(pairs["source"], source_files(pairs["source"])))  # one-document files
    ok = pc.is_in(whole["doc_id"], value_set=pa.concat_arrays([done, failed.cast(pa.string())]))
    g = pa.table({"source": whole["source"], "ok": ok}).group_by("source").aggregate([("ok", "all")])
    n = res.num_rows
    return {
        "rows": n,
        "done_ids": done,
        "failed_ids": failed,
        "n_done": len(done),
        "n_failed": len(failed),
        "sources_done": set(g.filter(g["ok_all"])["source"].to_pylist()),
        "sources": set(files.to_pylist()),
        "prompt_tokens": int(pc.sum(index.column("prompt_tokens")).as_py() or 0) if n else 0,
        "output_tokens": int(pc.sum(index.column("output_tokens")).as_py() or 0) if n else 0,
        "duplicates": n - _distinct_results(res, index),
    }


def with_pending(errors, pending: list):
    """The dead letters readers see plus those of ``pending`` (committed, their copy not
    written yet) as one Table."""
    import pyarrow as pa

    if not pending:
        return errors
    return pa.concat_tables([errors, *pending], promote_options="default") if errors.num_rows else \
        pa.concat_tables(pending)


def _distinct_results(res, index) -> int:
    """Distinct (document, task) result rows, (document, task, sample) where rows are one per
    sample (``sample_index``, output.samples: rows)."""
    import pyarrow as pa

    keys = {"doc_id": res["doc_id"], "task": res["task"]}
    if "sample_index" in index.column_names:
        keys["sample_index"] = index["sample_index"]
    return pa.table(keys).group_by(list(keys)).aggregate([]).num_rows
