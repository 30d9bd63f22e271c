"""The `papers` pipeline: documents (PDF, JSONL, Parquet, text, HF) -> K task prompts per
document (the document first, so the tasks share it as prefix) -> tokenized requests.

read (list files) -> parse (flat_map, CPU) -> prompts + tokenize (map_batches, CPU);
generation and writing are driven by `dlbatch.runner` on the worker pools of the plan.
"""
from __future__ import annotations


def build(spec, files: list[str], skip_doc_ids: set[str], parse_concurrency: int = 1):
    import ray

    from dlbatch.stages import PromptStage, parse_file

    inp = spec.input
    ds = ray.data.from_items([{"url": f} for f in files], override_num_blocks=max(1, min(len(files), 64)))
    ds = ds.flat_map(parse_file, fn_kwargs=dict(fmt=inp.format, text_field=inp.text_field, id_field=inp.id_field,
                                                storage_options=dict(inp.storage_options), max_pages=inp.max_pages),
                     num_cpus=0.25)
    if inp.limit is not None and inp.format not in ("pdf", "text"):
        ds = ds.limit(inp.limit)
    ds = ds.map_batches(PromptStage, fn_constructor_kwargs=dict(spec_dict=spec.to_dict(),
                                                                skip_doc_ids=sorted(skip_doc_ids),
                                                                map_reduce=True),
                        batch_size=8, batch_format="pyarrow", concurrency=parse_concurrency, num_cpus=0.25)
    return ds
