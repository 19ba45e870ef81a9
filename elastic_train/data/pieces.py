"""The work of one `prepare` task, pure pyarrow and numpy: tokenize a few pieces of the inputs
(whole files, or slices of a large JSONL or Parquet file) into rows, and summarize them.

cluster/prepare_ray.py runs these in Ray Data's `map_batches`; they import no Ray, so the rows
they make are those of the single-process `sources.gather_rows` by construction.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from elastic_train.data.dataset import INT16_MAX
from elastic_train.data.sources import (
    PARQUET_BATCH_ROWS,
    _jsonl_text,
    _record_documents,
    _RowBuffer,
    gather_rows,
)
from elastic_train.data.tokenizer import Tokenizer

_tokenizer_cache: dict[bytes, Tokenizer] = {}  # per worker process: unpickled once


def tokenized_schema(token_type: str) -> pa.Schema:
    """The rows between the stages. Tokens are int16 when the vocabulary fits (half the object
    store of int32; an id above the vocabulary is then an error, where the single-process version
    would widen). A piece that cannot be read gives one row with row = -1 and its ValueError's
    message: Ray does not bring a task's exception back as an object, and this way the error
    reported is that of the first bad file in input order, as with the single-process version."""
    return pa.schema([("piece", pa.int32()), ("row", pa.int64()),
                      ("tokens", pa.list_(pa.from_numpy_dtype(np.dtype(token_type)))),
                      ("offset", pa.int64()), ("doc", pa.int64()), ("error", pa.string())])


def token_type_for(widest: int) -> np.dtype:
    """The token dtype of the single-process prepare for this largest id."""
    return np.dtype(np.int16 if widest <= INT16_MAX else np.int32)


def _cached_tokenizer(blob: bytes) -> Tokenizer:
    """The tokenizer pickled in `blob`, unpickled once per worker process (workers are reused)."""
    if blob not in _tokenizer_cache:
        _tokenizer_cache.clear()
        _tokenizer_cache[blob] = pickle.loads(blob)
    return _tokenizer_cache[blob]


def _slice_texts(piece: dict, text_field: str) -> Iterator[str]:
    """The non-empty texts of a JSONL piece (whole lines, read as `iter_jsonl_texts` reads them)
    or a Parquet piece (whole row groups, as `iter_parquet_texts`)."""
    if piece["kind"] == "parquet":
        parquet = pq.ParquetFile(piece["path"])
        schema = parquet.schema_arrow
        kind = schema.field(text_field).type if text_field in schema.names else pa.null()
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"no text column '{text_field}'")  # the driver tells the whole story
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[text_field],
                                          row_groups=range(piece["start"], piece["end"])):
            yield from (text for text in batch.column(0).to_pylist() if text)
        return
    with open(piece["path"], "rb") as handle:
        handle.seek(piece["start"])
        data = handle.read(piece["end"] - piece["start"])
    lines = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")
    for number, line in enumerate(lines, start=1):  # relative: the driver reports errors
        if line.strip():
            text = _jsonl_text(line, f"'{piece['path']}' piece line {number}", text_field)
            if text:
                yield text


def _piece_rows(piece: dict, tokenizer: Tokenizer, max_seq_len: int, text_field: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """`gather_rows` of one piece: a whole file, or a slice of a JSONL or Parquet file (its
    documents numbered from 0 within the piece)."""
    if piece["kind"] == "file":
        return gather_rows([Path(piece["path"])], tokenizer, max_seq_len, text_field)
    rows = _RowBuffer()
    rows.add_documents(0, _record_documents(_slice_texts(piece, text_field), tokenizer,
                                            max_seq_len), 0)
    return rows.finish()


def tokenize_pieces(batch: pa.Table, *, tokenizer_blob: bytes, max_seq_len: int, text_field: str,
              token_type: str) -> pa.Table:
    """Tokenize stage: the rows of each piece of the batch's task groups."""
    tokenizer = _cached_tokenizer(tokenizer_blob)
    schema = tokenized_schema(token_type)
    tables = [schema.empty_table()]
    for piece in (piece for group in batch.column("pieces").to_pylist()
                  for piece in json.loads(group)):
        index = piece["piece"]
        try:
            values, spans = _piece_rows(piece, tokenizer, max_seq_len, text_field)
            if len(values) and values.max() > np.iinfo(token_type).max:
                raise ValueError(f"token id {values.max()} is above the vocabulary "
                                 f"({tokenizer.vocab_size}) of the tokenizer")
        except ValueError as exc:
            tables.append(pa.table({"piece": [index], "row": [-1], "tokens": [[]], "offset": [-1],
                                    "doc": [-1], "error": [str(exc)]}, schema=schema))
            continue
        if len(spans) == 0:
            continue
        # gather_rows stores the rows back to back: row i is values[spans[i, 2]:spans[i, 3]].
        bounds = np.append(spans[:, 2], spans[-1, 3]).astype(np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(bounds), pa.array(values.astype(token_type)))
        tables.append(pa.table({
            "piece": pa.array(np.full(len(spans), index, dtype=np.int32)),
            "row": pa.array(np.arange(len(spans), dtype=np.int64)),
            "tokens": tokens, "offset": pa.array(spans[:, 1]), "doc": pa.array(spans[:, 4]),
            "error": pa.nulls(len(spans), pa.string())}, schema=schema))
    return pa.concat_tables(tables)


def summarize_pieces(table: pa.Table) -> pa.Table:
    """Rows, tokens, largest token id and error per piece of one block (a piece may span
    blocks), and its rows per document: `doc_rows[i]` rows of the piece's document
    `first_doc + i` lie in this block (the driver adds up the blocks of a piece)."""
    pieces = table.column("piece").to_numpy()
    docs = table.column("doc").to_numpy()
    lengths = pc.list_value_length(table.column("tokens")).to_numpy(zero_copy_only=False)
    errors = table.column("error").to_pylist()
    summary: dict[str, list] = {"piece": [], "rows": [], "tokens": [], "max_token": [], "error": [],
                                "first_doc": [], "doc_rows": []}
    for piece in np.unique(pieces):
        chosen = pieces == piece
        flat = pc.list_flatten(table.column("tokens").filter(pa.array(chosen)))
        ours = docs[chosen & (docs >= 0)]
        first = int(ours.min()) if len(ours) else 0
        summary["piece"].append(int(piece))
        summary["rows"].append(int(chosen.sum()))
        summary["tokens"].append(int(lengths[chosen].sum()))
        summary["max_token"].append(int(pc.max(flat).as_py() or 0))
        summary["error"].append(next((errors[i] for i in np.flatnonzero(chosen) if errors[i]), None))
        summary["first_doc"].append(first)
        summary["doc_rows"].append(np.bincount(ours - first).tolist() if len(ours) else [])
    return pa.table(summary, schema=pa.schema([
        ("piece", pa.int64()), ("rows", pa.int64()), ("tokens", pa.int64()),
        ("max_token", pa.int64()), ("error", pa.string()), ("first_doc", pa.int64()),
        ("doc_rows", pa.list_(pa.int64()))]))
