"""A prepared data set as the trainer sees it: a folder of Parquet shards (local or any pyarrow.fs
URI) with `id`, `tokens`, `length`, and `_prepare.json` beside them saying how it was made.

`inspect_dataset` reads footers and `_prepare.json` only (never `tokens`); `dataset_blocks`
lists its row groups as the blocks the workers read.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data.rowgroups import BlockTable, build_block_table
from elastic_train.data.tokenizer import BYTE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer

REQUIRED_COLUMNS = ("id", "tokens", "length")
STATS_FILE = "_prepare.json"
PENDING_FILE = "_prepare.pending"  # there while a prepare writes; removed after STATS_FILE


@contextmanager
def pending_marker(fs: pafs.FileSystem, root: str) -> Iterator[None]:
    """`PENDING_FILE` in `root` while the block writes a prepare's output, removed when it ends
    without an error: a folder still holding it is a prepare that was killed or failed
    (`inspect_dataset` refuses it), while shards copied out of a prepared folder are a data set
    of their own."""
    with fs.open_output_stream(f"{root}/{PENDING_FILE}") as handle:
        handle.write(b"a prepare is writing this folder; it removes this file when it is done\n")
    yield
    fs.delete_file(f"{root}/{PENDING_FILE}")


TOKENIZER_DIR = "tokenizer"  # the copy of the tokenizer, beside the shards


INT16_MAX = int(np.iinfo(np.int16).max)


@dataclass(frozen=True)
class DatasetInfo:
    """What `inspect_dataset` learned about a folder of Parquet shards. The tokenizer fields
    come from `_prepare.json`; they are None for data sets made by other tools."""

    path: str  # normalized path inside `filesystem` (absolute for local folders)
    filesystem: pafs.FileSystem  # the pyarrow filesystem that holds `files`
    files: list[str]  # the shards, sorted by name, as paths inside `filesystem`
    rows: int  # total rows over all shards
    max_length: int  # largest value of the `length` column
    vocab_size: int | None = None  # the tokenizer's vocabulary size (256 for bytes)
    max_token_id: int | None = None  # the largest token id written
    eos_id: int | None = None  # end-of-document id appended after each document, if any
    pad_id: int | None = None  # the tokenizer's padding id, if it has one
    tokenizer_kind: str | None = None  # "bytes" | "hf"
    tokenizer_path: str | None = None  # the tokenizer copy folder inside `filesystem`, if any
    columns: tuple[str, ...] = ()  # the columns every shard has, in the first shard's order
    max_seq_len: int | None = None  # the longest row `prepare` was asked for (--max-seq-len)
    # the held-out set `prepare --eval-fraction` wrote: {path (inside `filesystem`), fraction,
    # documents, rows, tokens}; None when there is none
    eval_split: dict | None = None


def join_uri(base: str, *names: str) -> str:
    """`base/names...`, for a local path or a pyarrow.fs URI; a URI's options stay at its end
    (`s3://b/runs?endpoint_override=host:9000` + `r` is `s3://b/runs/r?endpoint_override=...`)."""
    head, mark, options = base.partition("?") if "://" in base else (base, "", "")
    return "/".join([head.rstrip("/"), *names]) + mark + options


def _resolve_dataset_path(path: str) -> tuple[pafs.FileSystem, str]:
    """A pyarrow filesystem and the path inside it, for a URI or a plain local path."""
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise ValueError(f"dataset path '{path}' is not a URI pyarrow can open: {exc}") from exc
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path))


def _list_parquet_files(fs: pafs.FileSystem, root: str, shown: str) -> list[str]:
    """The .parquet files in folder `root` (or `root` itself if it is one), sorted by name."""
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise ValueError(f"dataset path '{shown}' does not exist")
    if info.type == pafs.FileType.File:
        entries = [info]
    else:
        entries = fs.get_file_info(pafs.FileSelector(root, recursive=False))
    files = [entry.path for entry in entries
             if entry.type == pafs.FileType.File and entry.base_name.endswith(".parquet")]
    if not files:
        raise ValueError(f"dataset path '{shown}' contains no .parquet files")
    return sorted(files, key=lambda file: file.rsplit("/", 1)[-1])


def _check_schema(schema: pa.Schema, file: str) -> None:
    """Raise ValueError naming `file` if the required columns are missing or mistyped."""
    missing = [name for name in REQUIRED_COLUMNS if name not in schema.names]
    if missing:
        raise ValueError(f"dataset file '{file}' is missing required column(s) "
                         f"{', '.join(missing)} (it has: {', '.join(schema.names)})")
    length_type = schema.field("length").type
    if not pa.types.is_integer(length_type):
        raise ValueError(f"dataset file '{file}': column 'length' must be an integer type, "
                         f"not {length_type}")
    tokens_type = schema.field("tokens").type
    if not (pa.types.is_list(tokens_type) or pa.types.is_large_list(tokens_type)) or \
            not pa.types.is_integer(tokens_type.value_type):
        raise ValueError(f"dataset file '{file}': column 'tokens' must be a list of integer "
                         f"token ids, not {tokens_type}")


def _max_length(parquet: pq.ParquetFile) -> int:
    """Largest `length` in a file: from row-group statistics, else reading that column only."""
    metadata = parquet.metadata
    best = 0
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        if row_group.num_rows == 0:
            continue
        columns = [row_group.column(i) for i in range(row_group.num_columns)]
        column = next(c for c in columns if c.path_in_schema == "length")
        stats = column.statistics
        if stats is None or not stats.has_min_max:
            lengths = parquet.read_row_group(group, columns=["length"]).column("length")
            best = max(best, pc.max(lengths).as_py() or 0)
        else:
            best = max(best, int(stats.max))
    return best


def _token_range(parquet: pq.ParquetFile) -> tuple[int, int] | None:
    """Smallest and largest token id in a file, from the row-group statistics of `tokens`
    (None where a row group has none: the workers' check of each batch stays)."""
    metadata, low, high = parquet.metadata, None, None
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        if row_group.num_rows == 0:
            continue
        column = next(row_group.column(i) for i in range(row_group.num_columns)
                      if row_group.column(i).path_in_schema.startswith("tokens."))
        stats = column.statistics
        if stats is None or not stats.has_min_max:
            return None
        low = int(stats.min) if low is None else min(low, int(stats.min))
        high = int(stats.max) if high is None else max(high, int(stats.max))
    return None if low is None else (low, high)


def _int_or_none(mapping: dict, key: str) -> int | None:
    """`mapping[key]` if it is an integer or null/absent; else ValueError naming the key."""
    value = mapping.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"'{key}' is {value!r}, not an integer")
    return value


def _recorded_split(stats: dict, folder: str) -> dict | None:
    """The `eval` section of `_prepare.json`, its path made one as the data set's `folder` is
    given (a local path, or a URI with its options: a path inside the store was taken for a
    local one)."""
    split = stats.get("eval")
    if split is None:
        return None
    if not isinstance(split, dict) or not isinstance(split.get("path"), str) or not isinstance(
            split.get("fraction"), int | float):
        raise ValueError(f"'eval' is {split!r}, not an object with a 'path' and a 'fraction'")
    return {**split, "path": join_uri(folder, split["path"])}


def _recorded(fs: pafs.FileSystem, root: str, folder: str) -> dict:
    """DatasetInfo's fields that `_prepare.json` and `tokenizer/` in folder `root` (of `fs`;
    `folder`: a URI as given, else `root`) give: the tokenizer's, max_seq_len, the held-out
    split (all None without `_prepare.json`). ValueError naming `_prepare.json` if corrupt."""
    fields = dict.fromkeys(("vocab_size", "max_token_id", "eos_id", "pad_id", "tokenizer_kind",
                            "tokenizer_path", "max_seq_len", "eval_split"))
    stats_path = f"{root}/{STATS_FILE}"
    if fs.get_file_info(stats_path).type != pafs.FileType.File:
        return fields
    try:
        with fs.open_input_stream(stats_path) as handle:
            stats = json.loads(handle.read())
        if not isinstance(stats, dict):
            raise ValueError("it is not a JSON object")
        # Versions before tokenizers wrote no `tokenizer` section: their tokens were bytes.
        section = stats.get("tokenizer", {"kind": "bytes", "vocab_size": BYTE_VOCAB})
        if not isinstance(section, dict) or not isinstance(section.get("kind"), str):
            raise ValueError(f"'tokenizer' is {section!r}, not an object with a 'kind'")
        fields.update(vocab_size=_int_or_none(section, "vocab_size"),
                      eos_id=_int_or_none(section, "eos_id"),
                      pad_id=_int_or_none(section, "pad_id"),
                      max_token_id=_int_or_none(stats, "max_token_id"),
                      tokenizer_kind=section["kind"],
                      max_seq_len=_int_or_none(stats, "max_seq_len"),
                      eval_split=_recorded_split(stats, folder))
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"dataset file '{stats_path}' is corrupt: {exc}") from exc
    copy = f"{root}/{TOKENIZER_DIR}"
    if fs.get_file_info(copy).type == pafs.FileType.Directory:
        fields["tokenizer_path"] = copy
    return fields


def inspect_dataset(path: str) -> DatasetInfo:
    """Check a folder of Parquet shards (local, or any URI pyarrow.fs understands), count its
    rows and longest sample from metadata, never reading `tokens`, and read what
    `_prepare.json` records: its tokenizer, max_seq_len, and the held-out split.

    Raises ValueError naming the path if it does not exist, holds no .parquet files, lacks
    the `id`, `tokens` or `length` columns, has a non-integer `length`, or has no rows, and
    naming `_prepare.json` if that is corrupt.
    """
    fs, root = _resolve_dataset_path(str(path))
    files = _list_parquet_files(fs, root, str(path))
    rows, max_length = 0, 0
    columns: list[str] | None = None
    token_ids: list[tuple[int, int] | None] = []
    for file in files:
        try:
            with fs.open_input_file(file) as handle:
                parquet = pq.ParquetFile(handle)
                schema = parquet.schema_arrow
                _check_schema(schema, file)
                rows += parquet.metadata.num_rows
                max_length = max(max_length, _max_length(parquet))
                columns = [name for name in columns or schema.names if name in schema.names]
                token_ids.append(_token_range(parquet))
        except (pa.ArrowException, OSError) as exc:  # truncated, not Parquet, unreadable
            detail = " ".join(str(exc).split())
            raise ValueError(f"dataset file '{file}' is not a readable Parquet file: {detail}") from None
        if token_ids[-1] is not None and token_ids[-1][0] < 0:
            raise ValueError(f"dataset file '{file}': column 'tokens' holds the negative token "
                             f"id {token_ids[-1][0]}")
    if rows == 0:
        raise ValueError(f"dataset '{path}' is empty: its Parquet files hold no rows")
    is_folder = fs.get_file_info(root).type == pafs.FileType.Directory
    recorded = _recorded(fs, root, str(path) if "://" in str(path) else root) if is_folder else {}
    if is_folder and fs.get_file_info(f"{root}/{PENDING_FILE}").type != pafs.FileType.NotFound:
        raise ValueError(f"dataset '{path}' is an unfinished prepare output: it still holds "
                         f"{PENDING_FILE}, which prepare removes when it has written everything "
                         "(it was killed or failed); prepare it again into an empty folder")
    if recorded.get("max_token_id") is None and token_ids and None not in token_ids:
        recorded["max_token_id"] = max(high for _, high in token_ids)  # a data set of its own
    return DatasetInfo(path=root, filesystem=fs, files=files, rows=rows, max_length=max_length,
                       columns=tuple(columns or ()), **recorded)


def load_dataset_tokenizer(info: DatasetInfo) -> Tokenizer:
    """The tokenizer a data set was prepared with: its `tokenizer/` copy (copied to a
    temporary folder first when the data set is not on the local filesystem), else bytes.

    Raises ValueError if `_prepare.json` names a tokenizer other than bytes but the copy is
    missing, or the copy does not load."""
    label = f"the tokenizer of dataset '{info.path}'"
    if info.tokenizer_path is None:
        if info.tokenizer_kind not in (None, "bytes"):
            raise ValueError(f"dataset '{info.path}' was prepared with a {info.tokenizer_kind} "
                             f"tokenizer, but its copy '{TOKENIZER_DIR}/' is missing")
        return ByteTokenizer()
    if isinstance(info.filesystem, pafs.LocalFileSystem):
        return load_tokenizer(info.tokenizer_path, label=label)
    with tempfile.TemporaryDirectory(prefix="elastic_train-tokenizer-") as scratch:
        pafs.copy_files(info.tokenizer_path, scratch, source_filesystem=info.filesystem,
                        destination_filesystem=pafs.LocalFileSystem())
        return load_tokenizer(scratch, label=label)


def dataset_blocks(info: DatasetInfo) -> BlockTable:
    """The data set's blocks (row groups), from the Parquet footers; workers open `_uri`s."""
    return build_block_table(info.filesystem, info.files, [_uri(info, f) for f in info.files])


# Keys every batch has (`batches.make_batch`): a column of one of these names would replace it.
BATCH_KEYS = ("tokens", "attention_mask", "position_ids", "labels", "lengths")
# Columns that never reach the loss: the required ones and prepare's bookkeeping.
NOT_EXTRA = ("id", "tokens", "length", "source", "offset", "doc")


def _numeric(t: pa.DataType) -> bool:
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _extra_fields(schema: pa.Schema) -> list[pa.Field]:
    return [f for f in schema if f.name not in NOT_EXTRA and _numeric(f.type)]


def extra_columns(info: DatasetInfo) -> tuple[str, ...]:
    """Numeric columns of the data set beyond id/tokens/length (e.g. `label`): they reach the
    loss in the batch. `source`, `offset` and `doc` (written by prepare) are left out
    (`check_extra_columns` has refused what would not arrive whole)."""
    with info.filesystem.open_input_file(info.files[0]) as f:
        schema = pq.read_schema(f)
    return tuple(f.name for f in _extra_fields(schema))


def check_extra_columns(info: DatasetInfo) -> None:
    """ValueError naming the column and shard when an extra column (`extra_columns`) would not
    reach the loss as it is: its name is one the batch already has (`BATCH_KEYS`: it would
    replace `labels`, say), a later shard lacks it (the worker failed on a schema mismatch), or
    it holds nulls (read as NaN: a null label counted as a value)."""
    first = info.files[0]
    with info.filesystem.open_input_file(first) as f:
        fields = {field.name for field in _extra_fields(pq.read_schema(f))}
    taken = sorted(fields & set(BATCH_KEYS))
    if taken:
        raise ValueError(f"dataset file '{first}': column '{taken[0]}' has the name of a key "
                         f"every batch has ({', '.join(BATCH_KEYS)}): rename it, it would "
                         "replace that key in the loss's batch")
    for file in info.files if fields else ():  # footers only, and only when a column goes
        with info.filesystem.open_input_file(file) as f:
            parquet = pq.ParquetFile(f)
            lacking = sorted(fields - set(parquet.schema_arrow.names))
            if lacking:
                raise ValueError(f"dataset file '{file}' has no column '{lacking[0]}', which "
                                 f"'{first}' has and the loss is given: every shard needs it")
            metadata = parquet.metadata
            for group in range(metadata.num_row_groups):
                row_group = metadata.row_group(group)
                for i in range(row_group.num_columns):
                    column = row_group.column(i)
                    name = column.path_in_schema.split(".", 1)[0]
                    stats = column.statistics
                    if (name in fields and stats is not None and stats.has_null_count
                            and stats.null_count):
                        raise ValueError(f"dataset file '{file}', row group {group}: column "
                                         f"'{name}' holds {stats.null_count} null value(s); the "
                                         "loss would read them as NaN: fill them or drop the rows")


def _uri(info: DatasetInfo, path: str) -> str:
    """A shard's path as workers on any node open it (pyarrow.fs URI for remote storage)."""
    if isinstance(info.filesystem, pafs.LocalFileSystem):
        return path
    return f"{info.filesystem.type_name}://{path}"
