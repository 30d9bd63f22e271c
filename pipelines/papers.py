"""The `papers` pipeline: documents (PDF, JSONL, Parquet, text, HF) -> K task prompts per
document (the document first, so the tasks share it as prefix) -> tokenized requests.

read (list files) -> parse (flat_map, CPU) -> prompts + tokenize (map_batches, CPU);
generation and writing are driven by `dlbatch.driver.runner` on the worker pools of the plan.

Start-up. Parse and prompts run fused in the prompt actors: the prompt stage takes whole
blocks (``batch_size=None``), which lets Ray Data fuse the row-count-changing flat_map into
it (a fixed batch size forbids that fusion). So the data plane costs one Python process
per prompt actor instead of one per parse task (on a small machine, parse processes starting
beside the model load compete with it for the cores), and a block (one input file when there are few)
flows to the driver as soon as it is parsed and tokenized, not once eight are. The actor
pool autoscales from one actor up to one per ``CPUS_PER_PROMPT_ACTOR`` logical CPUs of the
cluster (``parse_concurrency`` at least), so large clusters still parse in parallel.

Credentials. No storage option is among a Ray task's or actor's arguments: the parse stage
gets the input's options sealed (an ObjectRef, `connectors.secrets.seal`) and resolves their
``${env:NAME}`` values on its node; the prompt actors read no files and get the job without
its storage options.
"""
from __future__ import annotations

CPUS_PER_PROMPT_ACTOR = 8  # a local run declares 8 logical CPUs on 2 cores (dlbatch.workers.session): one actor
MAX_BLOCKS = 64


def prompt_actors(cluster_cpus: float, parse_concurrency: int = 1) -> tuple[int, int]:
    """(min, max) prompt actors for a cluster with this many logical CPUs."""
    top = max(1, int(parse_concurrency), int(cluster_cpus // CPUS_PER_PROMPT_ACTOR))
    return 1, top


def build(spec, files: list[str], skip_doc_ids, *, max_model_len: int, parse_concurrency: int = 1):
    """The job's Ray Data pipeline over ``files``, skipping ``skip_doc_ids``; prompts fit in
    ``max_model_len``, the run's context length (`dlbatch.driver.config.RunConfig`)."""
    import ray

    from connectors.listing import limited_reads
    from connectors.parse import parse_file
    from dlbatch.prompts.multimodal import parse_request
    from connectors.secrets import seal, without_storage_options
    from dlbatch.prompts.skip import SkipSet
    from dlbatch.prompts.stage import PromptStage

    inp = spec.input
    # input.limit: the first N rows of the sorted files, as per-file row caps (not ds.limit)
    reads = limited_reads(files, inp.format, inp.limit, dict(inp.storage_options), text_field=inp.text_field,
                          id_field=inp.id_field, max_pages=inp.max_pages)
    ds = ray.data.from_items([{"url": f, "max_rows": n} for f, n in reads],
                             override_num_blocks=max(1, min(len(reads), MAX_BLOCKS)))
    ds = ds.flat_map(parse_file, fn_kwargs=dict(fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                                storage_options=seal(inp.storage_options), max_pages=inp.max_pages,
                                                max_file_bytes=inp.max_file_bytes, parse_timeout_s=inp.parse_timeout_s,
                                                parse_memory_mb=inp.parse_memory_mb,
                                                images=parse_request(spec)),  # a PDF's page images, figures
                     num_cpus=0.25)
    lo, hi = prompt_actors(ray.cluster_resources().get("CPU", 1.0), parse_concurrency)
    ds = ds.map_batches(PromptStage, fn_constructor_kwargs=dict(spec=without_storage_options(spec),
                                                                skip_doc_ids=(skip_doc_ids if isinstance(skip_doc_ids, SkipSet)
                                                                              else SkipSet(skip_doc_ids)),
                                                                map_reduce=True, max_model_len=max_model_len),
                        batch_size=None, batch_format="pyarrow", concurrency=(lo, hi), num_cpus=0.25)
    return ds
