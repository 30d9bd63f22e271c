"""A job file -> the solver's :class:`Workload` and :class:`ModelSpec`.

This is the CLI side of the solver: it reads documents and loads the model's tokenizer
and config (the solver core itself never imports the engine). A sample of the job's
documents (the first ``sample`` documents of the listed inputs) is rendered into task
prompts and tokenized exactly as the pipeline does it (``dlbatch.prompts.stage.PromptStage``:
same templates, chat template and long-input truncation to the run's ``max_model_len``), so
the token counts are those the workers will see:

* document prefix ``D`` = the token prefix common to a document's K task prompts
  (what the prefix cache shares), suffix ``S`` = the rest of each task's prompt;
* output ``O`` = each task's ``max_tokens``, or, when a previous complete run of the
  job left a ``_report.json`` in the output path, the output token counts observed
  there (EOS usually stops generation well before ``max_tokens``).

The number of documents of the job is the number of listed inputs for one-document
formats (pdf, text; capped by ``input.limit``), else extrapolated from the sample.

The sample is parsed as the job parses it (`connectors.parse.parse_file`): a PDF in the
parser process under the job's caps (``input.max_pages``, ``max_file_bytes``,
``parse_timeout_s``, ``parse_memory_mb``). A file that crashes MuPDF, hangs, runs out of memory
or is over a cap is left out of the measurement (counted in ``failed_docs`` and named in a
warning), never the end of ``dlbatch plan`` or of the auto solver.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from dlbatch.solver.profile import ModelSpec
from dlbatch.solver.workload import Workload

COUNT_FILES = 1000  # inputs of record files up to this many: rows counted; more: extrapolated from the sample

log = logging.getLogger("dlbatch.solver")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def model_spec_for(model: str, dtype: str = "bfloat16", device: str = "cpu",
                   storage_options: dict | None = None, compute_dtype: str | None = None) -> ModelSpec:
    """ModelSpec of ``model`` (alias, HF directory or GGUF) as the engine will run it:
    weights and KV in the dtype the engine actually computes in on ``device`` (on a CPU
    without native bf16 that is float32, see ``dlbatch.engine.device``)."""
    from dlbatch.engine.config import ModelConfig
    from dlbatch.engine.loader import model_dir

    fs, root = model_dir(model, storage_options)
    path = root.rstrip("/") + "/config.json"
    with fs.open(path, "r") as f:
        cfg = ModelConfig.from_hf(json.load(f), source=path)
    if compute_dtype is None:
        from dlbatch.engine.device import compute_dtype as _cd

        compute_dtype = _cd(dtype, device.split(":")[0])
    nbytes = _DTYPE_BYTES.get(compute_dtype)
    if nbytes is None:
        raise ValueError(f"unknown dtype {compute_dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    n = int(cfg.num_params())
    return ModelSpec(name=model, n_params=n, weight_bytes=n * nbytes, n_layers=cfg.num_layers,
                     kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, kv_dtype_bytes=nbytes,
                     n_heads=cfg.num_heads)


@dataclass
class JobSample:
    """What was read from the job to build the workload (printed by ``dlbatch plan``)."""

    workload: Workload
    model: ModelSpec
    docs_sampled: int
    docs_total: int
    docs_total_estimated: bool
    truncated_docs: int
    failed_docs: list[str] = field(default_factory=list)
    output_source: str = "max_tokens"

    def describe(self) -> str:
        wl = self.workload
        est = " (estimated from the sample)" if self.docs_total_estimated else ""
        lines = [f"workload: {self.docs_total:,} documents{est}, {wl.tasks_per_doc} tasks each; "
                 f"sampled {self.docs_sampled} ({self.truncated_docs} truncated to max_model_len"
                 + (f", {len(self.failed_docs)} unreadable" if self.failed_docs else "") + ")",
                 f"  document prefix tokens mean {wl.mean_doc:,.0f} (min {min(wl.doc_tokens):,}, "
                 f"max {max(wl.doc_tokens):,}); task suffix mean {wl.mean_suffix:,.1f}; output mean "
                 f"{wl.mean_output:,.1f} ({self.output_source}); prefix shared: {wl.prefix_shared}",
                 f"  model {self.model.name}: {self.model.n_params:,} params, weights "
                 f"{self.model.weight_bytes / 1e9:,.3f} GB, KV {self.model.kv_bytes_per_token:,} B/token"]
        return "\n".join(lines)


def _common_prefix(seqs: list[list[int]]) -> int:
    first = min(seqs, key=len)
    n = len(first)
    for other in seqs:
        i = 0
        while i < n and other[i] == first[i]:
            i += 1
        n = i
    return n


def observed_outputs(spec) -> list[int] | None:
    """Output token counts of a previous complete run of this job (its ``_report.json``),
    or None when there is none (or it is unreadable)."""
    try:
        from dlbatch.output.files import OutputFiles

        report = OutputFiles(spec.output.path, dict(spec.output.storage_options)).read_json("_report.json")
    except Exception as e:  # a missing/odd previous output must not stop planning
        log.debug("no previous report for %s: %s", spec.output.path, e)
        return None
    if not isinstance(report, dict):
        return None
    hist = [int(x) for x in report.get("output_token_hist") or [] if isinstance(x, (int, float)) and x >= 1]
    return hist or None


def job_workload(spec, sample: int = 32, n_docs: int | None = None, use_report: bool = True,
                 device: str | None = None, *, max_model_len: int) -> JobSample:
    """Read the first ``sample`` documents of ``spec`` (a validated JobSpec) and build the
    Workload for ``n_docs`` documents (default: the job's document count); the prompts are
    cut to ``max_model_len``, the run's context length (`dlbatch.driver.config.RunConfig`)."""
    from connectors import input_format, list_inputs
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request
    from dlbatch.prompts.stage import PromptStage

    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        raise ValueError(f"sample must be an integer >= 1, got {sample!r}")
    if n_docs is not None and (isinstance(n_docs, bool) or not isinstance(n_docs, int) or n_docs < 1):
        raise ValueError(f"docs must be an integer >= 1, got {n_docs!r}")
    inp = spec.input
    files = list_inputs(inp.path, inp.format, dict(inp.storage_options))
    one_per_file = input_format(inp.format).one_doc_per_file
    if inp.limit is not None and one_per_file:
        files = files[:inp.limit]
    stage = PromptStage(spec, max_model_len=max_model_len)
    K = len(spec.tasks)
    doc_tokens: list[int] = []
    suffix_tokens: list[int] = []
    truncated = 0
    requests = 0  # request rows of a document: its tasks' samples included
    failed: list[str] = []
    docs_read = files_read = 0
    shared = True
    for url in files:
        if docs_read >= sample:
            break
        files_read += 1
        docs = parse_file({"url": url, "max_rows": sample - docs_read}, inp.format, inp.text_field, inp.id_field,
                          dict(inp.storage_options), inp.max_pages, max_file_bytes=inp.max_file_bytes,
                          parse_timeout_s=inp.parse_timeout_s, parse_memory_mb=inp.parse_memory_mb,
                          images=parse_request(spec))
        for doc in docs:
            if docs_read >= sample:
                break
            docs_read += 1
            if doc.get("error"):  # not parsed (a crash, a timeout, a cap, bad content): left out
                why = doc["error"] if doc["error"].startswith(f"{doc['error_type']}:") else \
                    f"{doc['error_type']}: {doc['error']}"
                failed.append(f"{doc.get('source', url)}: {why}")
                continue
            rows = stage.process(doc)  # K rows, and a task's samples 1..n-1 after its row (n > 1)
            if len(rows) < K or any(r.get("error") for r in rows):
                bad = next((r.get("error") for r in rows if r.get("error")), None) or "no rows"
                failed.append(f"{doc.get('source', url)}: {bad}")
                continue
            requests = max(requests, len(rows))
            ids = [list(r["prompt_ids"]) for r in rows]
            d = _common_prefix(ids) if K > 1 else len(ids[0])
            if d == 0:
                shared = False
            doc_tokens.append(max(1, d))
            suffix_tokens.extend(len(i) - d for i in ids)
            truncated += bool(rows[0]["truncated"])
    if failed:
        log.warning("workload: %d of the %d sampled documents are left out (not parsed or no prompts): %s",
                    len(failed), docs_read, "; ".join(failed[:10]) + (" ..." if len(failed) > 10 else ""))
    if not doc_tokens:
        raise ValueError(f"no usable document in the first {docs_read} of {inp.path!r}"
                         + (f": {failed[:3]}" if failed else ""))
    if not shared:  # some tasks do not share the document: model every task as a full prefill
        doc_tokens = [1] * len(doc_tokens)
    estimated = False
    if n_docs is None:
        n_docs, estimated = _count_documents(inp, files, docs_read, files_read)
    outputs, source = _outputs(spec, use_report)
    wl = Workload.from_samples(doc_tokens, suffix_tokens, outputs, n_docs=n_docs, tasks_per_doc=max(K, requests),
                               prefix_shared=shared)
    model = model_spec_for(spec.model.name, spec.model.dtype, device or _job_device(spec))
    return JobSample(workload=wl, model=model, docs_sampled=len(doc_tokens), docs_total=n_docs,
                     docs_total_estimated=estimated, truncated_docs=truncated, failed_docs=failed,
                     output_source=source)


def _count_documents(inp, files: list[str], docs_read: int, files_read: int) -> tuple[int, bool]:
    """(documents of the job, whether that is an estimate): the listed files of a
    one-document format, a Hub dataset's stated size, the rows of up to COUNT_FILES record
    files counted (not parsed), else extrapolated from the ``docs_read`` documents of the
    first ``files_read`` files; at most ``input.limit``."""
    from connectors import input_format
    from connectors.hf_hub import is_hub_url
    from connectors.listing import count_rows

    estimated = False
    if input_format(inp.format).one_doc_per_file:
        total = len(files)
    elif len(files) == 1 and is_hub_url(files[0]):  # a Hub dataset: its split's stated size
        total = count_rows(files[0], inp.format, 1 << 62, dict(inp.storage_options))
    elif len(files) <= COUNT_FILES:  # record files: their rows counted, not parsed (JSONL lines, footers)
        stop = inp.limit if inp.limit is not None else 1 << 62
        total = 0
        for f in files:
            total += count_rows(f, inp.format, stop - total, dict(inp.storage_options))
            if total >= stop:
                break
    else:
        total = max(docs_read, int(round(docs_read / files_read * len(files))))
        estimated = True
    if inp.limit is not None:
        total = min(total, inp.limit)
    return total, estimated


def _outputs(spec, use_report: bool) -> tuple[list[int], str]:
    """Output tokens per request (a task's n samples are n requests) and where they come
    from: a previous complete run's observed counts when there is one, else ``max_tokens``."""
    from dlbatch.prompts.sampling import task_sampling

    if use_report:
        obs = observed_outputs(spec)
        if obs:
            return obs, f"observed in a previous run's _report.json, {len(obs)} rows"
    n = {t.name: task_sampling(spec, t.name).n or 1 for t in spec.tasks}  # each sample is one more request
    return [t.max_tokens for t in spec.tasks for _ in range(n[t.name])], "max_tokens of the tasks"


def _job_device(spec) -> str:
    c = spec.cluster
    for pool in (c.colocated, c.prefill, c.decode):
        if pool is not None:
            return pool.device
    return "cpu"
