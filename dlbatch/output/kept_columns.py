"""Input columns kept in the result rows (``output.keep_columns``): one Arrow type per column
for the whole output, and a row whose value does not fit it is that row's dead letter.

Input rows are not typed alike: a JSONL column may hold ``1`` in one row and ``"one"`` in the
next. Joined as they come, such a flush fails (Arrow cannot put an int64 and a string in one
column), nothing is committed and every rerun fails the same way; committed as they come, one
part holds the column as int64 and the next as string, and readers of the whole output fail.
So each kept column gets one type, fixed for the output, and each document is checked
against it:

- **The column's type.** The type the output already committed for the column (the first
  committed part's schema, or the Delta table's); for a column not committed yet, the type
  Arrow's permissive promotion gives the flush's values (nulls take any type, int64 and
  float64 give float64, structs gain fields), and when they have none, the type most of the
  flush's documents hold (ties: the first document's).
- **A value fits** when the permissive promotion of the column's type and the value's type is
  the column's type: a null, the same type, or a narrower one (an int in a float column, a
  struct with fewer fields). It is cast to the column's type.
- **A value that does not fit** makes its document a dead letter (``stage: output``,
  ``error_type: ColumnType``, naming the column, the column's type and the value's type); the
  flush commits the other documents. The dead letter is committed like any other, so a rerun
  skips the document and is a no-op.

Why a dead letter rather than widening the column to string: widening would turn every good
row's typed value (ints, dates, structs) into text for the sake of one bad row, and would
change the type of a column readers already use; the bad row is kept visible, with its
reason, where failed rows go.
"""
from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("dlbatch.output.kept_columns")


def _unify(types: list):
    """The permissive promotion of ``types`` (pyarrow DataTypes), None when there is none."""
    import pyarrow as pa

    try:
        return pa.unify_schemas([pa.schema([("c", t)]) for t in types], promote_options="permissive").field("c").type
    except (pa.ArrowException, TypeError, ValueError):
        return None


def _fits(value_type, column_type) -> bool:
    import pyarrow as pa

    return pa.types.is_null(value_type) or value_type == column_type or _unify([column_type, value_type]) == column_type


class KeptColumns:
    """The kept columns of one output: their names (``output.keep_columns``: a list, or "all")
    and their types once fixed."""

    def __init__(self, names):
        self.names = None if names == "all" else list(names)
        self.types: dict | None = None  # column -> pyarrow DataType; None until `bind`

    @property
    def bound(self) -> bool:
        return self.types is not None

    def bind(self, schema, skip=()) -> None:
        """Fix the types the output has committed (``schema``: a pyarrow Schema, or None when
        nothing is committed; ``skip``: the result columns, never kept). Called once, before
        the first flush is fitted."""
        import pyarrow as pa

        self.types = {}
        for f in schema or []:
            if f.name in skip or (self.names is not None and f.name not in self.names):
                continue
            if not pa.types.is_null(f.type):  # a column null so far takes the type of its first values
                self.types[f.name] = f.type

    def fit(self, rows: list[dict], errors: list[dict], skip=(), committed=None) -> tuple[list[dict], list[dict], object]:
        """(the rows whose documents fit, ``errors`` plus one dead letter per document that does
        not, the kept columns of those rows as one table with the columns' types; None without
        rows). ``skip``: the result columns (with "all", an input column of such a name is not
        kept); ``committed``: a callable giving the committed schema, asked once (`bind`)."""
        import pyarrow as pa

        from connectors.columns import unpack_table

        if not rows:
            return rows, errors, None
        if not self.bound:
            self.bind(committed() if committed is not None else None, skip)

        tables = {}  # the packed bytes of a document's columns -> its one-row table
        for r in rows:
            b = r.get("columns")
            if b not in tables:
                tables[b] = unpack_table(b)
        names = self.names if self.names is not None else list(dict.fromkeys(
            n for t in tables.values() for n in t.schema.names if n not in skip))
        self._decide(names, list(tables.values()))
        bad = {}  # doc_id -> the reason
        for r in rows:
            why = self._misfit(tables[r.get("columns")], names)
            if why and r["doc_id"] not in bad:
                bad[r["doc_id"]] = (r, why)
        if bad:
            errors = errors + [self._dead_letter(r, why) for r, why in bad.values()]
            rows = [r for r in rows if r["doc_id"] not in bad]
        cols = {n: [] for n in names}
        for r in rows:
            t = tables[r.get("columns")]
            for n in names:
                cols[n].append(t.column(n)[0].cast(self.types[n]) if n in t.schema.names else None)
        kept = pa.table({n: pa.array(cols[n], self.types[n]) for n in names}) if names else None
        return rows, errors, kept

    def _decide(self, names: list[str], tables: list) -> None:
        """Fix the type of each column of ``names`` not fixed yet, from the flush's values."""
        import pyarrow as pa

        if self.types is None:
            self.types = {}
        for n in names:
            if n in self.types and not pa.types.is_null(self.types[n]):
                continue
            seen = [t.schema.field(n).type for t in tables if n in t.schema.names]
            seen = [ty for ty in seen if not pa.types.is_null(ty)]
            if not seen:
                continue  # null in every row so far: typed when a value comes
            self.types[n] = _unify(seen) or Counter(seen).most_common(1)[0][0]
        for n in names:
            self.types.setdefault(n, pa.null())

    def _misfit(self, table, names: list[str]) -> str | None:
        """Why a document's columns do not fit the columns' types (None: they fit)."""
        for n in names:
            if n not in table.schema.names:
                continue
            ty = table.schema.field(n).type
            if not _fits(ty, self.types[n]):
                value = repr(table.column(n)[0].as_py())[:80]
                return (f"output.keep_columns: the column {n!r} of this row is {ty} ({value}), but the output's "
                        f"column {n!r} is {self.types[n]}: the value does not fit, so the row is not committed "
                        f"(give the input one type per column)")
        return None

    @staticmethod
    def _dead_letter(row: dict, why: str) -> dict:
        log.warning("document %s is a dead letter: %s", row["doc_id"], why)
        return {"doc_id": row["doc_id"], "source": row.get("source"), "task": None, "stage": "output",
                "error_type": "ColumnType", "error": why}
