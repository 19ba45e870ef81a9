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
from elastic_train.data.sft import SFT_COUNTS, RecordFields, as_fields
from elastic_train.data.sources import (
    PARQUET_BATCH_ROWS,
    Gathered,
    Item,
    _jsonl_item,
    _record_documents,
    _RowBuffer,
    gather_rows,
    parquet_batch_items,
    parquet_columns,
)
from elastic_train.data.tokenizer import Tokenizer

_tokenizer_cache: dict[bytes, Tokenizer] = {}  # per worker process: unpickled once


def tokenized_schema(token_type: str) -> pa.Schema:
    """The rows between the stages. Tokens are int16 when the vocabulary fits (half the object
    store of int32; an id above the vocabulary is then an error, where the single-process version
    would widen). A piece that cannot be read gives one row with row = -1 and its ValueError's
    message: Ray does not bring a task's exception back as an object, and this way the error
    reported is that of the first bad file in input order, as with the single-process version.
    `loss_mask` is null on rows that have none; a piece that read fine-tuning examples gives one
    more row, row = -2, that carries their counts (`examples`, `truncated`, `dropped`)."""
    return pa.schema([("piece", pa.int32()), ("row", pa.int64()),
                      ("tokens", pa.list_(pa.from_numpy_dtype(np.dtype(token_type)))),
                      ("offset", pa.int64()), ("doc", pa.int64()), ("error", pa.string()),
                      ("loss_mask", pa.list_(pa.int8())),
                      *((name, pa.int64()) for name in SFT_COUNTS)])


def token_type_for(widest: int) -> np.dtype:
    """The token dtype of the single-process prepare for this largest id."""
    return np.dtype(np.int16 if widest <= INT16_MAX else np.int32)


def _cached_tokenizer(blob: bytes) -> Tokenizer:
    """The tokenizer pickled in `blob`, unpickled once per worker process (workers are reused)."""
    if blob not in _tokenizer_cache:
        _tokenizer_cache.clear()
        _tokenizer_cache[blob] = pickle.loads(blob)
    return _tokenizer_cache[blob]


def _slice_items(piece: dict, fields: RecordFields) -> Iterator[Item]:
    """The non-empty texts and examples of a JSONL piece (whole lines, read as
    `iter_jsonl_records` reads them) or a Parquet piece (whole row groups, as
    `iter_parquet_records`)."""
    if piece["kind"] == "parquet":
        parquet = pq.ParquetFile(piece["path"])
        try:
            columns = parquet_columns(parquet.schema_arrow, fields, piece["path"])
        except ValueError:
            raise ValueError(f"no text column '{fields.text}'") from None  # the driver says more
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns,
                                          row_groups=range(piece["start"], piece["end"])):
            yield from parquet_batch_items(batch, fields, piece["path"])
        return
    with open(piece["path"], "rb") as handle:
        handle.seek(piece["start"])
        data = handle.read(piece["end"] - piece["start"])
    lines = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", errors="replace")
    for number, line in enumerate(lines, start=1):  # relative: the driver reports errors
        if line.strip():
            item = _jsonl_item(line, f"'{piece['path']}' piece line {number}", fields)
            if item:
                yield item


def _piece_rows(piece: dict, tokenizer: Tokenizer, max_seq_len: int, fields: RecordFields
                ) -> Gathered:
    """`gather_rows` of one piece: a whole file, or a slice of a JSONL or Parquet file (its
    documents numbered from 0 within the piece)."""
    if piece["kind"] == "file":
        return gather_rows([Path(piece["path"])], tokenizer, max_seq_len, fields)
    rows = _RowBuffer()
    rows.add_documents(0, _record_documents(_slice_items(piece, fields), tokenizer,
                                            max_seq_len, rows.sft), 0)
    return rows.finish()


def _piece_table(index: int, gathered: Gathered, token_type: str, schema: pa.Schema
                 ) -> pa.Table:
    """One piece's rows (and its counts row, when it read fine-tuning examples)."""
    values, spans, mask, sft = gathered
    tables = [schema.empty_table()]
    if sft.examples:
        tables.append(pa.table({
            "piece": [index], "row": [-2], "tokens": [[]], "offset": [-1], "doc": [-1],
            "error": [None], "loss_mask": [None],
            **{name: [getattr(sft, name)] for name in SFT_COUNTS}}, schema=schema))
    if len(spans) == 0:
        return pa.concat_tables(tables)
    # gather_rows stores the rows back to back: row i is values[spans[i, 2]:spans[i, 3]].
    bounds = np.append(spans[:, 2], spans[-1, 3]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(pa.array(bounds), pa.array(values.astype(token_type)))
    masks = pa.nulls(len(spans), pa.list_(pa.int8())) if mask is None else (
        pa.ListArray.from_arrays(pa.array(bounds), pa.array(mask.astype(np.int8))))
    zeros = pa.array(np.zeros(len(spans), dtype=np.int64))
    tables.append(pa.table({
        "piece": pa.array(np.full(len(spans), index, dtype=np.int32)),
        "row": pa.array(np.arange(len(spans), dtype=np.int64)),
        "tokens": tokens, "offset": pa.array(spans[:, 1]), "doc": pa.array(spans[:, 4]),
        "error": pa.nulls(len(spans), pa.string()), "loss_mask": masks,
        **dict.fromkeys(SFT_COUNTS, zeros)}, schema=schema))
    return pa.concat_tables(tables)


def tokenize_pieces(batch: pa.Table, *, tokenizer_blob: bytes, max_seq_len: int,
                    text_field: RecordFields | str, token_type: str) -> pa.Table:
    """Tokenize stage: the rows of each piece of the batch's task groups."""
    tokenizer = _cached_tokenizer(tokenizer_blob)
    fields = as_fields(text_field)
    schema = tokenized_schema(token_type)
    tables = [schema.empty_table()]
    for piece in (piece for group in batch.column("pieces").to_pylist()
                  for piece in json.loads(group)):
        index = piece["piece"]
        try:
            gathered = _piece_rows(piece, tokenizer, max_seq_len, fields)
            values = gathered.values
            if len(values) and values.max() > np.iinfo(token_type).max:
                raise ValueError(f"token id {values.max()} is above the vocabulary "
                                 f"({tokenizer.vocab_size}) of the tokenizer")
        except ValueError as exc:
            tables.append(pa.table({"piece": [index], "row": [-1], "tokens": [[]], "offset": [-1],
                                    "doc": [-1], "error": [str(exc)], "loss_mask": [None],
                                    **{name: [0] for name in SFT_COUNTS}},
                                   schema=schema))
            continue
        tables.append(_piece_table(index, gathered, token_type, schema))
    return pa.concat_tables(tables)


def summarize_pieces(table: pa.Table) -> pa.Table:
    """Rows, tokens, largest token id and error per piece of one block (a piece may span
    blocks), and its rows per document: `doc_rows[i]` rows of the piece's document
    `first_doc + i` lie in this block (the driver adds up the blocks of a piece); its rows with
    a loss mask and its fine-tuning counts (from its row -2)."""
    pieces = table.column("piece").to_numpy()
    counts_row = table.column("row").to_numpy() == -2
    masked = table.column("loss_mask").is_valid().to_numpy(zero_copy_only=False)
    sft = {name: table.column(name).to_numpy() for name in SFT_COUNTS}
    docs = table.column("doc").to_numpy()
    lengths = pc.list_value_length(table.column("tokens")).to_numpy(zero_copy_only=False)
    errors = table.column("error").to_pylist()
    summary: dict[str, list] = {"piece": [], "rows": [], "tokens": [], "max_token": [], "error": [],
                                "first_doc": [], "doc_rows": [], "masked": [],
                                **{name: [] for name in SFT_COUNTS}}
    for piece in np.unique(pieces):
        chosen = (pieces == piece) & ~counts_row
        for name, values in sft.items():
            summary[name].append(int(values[pieces == piece].sum()))
        summary["masked"].append(int((chosen & masked).sum()))
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
        ("doc_rows", pa.list_(pa.int64())), ("masked", pa.int64()),
        *((name, pa.int64()) for name in SFT_COUNTS)]))


def mask_column(tokens: pa.ListArray, masks: pa.ChunkedArray) -> pa.ListArray:
    """The `loss_mask` column of the single-process prepare: each row's mask, all 1 on a row
    that has none (plain text in a data set that also holds fine-tuning examples)."""
    masks = masks.combine_chunks()
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.ones(int(offsets[-1]), dtype=np.int8)
    valid = np.flatnonzero(masks.is_valid().to_numpy(zero_copy_only=False))
    if len(valid):
        positions = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in valid])
        flat[positions] = pc.list_flatten(masks.take(pa.array(valid))).to_numpy()
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))


def jsonl_bounds(file: Path, size: int, piece_bytes: int) -> list[int]:
    """Cuts of a JSONL file into pieces of about `piece_bytes`, each at a line start."""
    bounds = [0]
    with open(file, "rb") as handle:
        for target in range(piece_bytes, size, piece_bytes):
            if target > bounds[-1]:
                handle.seek(target - 1)
                cut = target - 1 + len(handle.readline())  # just after the next newline
                if bounds[-1] < cut < size:
                    bounds.append(cut)
    return bounds + [size]


def parquet_bounds(file: Path, piece_bytes: int) -> list[int]:
    """Cuts of a Parquet file's row groups into pieces of about `piece_bytes` (uncompressed)."""
    metadata = pq.ParquetFile(file).metadata
    bounds, filled = [0], 0
    for group in range(metadata.num_row_groups):
        if filled >= piece_bytes:
            bounds.append(group)
            filled = 0
        filled += metadata.row_group(group).total_byte_size
    return bounds + [metadata.num_row_groups]
