"""The `papers` pipeline: documents (PDF, JSONL, Parquet, text, HF) -> K task prompts per
document (the document first, so the tasks share it as prefix) -> tokenized requests.

read tasks (list files, cut them) -> parse (flat_map, CPU) -> prompts + tokenize (map_batches,
CPU), or the rows of a `ray.data.Dataset` given to `dlbatch.run` -> prompts + tokenize;
generation and writing are driven by `dlbatch.driver.runner` on the worker pools of the plan.

Read tasks. The sorted inputs, with ``input.limit``'s row caps (`connectors.listing.limited_reads`),
are cut into read tasks of bounded size (`connectors.read_tasks`: byte ranges at line starts
for JSONL, runs of row groups for Parquet, row ranges for datasets; the first input's first
parts small), and grouped into blocks, one Arrow table each (``from_arrow``: a part of a large
file is a block alone, small files share one). So one huge file streams: its first part
reaches the driver while the rest is read, several actors parse its parts in parallel, and
an actor holds one block's documents, not the file's.

Start-up. Parse and prompts run fused in the prompt actors: the prompt stage takes whole
blocks (``batch_size=None``), which lets Ray Data fuse the row-count-changing flat_map into
it (a fixed batch size forbids that fusion). So the data plane costs one Python process
per prompt actor instead of one per parse task (on a small machine, parse processes starting
beside the model load compete with it for the cores), and a block flows to the driver as
soon as it is parsed and tokenized.

Prompt actors. The pool autoscales from one actor up to one per core the engine workers
leave (`prompt_actors`, `data_plane_cores`): on the embedded local Ray (which declares more
logical CPUs than the machine has cores) the machine's cores less the workers' torch threads;
on a cluster its CPUs less what the workers reserve. At least one and ``parse_concurrency``,
at most one per block. On a 2-core machine with one CPU worker (two threads) that is one
actor: the engine keeps its threads.

Credentials. No storage option is among a Ray task's or actor's arguments: the parse stage
gets the input's options sealed (an ObjectRef, `connectors.secrets.seal`) and resolves their
``${env:NAME}`` values on its node; the prompt actors read no files and get the job without
its storage options. The read tasks are cut in the driver, which holds the options.
"""
from __future__ import annotations

import os


def prompt_actors(cores: float, engine_cores: float, parse_concurrency: int = 1,
                  blocks: int | None = None) -> tuple[int, int]:
    """(min, max) prompt actors: one per whole core the engine leaves of ``cores``, at least
    one and ``parse_concurrency``, at most ``blocks`` (the data plane's blocks)."""
    top = max(1, int(parse_concurrency), int(cores - engine_cores))
    if blocks is not None:
        top = min(top, max(1, int(blocks)))
    return 1, top


def data_plane_cores(spec) -> tuple[float, float]:
    """(cores of the cluster, cores its engine workers keep busy) for the job's pools. The
    embedded local Ray (no ``cluster.address``, not a submitted job): this machine's cores and
    the workers' torch threads (a CPU worker: its CPUs, at least 1, at least 2 as a run's only
    pool; an accelerator worker: 1), as `dlbatch.driver.config.worker_threads` gives them. A
    cluster: its CPUs and the CPUs the workers reserve."""
    pools = list(spec.cluster.pools().values())
    if spec.cluster.address is None and "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

        def threads(p) -> int:
            if p.device != "cpu":
                return 1
            own = max(1, int(round(p.num_cpus)))
            return max(own, min(2, cores)) if len(pools) == 1 else own

        return float(cores), float(sum(p.replicas * threads(p) for p in pools))
    import ray

    return ray.cluster_resources().get("CPU", 1.0), float(sum(p.replicas * p.num_cpus for p in pools))


def build(spec, files: list[str], skip_doc_ids, *, max_model_len: int, parse_concurrency: int = 1,
          dataset=None, preprocess=None, engine_cores: float | None = None):
    """The job's Ray Data pipeline over ``files`` (or the rows of ``dataset``, a
    `ray.data.Dataset` given to `dlbatch.run`), skipping ``skip_doc_ids``; prompts fit in
    ``max_model_len``, the run's context length (`dlbatch.driver.config.RunConfig`);
    ``preprocess``: the pipeline's hook on each document (pipelines/__init__.py).
    ``engine_cores``: the cores the run's workers keep busy, when the caller knows them (a
    plan's pools); else from the job's cluster section (`data_plane_cores`)."""
    import ray

    from connectors.secrets import seal, without_storage_options
    from dlbatch.prompts.skip import SkipSet
    from dlbatch.prompts.stage import PromptStage

    ds, n_blocks = _documents(spec, files) if dataset is None else (_dataset_documents(spec, dataset), None)
    cores, engine = data_plane_cores(spec)
    lo, hi = prompt_actors(cores, engine if engine_cores is None else engine_cores, parse_concurrency,
                           blocks=n_blocks)
    ds = ds.map_batches(PromptStage, fn_constructor_kwargs=dict(spec=without_storage_options(spec),
                                                                skip_doc_ids=(skip_doc_ids if isinstance(skip_doc_ids, SkipSet)
                                                                              else SkipSet(skip_doc_ids)),
                                                                map_reduce=True, max_model_len=max_model_len,
                                                                preprocess=preprocess,
                                                                image_read=dict(base=os.getcwd(),  # batch lines' URLs
                                                                                storage_options=seal(
                                                                                    spec.input.storage_options))),
                        batch_size=None, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(min_size=lo, max_size=hi), num_cpus=0.25)
    return ds


def _documents(spec, files: list[str]):
    """read tasks (the sorted files, cut by input.limit and into parts) -> parse: (document
    rows, the number of blocks: one per part, small files packed)."""
    import ray

    from connectors.listing import limited_reads
    from connectors.parse import parse_file
    from connectors.read_tasks import blocks, plan_read_tasks, task_table
    from connectors.secrets import seal
    from dlbatch.prompts.multimodal import parse_request

    inp = spec.input
    # input.limit: the first N rows of the sorted files, as per-file row caps (not ds.limit)
    reads = limited_reads(files, inp.format, inp.limit, dict(inp.storage_options), text_field=inp.text_field,
                          id_field=inp.id_field, max_pages=inp.max_pages, max_line_bytes=inp.max_line_bytes)
    groups = blocks(plan_read_tasks(reads, inp.format, dict(inp.storage_options), text_field=inp.text_field,
                                    id_field=inp.id_field))
    ds = ray.data.from_arrow([task_table(g) for g in groups] or [task_table([])])  # one block per group
    return ds.flat_map(parse_file, fn_kwargs=dict(fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                                  storage_options=seal(inp.storage_options), max_pages=inp.max_pages,
                                                  max_file_bytes=inp.max_file_bytes,
                                                  parse_timeout_s=inp.parse_timeout_s,
                                                  parse_memory_mb=inp.parse_memory_mb,
                                                  max_line_bytes=inp.max_line_bytes,
                                                  max_text_chars=inp.max_text_chars,
                                                  images=parse_request(spec)),  # a PDF's pages and figures, a row's image columns
                       num_cpus=0.25), max(1, len(groups))


def _dataset_documents(spec, dataset):
    """The user's dataset's rows as document rows (connectors/ray_dataset.py); input.limit
    takes its first N rows."""
    import ray

    from connectors.ray_dataset import DatasetDocuments
    from connectors.secrets import seal
    from dlbatch.prompts.multimodal import parse_request

    inp = spec.input
    if inp.limit is not None:
        dataset = dataset.limit(inp.limit)
    return dataset.map_batches(DatasetDocuments, fn_constructor_kwargs=dict(
                                   text_field=inp.text_field, id_field=inp.id_field, images=parse_request(spec),
                                   storage_options=seal(inp.storage_options), max_image_bytes=inp.max_file_bytes),
                               batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0.25)
