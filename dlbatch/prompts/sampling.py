"""The sampling each request runs with.

A job's ``sampling`` applies to every task; a task's own ``sampling`` replaces the fields it
sets (temperature, top_p, top_k, seed, stop) for that task only. Each (document, task) then
draws with its own seed, `dlbatch.prompts.stage.derive_seed(task seed, doc_id, task)`, so
reruns and retries sample the same tokens whatever the batching.

``n`` samples of a prompt are n request rows: the task's row and ``<task>~1`` .. ``<task>~{n-1}``
(a `dlbatch.records.RequestKey` with ``sample`` i), sample i seeded with the row's seed + i
(so sample 0 is what n = 1 draws), each row a request like any other (prefill/decode pools
included; they share the prompt as prefix, so the router sends them together and the prefix
cache computes it once). The document's result row is sample 0's, with every sample in its
``samples`` column (`dlbatch.driver.document.Document`); with ``output.samples: rows`` the
row is then written once per sample (`sample_rows`), numbered by ``sample_index``.
"""
from __future__ import annotations

from dlbatch.records import RequestKey, base_task


def task_sampling(spec, task: str):
    """The job's ``sampling`` with the task's own fields over it. ``task`` may be a
    map-reduce request's ``<task>#<key>``: its notes sample like the task."""
    base = spec.sampling
    t = next((t for t in spec.tasks if t.name == base_task(task)), None)
    own = getattr(t, "sampling", None)
    if own is None:
        return base
    return base.model_copy(update={k: v for k, v in own.model_dump().items() if v is not None})


def expand_samples(spec, rows: list[dict]) -> list[dict]:
    """Request rows with each n > 1 task row followed by its samples 1..n-1 (see above)."""
    out = []
    for r in rows:
        out.append(r)
        if r.get("error") or not r.get("task"):
            continue
        key = RequestKey.of(r)
        if key.part is not None:  # a chunked task's map/reduce note: one sample
            continue
        n = row_sampling(r).get("n") or getattr(task_sampling(spec, r["task"]), "n", None) or 1
        out.extend({**r, "task": key.with_sample(i).name, "seed": int(r["seed"]) + i} for i in range(1, int(n)))
    return out


EXTRA_KEYS = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs")
NOTE_OFF = ("n", "logprobs")  # a chunked task's map/reduce notes: one sample, no logprobs


def row_sampling(row: dict) -> dict:
    """A request row's own sampling (its ``sampling`` column, JSON: an OpenAI batch line's
    body), over the task's; {} when it has none."""
    import json

    own = row.get("sampling")
    return json.loads(own) if isinstance(own, str) and own else {}


def request_sampling(spec, row: dict) -> dict:
    """The item keys a worker samples one request row with (dlbatch/backends/base.py): the
    job's sampling, the task's own over it, the row's own over that; the seed is the row's
    (derived per document and task) and only when sampling is random."""
    smp = task_sampling(spec, row["task"])
    note = RequestKey.of(row).part is not None  # a chunked task's map/reduce request
    item = {"temperature": smp.temperature, "top_p": smp.top_p, "top_k": smp.top_k,
            **({"stop": list(smp.stop)} if smp.stop else {})}
    for k in EXTRA_KEYS:
        v = getattr(smp, k, None)
        if v is not None and not (note and k in NOTE_OFF):
            item[k] = v
    item.update(row_sampling(row))
    item.pop("n", None)  # n samples are n rows (expand_samples)
    item["seed"] = int(row["seed"]) if item["temperature"] > 0 else None
    return item


def uses(spec, key: str) -> bool:
    """Whether any task's sampling (or, for OpenAI batch input, any row's) may set ``key``."""
    if spec.input.format == "openai_batch":
        return True
    return any(getattr(task_sampling(spec, t.name), key, None) is not None for t in spec.tasks)


def _token_type():
    import pyarrow as pa

    return pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())])


def logprobs_type():
    """Per output token: its text, id and log-probability, and the top-k alternatives."""
    import pyarrow as pa

    return pa.list_(pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64()),
                               ("top", pa.list_(_token_type()))]))


def samples_type():
    import pyarrow as pa

    return pa.list_(pa.struct([("output", pa.string()), ("output_tokens", pa.int64()),
                               ("finish_reason", pa.string()), ("logprobs", logprobs_type())]))


def result_fields(spec) -> list:
    """Extra result columns: ``samples`` (every one of n samples, the first being the row's
    ``output``) when a task draws n > 1, ``logprobs`` (of ``output``) when a task asks them."""
    import pyarrow as pa

    fields = []
    if spec.output.samples == "rows":
        fields.append(pa.field("sample_index", pa.int64()))
    elif spec.input.format == "openai_batch" or any((task_sampling(spec, t.name).n or 1) > 1 for t in spec.tasks):
        fields.append(pa.field("samples", samples_type()))
    if uses(spec, "logprobs"):
        fields.append(pa.field("logprobs", logprobs_type()))
    return fields


def row_fields(result: dict) -> dict:
    """The extra columns of one result row (see `result_fields`); null where not asked."""
    def lp(entries):
        if entries is None:
            return None
        return [{"token": e["token"], "token_id": int(e["token_id"]), "logprob": float(e["logprob"]),
                 "top": [{"token": t["token"], "token_id": int(t["token_id"]), "logprob": float(t["logprob"])}
                         for t in e.get("top") or ()]} for e in entries]

    samples = result.get("samples")
    return {"logprobs": lp(result.get("logprobs")),
            "samples": None if samples is None else [
                {"output": s.get("output", ""), "output_tokens": int(s.get("output_tokens") or 0),
                 "finish_reason": s.get("finish_reason"), "logprobs": lp(s.get("logprobs"))} for s in samples]}


def sample_rows(rows: list[dict], typed) -> list[dict]:
    """``output.samples: rows``: each result row once per sample, sample i's ``output``,
    ``output_tokens``, ``finish_reason``, ``logprobs`` and typed columns (``typed(task,
    sample)``: the structured-output fields) with ``sample_index`` i; a task drawing one
    sample is its row with ``sample_index`` 0. The rows of one document stay one commit."""
    out = []
    for r in rows:
        samples = r.pop("samples", None)
        if not samples:
            out.append({**r, "sample_index": 0})
            continue
        for i, s in enumerate(samples):
            out.append({**r, "output": s["output"], "output_tokens": s["output_tokens"],
                        "finish_reason": s["finish_reason"], "logprobs": s["logprobs"], "sample_index": i,
                        **typed(r["task"], s)})
    return out
