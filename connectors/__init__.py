"""Sources and sinks for dlbatch: PDF (pymupdf), JSONL / Parquet / text / Hugging Face datasets
through fsspec (local, s3, gcs, memory), and an atomic Parquet sink.

Every reader yields plain dict rows with the keys in ``connectors.records.ROW_KEYS``. The
input formats, with what a file of each holds, its reader and its row counter, are one table
(`connectors.formats`).
Heavy libraries (pymupdf, pyarrow, datasets, s3fs) are imported inside the functions.
"""

from .formats import FORMATS, INPUT_FORMATS, InputFormat, input_format
from .ids import content_id
from .io_retry import IOBackoff, call_with_retry, is_transient, retry_count, retry_io
from .listing import list_inputs, read_document_file
from .pdf import extract_pdf
from .records import ROW_KEYS
from .sink import list_committed, read_committed, write_parquet_atomic
from .text_sources import read_hf, read_jsonl, read_parquet, read_text

__all__ = [
    "FORMATS", "INPUT_FORMATS", "ROW_KEYS", "IOBackoff", "InputFormat", "call_with_retry", "content_id",
    "extract_pdf", "input_format", "is_transient", "list_committed", "list_inputs", "read_committed", "read_document_file",
    "read_hf", "read_jsonl", "read_parquet", "read_text", "retry_count", "retry_io",
    "write_parquet_atomic",
]
