"""A `ray.data.Dataset` as a job's input (`dlbatch.run(job, dataset=ds)`): its rows as
documents, exactly as the rows of a JSONL or Parquet file become documents
(`connectors.records.record_to_row`): ``input.text_field`` is the text, ``input.id_field``
(recommended: a stable id column) the document's id — else the content id of the row's
text, as for files — and every other column travels with its Arrow type (templates read
it as ``{{ row.name }}``, ``output.keep_columns`` keeps it).

A row's ``source`` is ``dataset#<id>``: a dataset has no file, and the id is what names a
row across runs (exactly once and resume key on it, as for files). The same id twice in
one dataset is a ``DuplicateId`` dead letter of the later row (caught by the dispatcher,
which sees every row).
"""
from __future__ import annotations

SOURCE = "dataset"


class DatasetDocuments:
    """``map_batches`` over the user's dataset (Arrow batches) -> document rows (`parse.py`'s shape)."""

    def __init__(self, text_field: str, id_field: str | None, images: dict | None = None,
                 storage_options: dict | None = None, max_image_bytes: int | None = None):
        """``images``: the job's image columns (`dlbatch.prompts.multimodal.parse_request`),
        read here as the parse stage reads a file's (`connectors.parse.with_column_images`)."""
        self.text_field, self.id_field = text_field, id_field
        self.images, self.storage_options, self.max_image_bytes = images, storage_options, max_image_bytes

    def __call__(self, batch):
        import pyarrow as pa

        from .parse import document_row, with_column_images
        from .records import record_to_row

        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        out = []
        for i, record in enumerate(table.to_pylist()):
            row = record_to_row(record, SOURCE, self.text_field, self.id_field, arrow=table.slice(i, 1))
            row["source"] = f"{SOURCE}#{row['doc_id']}"
            row = with_column_images(row, self.images, self.storage_options, None, self.max_image_bytes,
                                     self.id_field is not None)
            out.append(document_row(row))
        return pa.Table.from_pylist(out, schema=document_schema())


def document_schema():
    """The document rows' schema (what `connectors.parse.parse_file` yields)."""
    import pyarrow as pa

    return pa.schema([("doc_id", pa.string()), ("source", pa.string()), ("text", pa.string()),
                      ("title", pa.string()), ("pages", pa.int64()), ("error", pa.string()),
                      ("error_type", pa.string()), ("structure", pa.string()), ("columns", pa.binary()),
                      ("images", pa.binary())])
