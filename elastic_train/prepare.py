"""Turn text into Parquet shards of tokens, and check such shards.

A prepared dataset is a folder of `part-NNNNN.parquet` files with the columns
`id` (int64, unique, 0..N-1), `tokens` (list<int16>, or list<int32> when the tokenizer's ids do
not fit int16), `length` (int32), plus `source` (the input file a row came from) and `offset`
(where the row starts in that file's token stream: its documents' tokens in order, each with
the tokenizer's EOS after it; for bytes without a tokenizer, the byte offset in the file), so
that every token of the input can be traced to exactly one row. Beside the shards,
`_prepare.json` records the counts, the tokenizer ({kind, vocab_size, eos_id, pad_id}) and
`max_token_id`, and `tokenizer/` holds a copy of the tokenizer (absent for bytes).

Inputs are text files, JSONL and Parquet files, or folders of them (see `sources`). Without a
tokenizer the tokens are UTF-8 bytes (vocabulary 256, no EOS). With one, each document (a
Python definition or paragraph of a text file, a JSONL or Parquet record) is tokenized and
the EOS appended, so documents never run together and sampling knows where to stop. Rows
hold at most `max_seq_len` tokens, and are shuffled, so that neither file order nor position
in a file correlates with shard order. All token ids are held in memory for that shuffle
(1 byte a token for bytes, 4 otherwise); Parquet inputs are read in batches.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.sources import (  # noqa: F401  (TEXT_SUFFIXES, split_document_spans: API)
    TEXT_SUFFIXES,
    PathLike,
    collect_input_files,
    gather_rows,
    no_text_message,
    split_document_spans,
    warn_skipped,
)
from elastic_train.tokenizer import BYTE_VOCAB, ByteTokenizer, Tokenizer, load_tokenizer

REQUIRED_COLUMNS = ("id", "tokens", "length")
# Rows per Parquet row group: the unit a training rank reads alone (blocks.py). Small enough that
# every data partition gets many, large enough that a footer stays small.
ROWS_PER_BLOCK = 128
STATS_FILE = "_prepare.json"
TOKENIZER_DIR = "tokenizer"  # the copy of the tokenizer, beside the shards
DEFAULT_CORPUS_BYTES = 4_000_000
# Part of the default corpus's cache folder name: bump it whenever the files chosen, the way
# they are cut or what `_prepare.json` records changes, so that a corpus cached by an older
# version is not reused.
CORPUS_FORMAT = 4
# Folders of the standard library left out of the default corpus: tests, GUI code, vendored
# or generated data tables, and third-party packages that happen to live next to it.
STDLIB_EXCLUDED_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "tkinter",
    "turtledemo", "ensurepip", "pydoc_data", "encodings", "lib-dynload", "__pycache__",
    "__phello__", "venv",
})
_INT16_MAX = int(np.iinfo(np.int16).max)
logger = logging.getLogger("elastic_train.prepare")


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


def _shard_table(first_id: int, spans: np.ndarray, values: np.ndarray, names: list[str],
                 token_type: np.dtype) -> pa.Table:
    """Build one shard's table from its rows of `gather_rows` spans, ids from `first_id`."""
    lengths = (spans[:, 3] - spans[:, 2]).astype(np.int32)
    offsets = np.zeros(len(spans) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([values[start:end] for start, end in spans[:, 2:4]])
    return pa.table({
        "id": pa.array(np.arange(first_id, first_id + len(spans), dtype=np.int64)),
        "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens.astype(token_type))),
        "length": pa.array(lengths),
        "source": pa.array([names[index] for index in spans[:, 0]], type=pa.string()),
        "offset": pa.array(spans[:, 1]),
    })


def _tokenizer_record(tokenizer: Tokenizer) -> dict:
    """The `tokenizer` section of `_prepare.json`."""
    return {"kind": tokenizer.kind, "vocab_size": int(tokenizer.vocab_size),
            "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}


def prepare(
    inputs: Sequence[PathLike],
    output: PathLike,
    *,
    max_seq_len: int = 256,
    rows_per_shard: int = 20000,
    rows_per_block: int = ROWS_PER_BLOCK,
    seed: int = 0,
    tokenizer: Tokenizer | PathLike | None = None,
    text_field: str = "text",
) -> dict:
    """Turn text files, JSONL and Parquet files, or folders of them, into shuffled Parquet
    shards of tokens (a folder of Parquet that is tokenized already, with id/tokens/length and
    no text column, is only re-chunked into `rows_per_block`-row groups: `rechunk.py`): UTF-8
    bytes, or `tokenizer`'s (a Tokenizer, or a path `load_tokenizer`
    loads) with its EOS after each document. `text_field` names the text of JSONL/Parquet.

    Writes `output/tokenizer/` (unless bytes), `output/part-NNNNN.parquet`, then
    `output/_prepare.json`, and returns the stats written there. Text files that look binary
    are skipped with a warning that counts them. Raises ValueError naming the culprit if the
    tokenizer does not load, an input is missing or malformed, no text is found, or `output`
    is empty or already contains Parquet files.
    """
    if rows_per_block < 1:
        raise ValueError(f"rows_per_block must be at least 1, got {rows_per_block}")
    if max_seq_len < 1 or rows_per_shard < 1:
        raise ValueError(f"max_seq_len ({max_seq_len}) and rows_per_shard ({rows_per_shard}) "
                         "must both be at least 1")
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    if not str(output).strip():
        raise ValueError("--output: an empty path")
    out = Path(output)
    _check_output_free(out)
    from elastic_train.rechunk import is_token_dataset, rechunk

    if is_token_dataset(inputs, text_field):  # tokenized already: only new row groups
        return rechunk(inputs[0], out, rows_per_block)
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    skipped: list[tuple[Path, str]] = []
    files = collect_input_files(inputs, skipped)
    values, spans = gather_rows(files, tokenizer, max_seq_len, text_field)
    if len(spans) == 0:
        raise ValueError(no_text_message(inputs, skipped))
    warn_skipped(skipped)
    spans = spans[np.random.default_rng(seed).permutation(len(spans))]
    max_token_id = int(values.max())
    widest = max(int(tokenizer.vocab_size) - 1, max_token_id)
    token_type = np.dtype(np.int16 if widest <= _INT16_MAX else np.int32)
    names = [str(file) for file in files]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output '{out}' cannot be created: {exc.strerror or exc}") from None
    if tokenizer.kind != "bytes":
        tokenizer.save(out / TOKENIZER_DIR)
    starts = range(0, len(spans), rows_per_shard)
    for shard, first in enumerate(starts):
        table = _shard_table(first, spans[first:first + rows_per_shard], values, names, token_type)
        pq.write_table(table, out / f"part-{shard:05d}.parquet", row_group_size=rows_per_block)
    stats = {
        "rows": len(spans),
        "tokens": int(values.size),
        "max_seq_len": max_seq_len,
        "shards": len(starts),
        "source_files": len(files),
        "skipped_binary_files": len(skipped),
        "tokenizer": _tokenizer_record(tokenizer),
        "max_token_id": max_token_id,
        "token_type": token_type.name,
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


def _check_output_free(output: Path) -> None:
    """Refuse an output that is a file or already holds Parquet data."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"output '{output}' exists and is not a folder")
    if output.is_dir() and any(output.glob("*.parquet")):
        raise ValueError(f"output '{output}' already contains Parquet files; refusing to overwrite")


def stdlib_source_files(max_total_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """A deterministic subset of the standard library's .py files: sorted by path, tests and
    GUI code left out, taken in order until about `max_total_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    candidates = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [name for name in dirnames
                       if name not in STDLIB_EXCLUDED_DIRS and not name.startswith(".")]
        for name in filenames:
            # _sysconfigdata holds this machine's build paths: leave it out so the corpus
            # is the same on every install of one Python version.
            if name.endswith(".py") and not name.startswith(("test_", "_sysconfigdata")):
                candidates.append(Path(folder, name))
    candidates.sort(key=lambda path: path.relative_to(root).as_posix())
    chosen, total = [], 0
    for path in candidates:
        if total >= max_total_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


def default_corpus_dir(max_seq_len: int = 256, cache_root: PathLike | None = None) -> Path:
    """The embedded default corpus, prepared once from standard library source and cached.

    The cache folder is `<root>/stdlib-<max_seq_len>-<python version>-v<CORPUS_FORMAT>`, root
    `cache_root`, else $ELASTIC_TRAIN_CACHE, else ~/.cache/elastic_train. It is prepared in a
    temporary folder next to it and renamed into place, so it is either whole or absent;
    when concurrent processes race, the first rename wins and the others use its result.
    """
    root = Path(cache_root or os.environ.get("ELASTIC_TRAIN_CACHE")
                or Path.home() / ".cache" / "elastic_train").expanduser()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    final = root / f"stdlib-{max_seq_len}-{version}-v{CORPUS_FORMAT}"
    if (final / STATS_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        prepare(stdlib_source_files(), scratch, max_seq_len=max_seq_len)
        os.rename(scratch, final)
    except OSError as exc:
        if not (final / STATS_FILE).is_file():
            raise ValueError(f"could not create the default corpus at '{final}': {exc}") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


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


def _int_or_none(mapping: dict, key: str) -> int | None:
    """`mapping[key]` if it is an integer or null/absent; else ValueError naming the key."""
    value = mapping.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"'{key}' is {value!r}, not an integer")
    return value


def _recorded_tokenizer(fs: pafs.FileSystem, root: str) -> dict:
    """DatasetInfo's tokenizer fields, from `_prepare.json` and `tokenizer/` in folder `root`
    (all None without `_prepare.json`). ValueError naming `_prepare.json` if it is corrupt."""
    fields = dict.fromkeys(("vocab_size", "max_token_id", "eos_id", "pad_id", "tokenizer_kind",
                            "tokenizer_path"))
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
                      tokenizer_kind=section["kind"])
    except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"dataset file '{stats_path}' is corrupt: {exc}") from exc
    copy = f"{root}/{TOKENIZER_DIR}"
    if fs.get_file_info(copy).type == pafs.FileType.Directory:
        fields["tokenizer_path"] = copy
    return fields


def inspect_dataset(path: str) -> DatasetInfo:
    """Check a folder of Parquet shards (local, or any URI pyarrow.fs understands), count its
    rows and longest sample from metadata, never reading `tokens`, and read what
    `_prepare.json` records of its tokenizer.

    Raises ValueError naming the path if it does not exist, holds no .parquet files, lacks
    the `id`, `tokens` or `length` columns, has a non-integer `length`, or has no rows, and
    naming `_prepare.json` if that is corrupt.
    """
    fs, root = _resolve_dataset_path(str(path))
    files = _list_parquet_files(fs, root, str(path))
    rows, max_length = 0, 0
    columns: list[str] | None = None
    for file in files:
        try:
            with fs.open_input_file(file) as handle:
                parquet = pq.ParquetFile(handle)
                schema = parquet.schema_arrow
                _check_schema(schema, file)
                rows += parquet.metadata.num_rows
                max_length = max(max_length, _max_length(parquet))
                columns = [name for name in columns or schema.names if name in schema.names]
        except (pa.ArrowException, OSError) as exc:  # truncated, not Parquet, unreadable
            detail = " ".join(str(exc).split())
            raise ValueError(f"dataset file '{file}' is not a readable Parquet file: {detail}") from None
    if rows == 0:
        raise ValueError(f"dataset '{path}' is empty: its Parquet files hold no rows")
    is_folder = fs.get_file_info(root).type == pafs.FileType.Directory
    recorded = _recorded_tokenizer(fs, root) if is_folder else {}
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
