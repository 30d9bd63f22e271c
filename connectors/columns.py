"""An input row's own columns, carried from the reader to the prompt templates and the output.

A JSONL, Parquet or datasets row has columns besides its text (a question, a label, chat
``messages``, ...). Templates read them (``{{ row.question }}``) and ``output.keep_columns``
copies them into the result rows with their Arrow types. They travel through Ray Data as one
binary value per document (``columns``): the Arrow IPC stream of a one-row table. A block then
has one fixed schema however the rows' columns differ, and the types survive the trip: a
Parquet row keeps its file's types (int32, timestamps, decimals, nested), a JSON row the types
Arrow infers from its values. The text column is not repeated there: ``row[text_field]`` is
the document's text.

`columns_table` joins the one-row tables of many documents into one, promoting types the way
Arrow does (null to any type, int to float); a value Arrow cannot hold as its own type (a
JSON list of mixed types) travels as its JSON text.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Mapping


def pack(record: Any, exclude: Iterable[str] = ()) -> bytes | None:
    """One row -> the Arrow IPC bytes of a one-row table; ``record`` is a dict (JSON) or a
    one-row ``pyarrow.RecordBatch``/``Table`` (Parquet, datasets: its types kept)."""
    import pyarrow as pa

    drop = set(exclude)
    if isinstance(record, (pa.RecordBatch, pa.Table)):
        keep = [n for n in record.schema.names if n not in drop]
        table = pa.Table.from_batches([record]) if isinstance(record, pa.RecordBatch) else record
        table = table.select(keep)
    elif isinstance(record, Mapping):
        values = {_repaired(str(k)): _repaired(v) for k, v in record.items() if k not in drop}
        try:
            table = pa.Table.from_pylist([values])
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            table = pa.Table.from_pylist([{k: _plain(v) for k, v in values.items()}])
    else:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def _repaired(value: Any) -> Any:
    """``value`` with lone surrogates in its strings replaced (Arrow cannot encode them)."""
    from .repair import repair_text

    if isinstance(value, str):
        return repair_text(value)
    if isinstance(value, dict):
        return {_repaired(k): _repaired(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_repaired(v) for v in value]
    return value


def _plain(value: Any) -> Any:
    """A value Arrow could not type as it is: nested values as their JSON text."""
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return value


def unpack_table(data: bytes | None):
    import pyarrow as pa

    if not data:
        return pa.table({})
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


def unpack(data: bytes | None) -> dict:
    """The row's columns as Python values (what templates see as ``row``)."""
    table = unpack_table(data)
    return table.to_pylist()[0] if table.num_rows else {}


def columns_table(packed: list[bytes | None], names: list[str] | None = None):
    """The rows' columns as one table, one row per item (a missing value: null). ``names``:
    these columns, in this order (a row without one: null); None: every column met."""
    import pyarrow as pa

    tables = [unpack_table(p) for p in packed]
    empty = [i for i, t in enumerate(tables) if t.num_rows == 0]
    if empty:  # a document without columns (an error row): one row of nulls
        for i in empty:
            tables[i] = pa.table({"__null": pa.nulls(1)})
    merged = pa.concat_tables(tables, promote_options="permissive")
    if "__null" in merged.schema.names:
        merged = merged.drop_columns(["__null"])
    wanted = names if names is not None else merged.schema.names
    cols = [merged.column(n) if n in merged.schema.names else pa.nulls(merged.num_rows) for n in wanted]
    return pa.table(cols, names=list(wanted))
