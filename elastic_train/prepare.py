"""Turn text files into Parquet shards of byte tokens, and check such shards.

A prepared dataset is a folder of `part-NNNNN.parquet` files with the columns
`id` (int64, unique, 0..N-1), `tokens` (list<int16>, the UTF-8 bytes of the text),
`length` (int32), plus `source` (the file a row came from) and `offset` (where in that file
its bytes start), so that every byte of the input can be traced to exactly one row.

Documents are cut at natural boundaries: in Python source every def, async def and class, at
any indentation, starts one (with the decorators and comments directly above it), and one
longer than `max_seq_len` is cut again at blank lines into groups of paragraphs of up to
`max_seq_len // 2` tokens; other text is cut into blank-line paragraphs. What is still longer
than `max_seq_len` is split into chunks of that size. The rows are then shuffled, so that
neither file order nor position in a file correlates with shard order.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

TEXT_SUFFIXES = frozenset({".txt", ".py", ".md", ".rst"})
REQUIRED_COLUMNS = ("id", "tokens", "length")
STATS_FILE = "_prepare.json"
DEFAULT_CORPUS_BYTES = 4_000_000
# Part of the default corpus's cache folder name: bump it whenever the files chosen or the way
# they are cut changes, so that a corpus cached by an older version is not reused.
CORPUS_FORMAT = 2
# Folders of the standard library left out of the default corpus: tests, GUI code, vendored
# or generated data tables, and third-party packages that happen to live next to it.
STDLIB_EXCLUDED_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "tkinter",
    "turtledemo", "ensurepip", "pydoc_data", "encodings", "lib-dynload", "__pycache__",
    "__phello__", "venv",
})

# A Python definition line, at any indentation: `def name(`, `async def name(`, `class name`
# followed by `(`, `[` or `:` (the name check keeps most prose in docstrings out).
_PY_DEF_LINE = re.compile(
    rb"[ \t]*(?:(?:async[ \t]+)?def[ \t]+\w+[ \t]*[(\[]|class[ \t]+\w+[ \t]*[(\[:])")
# A paragraph ends after two or more newlines (blank lines may hold spaces).
_PARAGRAPH_END = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")

PathLike = str | os.PathLike


@dataclass(frozen=True)
class DatasetInfo:
    """What `inspect_dataset` learned about a folder of Parquet shards."""

    path: str  # normalized path inside `filesystem` (absolute for local folders)
    filesystem: pafs.FileSystem  # the pyarrow filesystem that holds `files`
    files: list[str]  # the shards, sorted by name, as paths inside `filesystem`
    rows: int  # total rows over all shards
    max_length: int  # largest value of the `length` column


def _python_cuts(data: bytes) -> list[int]:
    """Offsets where Python definitions start: every def, async def and class, at any
    indentation, together with the decorators and comment lines directly above it."""
    cuts = [0]
    preamble: int | None = None  # where the decorators/comments above the next def start
    decorated = False  # the preamble holds a decorator, so any line may continue it
    offset = 0
    for line in data.splitlines(keepends=True):
        body = line.lstrip(b" \t")
        if _PY_DEF_LINE.match(line):
            cuts.append(offset if preamble is None else preamble)
            preamble, decorated = None, False
        elif body.startswith(b"@"):
            preamble = offset if preamble is None else preamble
            decorated = True
        elif body.startswith(b"#"):
            preamble = offset if preamble is None else preamble
        elif not decorated:
            preamble = None  # code or a blank line: what was above is not attached
        offset += len(line)
    return cuts


def _paragraph_cuts(data: bytes, start: int = 0, end: int | None = None) -> list[int]:
    """Offsets where the paragraphs of `data[start:end]` start; the blank lines stay with the
    paragraph before."""
    end = len(data) if end is None else end
    found = (match.end() for match in _PARAGRAPH_END.finditer(data, start, end))
    return [start] + [cut for cut in found if cut < end]


def _grouped_paragraph_cuts(data: bytes, start: int, end: int, limit: int) -> list[int]:
    """Cuts of `data[start:end]` at paragraph starts, grouping consecutive paragraphs while
    a group stays within `limit` bytes (a longer paragraph is a group of its own)."""
    starts = _paragraph_cuts(data, start, end)
    cuts = [start]
    for cut, next_cut in zip(starts[1:], [*starts, end][2:], strict=True):
        if next_cut - cuts[-1] > limit:
            cuts.append(cut)
    return cuts


def _document_cuts(data: bytes, *, python: bool, max_seq_len: int) -> list[int]:
    """Offsets where documents start: Python definitions, long ones cut again into groups
    of paragraphs of up to half `max_seq_len`; blank-line paragraphs for other text."""
    if not python:
        return _paragraph_cuts(data)
    defs = _python_cuts(data) + [len(data)]
    cuts = []
    for start, end in zip(defs[:-1], defs[1:], strict=True):
        if end - start > max_seq_len:
            cuts.extend(_grouped_paragraph_cuts(data, start, end, max(max_seq_len // 2, 1)))
        else:
            cuts.append(start)
    return cuts


def split_document_spans(data: bytes, *, python: bool, max_seq_len: int) -> list[tuple[int, int]]:
    """Cut a file's bytes into `(start, end)` spans that cover it in order, none empty,
    each at most `max_seq_len` long: natural documents, long ones cut into chunks."""
    cuts = _document_cuts(data, python=python, max_seq_len=max_seq_len)
    bounds = sorted(set(cuts) | {len(data)})
    spans = []
    for doc_start, doc_end in zip(bounds[:-1], bounds[1:], strict=True):
        for start in range(doc_start, doc_end, max_seq_len):
            spans.append((start, min(start + max_seq_len, doc_end)))
    return spans


def _text_files_under(folder: Path) -> list[Path]:
    """Text files under `folder`, recursively, skipping hidden and cache folders, sorted."""
    found = []
    for path in folder.rglob("*"):
        parts = path.relative_to(folder).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts):
            continue
        if path.suffix.lower() in TEXT_SUFFIXES and path.is_file():
            found.append(path)
    return sorted(found, key=lambda path: path.relative_to(folder).as_posix())


def _collect_files(inputs: Iterable[PathLike]) -> list[Path]:
    """Expand inputs (files taken as given, folders searched) into unique files, in order."""
    files: list[Path] = []
    seen: set[Path] = set()
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise ValueError(f"input '{path}' does not exist")
        for file in [path] if path.is_file() else _text_files_under(path):
            if file.resolve() not in seen:
                seen.add(file.resolve())
                files.append(file)
    return files


def _check_output_free(output: Path) -> None:
    """Refuse an output that is a file or already holds Parquet data."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"output '{output}' exists and is not a folder")
    if output.is_dir() and any(output.glob("*.parquet")):
        raise ValueError(f"output '{output}' already contains Parquet files; refusing to overwrite")


def _load_spans(files: Sequence[Path], max_seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Read all files into one byte buffer; return it and an (n, 4) array of rows
    `(file index, offset in file, start in buffer, end in buffer)`."""
    buffers, rows, base = [], [], 0
    for index, file in enumerate(files):
        data = file.read_bytes()
        python = file.suffix.lower() == ".py"
        for start, end in split_document_spans(data, python=python, max_seq_len=max_seq_len):
            rows.append((index, start, base + start, base + end))
        buffers.append(data)
        base += len(data)
    corpus = np.frombuffer(b"".join(buffers), dtype=np.uint8)
    return corpus, np.array(rows, dtype=np.int64).reshape(-1, 4)


def _shard_table(
    first_id: int, spans: np.ndarray, corpus: np.ndarray, names: list[str]
) -> pa.Table:
    """Build one shard's table from its rows of `_load_spans` spans, ids from `first_id`."""
    lengths = (spans[:, 3] - spans[:, 2]).astype(np.int32)
    offsets = np.zeros(len(spans) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([corpus[start:end] for start, end in spans[:, 2:4]])
    tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int16)))
    return pa.table({
        "id": pa.array(np.arange(first_id, first_id + len(spans), dtype=np.int64)),
        "tokens": tokens,
        "length": pa.array(lengths),
        "source": pa.array([names[index] for index in spans[:, 0]], type=pa.string()),
        "offset": pa.array(spans[:, 1]),
    })


def prepare(
    inputs: Sequence[PathLike],
    output: PathLike,
    *,
    max_seq_len: int = 256,
    rows_per_shard: int = 20000,
    seed: int = 0,
) -> dict:
    """Turn text files, or folders of them, into shuffled Parquet shards of byte tokens.

    Writes `output/part-NNNNN.parquet` and `output/_prepare.json`, and returns the stats
    written there. Raises ValueError if an input is missing, no text is found, or `output`
    already contains Parquet files.
    """
    if max_seq_len < 1 or rows_per_shard < 1:
        raise ValueError(f"max_seq_len ({max_seq_len}) and rows_per_shard ({rows_per_shard}) "
                         "must both be at least 1")
    out = Path(output)
    _check_output_free(out)
    files = _collect_files(inputs)
    corpus, spans = _load_spans(files, max_seq_len)
    if len(spans) == 0:
        shown = ", ".join(f"'{item}'" for item in inputs) or "(no inputs given)"
        raise ValueError(f"no input text found in {shown}")
    spans = spans[np.random.default_rng(seed).permutation(len(spans))]
    names = [str(file) for file in files]
    out.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(spans), rows_per_shard)
    for shard, first in enumerate(starts):
        table = _shard_table(first, spans[first:first + rows_per_shard], corpus, names)
        pq.write_table(table, out / f"part-{shard:05d}.parquet")
    stats = {
        "rows": len(spans),
        "tokens": int(corpus.size),
        "max_seq_len": max_seq_len,
        "shards": len(starts),
        "source_files": len(files),
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


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


def inspect_dataset(path: str) -> DatasetInfo:
    """Check a folder of Parquet shards (local, or any URI pyarrow.fs understands) and
    count its rows and longest sample from metadata, never reading `tokens`.

    Raises ValueError naming the path if it does not exist, holds no .parquet files, lacks
    the `id`, `tokens` or `length` columns, has a non-integer `length`, or has no rows.
    """
    fs, root = _resolve_dataset_path(str(path))
    files = _list_parquet_files(fs, root, str(path))
    rows, max_length = 0, 0
    for file in files:
        with fs.open_input_file(file) as handle:
            parquet = pq.ParquetFile(handle)
            _check_schema(parquet.schema_arrow, file)
            rows += parquet.metadata.num_rows
            max_length = max(max_length, _max_length(parquet))
    if rows == 0:
        raise ValueError(f"dataset '{path}' is empty: its Parquet files hold no rows")
    return DatasetInfo(path=root, filesystem=fs, files=files, rows=rows, max_length=max_length)
