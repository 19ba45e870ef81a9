"""Reading `prepare`'s inputs into rows of tokens: which files, how text files are cut into
documents, the texts of JSONL and Parquet records, and `gather_rows`, which tokenizes them.

Inputs are files or folders. A folder is searched recursively (hidden and cache folders
skipped) for text files (`TEXT_SUFFIXES`) and record files (`.jsonl`, `.parquet`). A file named
directly is taken whatever its suffix. A text file that looks binary (a NUL byte, or not UTF-8,
in its first 8 KiB: a `.so` or `.png` named directly, say) is skipped, and counted so that the
caller can say so. An empty path (which would mean the current folder) is refused. A text file
of only whitespace gives no rows, like an empty one.

Text files are cut at natural boundaries: in Python source every def, async def and class, at
any indentation, starts a document (with the decorators and comments directly above it), and
one longer than a row is cut again at blank lines into groups of paragraphs of up to half a
row; other text is cut into blank-line paragraphs. What is still longer than a row is split
into chunks of a row. A JSONL line or Parquet row is one document: its text is the field
`text_field` (a null or empty text is skipped), or, when it holds prompt and response fields or
a messages list (not null), a fine-tuning example: one row with a loss mask (`sft.py`); one file
may hold both kinds, row by row. JSONL is read line
by line and Parquet in batches of `PARQUET_BATCH_ROWS`.

With a tokenizer that has an EOS, it follows each document; a Python definition cut into
paragraph groups gets one, after its last group. Without a tokenizer, text files keep
exactly the byte spans of `split_document_spans`.

Every row also carries the number of the document it was cut from (`gather_rows`): documents
counted in input order, so that both prepare engines give the same numbers and a held-out split
can take whole documents (`heldout.py`).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from elastic_train.data.sft import (
    Example,
    RecordFields,
    SftCounts,
    as_fields,
    encode_example,
    record_item,
)
from elastic_train.data.tokenizer import Tokenizer

TEXT_SUFFIXES = frozenset({".txt", ".py", ".md", ".rst"})
RECORD_SUFFIXES = frozenset({".jsonl", ".parquet"})
PARQUET_BATCH_ROWS = 1024  # records read from a Parquet input at a time
_SNIFF_BYTES = 8192
ENCODE_BATCH_RECORDS = 256  # JSONL/Parquet records tokenized in one call

# A Python definition line, at any indentation: `def name(`, `async def name(`, `class name`
# followed by `(`, `[` or `:` (the name check keeps most prose in docstrings out).
_PY_DEF_LINE = re.compile(
    rb"[ \t]*(?:(?:async[ \t]+)?def[ \t]+\w+[ \t]*[(\[]|class[ \t]+\w+[ \t]*[(\[:])")
# A paragraph ends after two or more newlines (blank lines may hold spaces).
_PARAGRAPH_END = re.compile(rb"\n(?:[ \t\r\f\v]*\n)+")

PathLike = str | os.PathLike


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


def _natural_bounds(data: bytes, *, python: bool) -> list[int]:
    """Sorted offsets of the natural documents' starts, and `len(data)` last."""
    cuts = _python_cuts(data) if python else _paragraph_cuts(data)
    return sorted(set(cuts) | {len(data)})


def document_spans(data: bytes, *, python: bool, max_seq_len: int) -> list[list[tuple[int, int]]]:
    """A file's natural documents, each as the `(start, end)` spans of its rows: every span
    non-empty and at most `max_seq_len` long, together covering the file in order. A Python
    definition longer than a row is cut at blank lines into paragraph groups of up to half a row
    first; what is still longer is cut into chunks."""
    bounds = _natural_bounds(data, python=python)
    documents = []
    for doc_start, doc_end in zip(bounds[:-1], bounds[1:], strict=True):
        cuts = [doc_start]
        if python and doc_end - doc_start > max_seq_len:
            cuts = _grouped_paragraph_cuts(data, doc_start, doc_end, max(max_seq_len // 2, 1))
        cuts.append(doc_end)
        documents.append([(start, min(start + max_seq_len, end))
                          for first, end in zip(cuts[:-1], cuts[1:], strict=True)
                          for start in range(first, end, max_seq_len)])
    return documents


def split_document_spans(data: bytes, *, python: bool, max_seq_len: int) -> list[tuple[int, int]]:
    """Cut a file's bytes into `(start, end)` spans that cover it in order, none empty,
    each at most `max_seq_len` long: natural documents, long ones cut into chunks."""
    return [span for document in document_spans(data, python=python, max_seq_len=max_seq_len)
            for span in document]


def chunk_rows(ids: np.ndarray, max_seq_len: int) -> list[np.ndarray]:
    """`ids` cut into consecutive rows of at most `max_seq_len`."""
    return [ids[start:start + max_seq_len] for start in range(0, len(ids), max_seq_len)]


def tokenized_file_documents(
    data: bytes, *, python: bool, encode: Callable[[bytes], np.ndarray],
    eos_id: int | None, max_seq_len: int, bos_id: int | None = None,
) -> Iterator[list[np.ndarray]]:
    """The rows of a text file for a tokenizer, one list per natural document, in order: each
    document is tokenized with `encode`, `bos_id` put before it and `eos_id` appended; a
    Python one longer than a row is cut again at blank lines into paragraph groups of about
    half a row (bytes per token measured on it), only its first group getting the BOS and its
    last the EOS; what is still longer is cut into chunks. A document that encodes to nothing
    gives no list."""
    eos = np.array([] if eos_id is None else [eos_id], dtype=np.int64)
    bos = np.array([] if bos_id is None else [bos_id], dtype=np.int64)
    bounds = _natural_bounds(data, python=python)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        ids = encode(data[start:end])
        if len(ids) == 0:
            continue
        if not python or len(bos) + len(ids) + len(eos) <= max_seq_len:
            yield chunk_rows(np.concatenate([bos, ids, eos]).astype(ids.dtype), max_seq_len)
            continue
        limit = max((max_seq_len // 2) * (end - start) // len(ids), 1)
        groups = _grouped_paragraph_cuts(data, start, end, limit) + [end]
        rows = []
        for group_start, group_end in zip(groups[:-1], groups[1:], strict=True):
            piece = encode(data[group_start:group_end])
            piece = np.concatenate([bos if group_start == start else bos[:0], piece,
                                    eos if group_end == end else eos[:0]]).astype(piece.dtype)
            rows.extend(chunk_rows(piece, max_seq_len))
        yield rows


def tokenized_file_rows(
    data: bytes, *, python: bool, encode: Callable[[bytes], np.ndarray],
    eos_id: int | None, max_seq_len: int,
) -> Iterator[np.ndarray]:
    """The rows of `tokenized_file_documents`, one after another.

    With byte tokens and no EOS these are exactly the spans of `split_document_spans`."""
    for rows in tokenized_file_documents(data, python=python, encode=encode, eos_id=eos_id,
                                         max_seq_len=max_seq_len):
        yield from rows


def _looks_binary(path: Path) -> str | None:
    """Why the start of `path` does not look like text (a NUL byte, or not UTF-8), or None."""
    with open(path, "rb") as handle:
        head = handle.read(_SNIFF_BYTES)
    if b"\x00" in head:
        return "it holds NUL bytes"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not merely a character cut by the sniff's end
            return f"it is not UTF-8 text (byte {exc.start})"
    return None


def files_under(folder: Path) -> list[Path]:
    """Text and record files under `folder`, recursively, skipping hidden and cache folders,
    sorted by relative path."""
    found = []
    for path in folder.rglob("*"):
        parts = path.relative_to(folder).parts
        if any(part.startswith(".") or part == "__pycache__" for part in parts):
            continue
        suffix = path.suffix.lower()
        if (suffix in TEXT_SUFFIXES or suffix in RECORD_SUFFIXES) and path.is_file():
            found.append(path)
    return sorted(found, key=lambda path: path.relative_to(folder).as_posix())


def collect_input_files(inputs: Iterable[PathLike],
                        skipped: list[tuple[Path, str]] | None = None) -> list[Path]:
    """Expand inputs (files taken as given, folders searched) into unique files, in order.
    Text files that look binary are left out, and appended to `skipped` with the reason.

    Raises ValueError naming the input for an empty path or a missing one."""
    files: list[Path] = []
    seen: set[Path] = set()
    for item in inputs:
        if not str(item).strip():
            raise ValueError(f"input '{item}' is an empty path (give '.' for the current folder)")
        if "://" in str(item):  # Path would make it a local 's3:/...', then "does not exist"
            raise ValueError(f"input '{item}': prepare reads local files and folders; copy it "
                             "to one first (the output may be a URI)")
        path = Path(item)
        if not path.exists():
            raise ValueError(f"input '{path}' does not exist")
        for file in [path] if path.is_file() else files_under(path):
            if file.resolve() in seen:
                continue
            seen.add(file.resolve())
            why = None if file.suffix.lower() in RECORD_SUFFIXES else _looks_binary(file)
            if why:
                if skipped is not None:
                    skipped.append((file, why))
                continue
            files.append(file)
    return files


Item = str | Example  # what a record holds: plain text, or a fine-tuning example


def _jsonl_item(line: str, where: str, fields: RecordFields) -> Item | None:
    """The content of one JSONL line (`sft.record_item`), None for a null; ValueError naming
    `where` (file:line)."""
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(record, dict):
        raise ValueError(f"{where} is not a JSON object (it is {type(record).__name__})")
    return record_item(record, where, fields)


def iter_jsonl_records(path: Path, fields: RecordFields | str) -> Iterator[Item]:
    """The non-empty texts and the examples of a JSONL file's records, in order (blank lines
    skipped)."""
    fields = as_fields(fields)
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                item = _jsonl_item(line, f"'{path}' line {number}", fields)
                if item:
                    yield item


def parquet_columns(schema: pa.Schema, fields: RecordFields, shown: str) -> list[str]:
    """The columns a Parquet input is read from: each of prompt and response (both), messages and
    the text column it has, so that a row that is not an example is read as text (`record_item`);
    ValueError naming `shown` when it has none of them, or only a text column of another type."""
    names = schema.names
    pair = [fields.prompt, fields.response] if {fields.prompt, fields.response} <= set(names) else []
    columns = pair + [name for name in (fields.messages, fields.text) if name in names]
    if not columns:
        raise ValueError(f"input '{shown}' has no column '{fields.text}' (--text-field), nor "
                         f"'{fields.prompt}' and '{fields.response}', nor '{fields.messages}'; "
                         f"it has: {', '.join(names)}")
    kind = schema.field(fields.text).type if fields.text in names else pa.string()
    if columns == [fields.text] and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"input '{shown}': column '{fields.text}' holds {kind}, not text")
    return columns


def parquet_batch_items(batch: pa.RecordBatch, fields: RecordFields, shown: str,
                        first_row: int = 0) -> Iterator[Item]:
    """The non-empty texts and the examples of one batch of `parquet_columns`, its first row
    being row `first_row` of the file (errors name the row, counted from 0)."""
    names = batch.schema.names
    for number, values in enumerate(zip(*(column.to_pylist() for column in batch.columns),
                                        strict=True), start=first_row):
        if len(names) == 1 and names[0] == fields.text:
            item: Item | None = values[0]
        else:
            item = record_item(dict(zip(names, values, strict=True)),
                               f"'{shown}' row {number}", fields)
        if item:
            yield item


def iter_parquet_records(path: Path, fields: RecordFields | str) -> Iterator[Item]:
    """The non-empty texts and the examples of a Parquet file, read in batches."""
    fields = as_fields(fields)
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"input '{path}' is not a readable Parquet file: {exc}") from exc
    columns = parquet_columns(parquet.schema_arrow, fields, str(path))
    first_row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        yield from parquet_batch_items(batch, fields, str(path), first_row)
        first_row += batch.num_rows


Row = np.ndarray | tuple[np.ndarray, np.ndarray]  # tokens, or (tokens, loss_mask)


class Gathered(NamedTuple):
    """The rows of some inputs: token values, an (n, 5) array of rows `(file index, offset in
    the file's token stream, start in values, end in values, document)`, the loss mask aligned
    with the values (None when no row came from a fine-tuning example; 1 on every token of a
    plain-text row otherwise) and the fine-tuning examples' counts."""

    values: np.ndarray
    spans: np.ndarray
    mask: np.ndarray | None
    sft: SftCounts


class _RowBuffer:
    """Rows as they are made: token values gathered into a few large arrays, and per row
    (source index, offset in the source's token stream, start, end in the values, document),
    and the loss masks of the rows that have one."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self._pending: list[np.ndarray] = []
        self._meta = array("q")
        self._size = 0
        self._source, self._offset = -1, 0
        self._masks: list[tuple[int, np.ndarray]] = []  # (start in values, mask)
        self.sft = SftCounts()

    def add(self, source: int, ids: Row, doc: int = 0) -> None:
        """One row of `source`'s, right after the previous one of that source, cut from
        document `doc` (a fine-tuning row comes with its loss mask)."""
        if isinstance(ids, tuple):
            ids, mask = ids
            self._masks.append((self._size, mask))
        if source != self._source:
            self._source, self._offset = source, 0
        self._meta.extend((source, self._offset, self._size, self._size + len(ids), doc))
        self._pending.append(ids)
        self._size += len(ids)
        self._offset += len(ids)
        if len(self._pending) >= 4096:
            self._chunks.append(np.concatenate(self._pending))
            self._pending = []

    def add_documents(self, source: int, documents: Iterable[list[Row]], first_doc: int
                      ) -> int:
        """The rows of `source`'s documents, numbered from `first_doc` on (a document without
        rows takes no number); returns the next number."""
        doc = first_doc
        for rows in documents:
            for ids in rows:
                self.add(source, ids, doc)
            doc += bool(rows)
        return doc

    def finish(self) -> Gathered:
        """All token values in one array, the (rows, 5) array of row metadata, the loss mask."""
        parts = self._chunks + self._pending
        values = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        mask = None
        if self._masks:
            mask = np.ones(len(values), dtype=np.int8)
            for start, row_mask in self._masks:
                mask[start:start + len(row_mask)] = row_mask
        return Gathered(values, np.array(self._meta, dtype=np.int64).reshape(-1, 5), mask,
                        self.sft)


def _text_file_documents(file: Path, tokenizer: Tokenizer, max_seq_len: int
                         ) -> Iterator[list[np.ndarray]]:
    """The rows of a text file, one list per document: its bytes, or its documents' tokens
    with the EOS after each."""
    data = file.read_bytes()
    if not data.strip():  # only whitespace: nothing to learn from, like an empty file
        return
    python = file.suffix.lower() == ".py"
    if tokenizer.kind == "bytes":
        buffer = np.frombuffer(data, dtype=np.uint8)
        for spans in document_spans(data, python=python, max_seq_len=max_seq_len):
            yield [buffer[start:end] for start, end in spans]
        return

    def encode(text: bytes) -> np.ndarray:
        return np.asarray(tokenizer.encode(text.decode("utf-8", errors="replace")), np.int32)

    yield from tokenized_file_documents(data, python=python, encode=encode,
                                        eos_id=tokenizer.eos_id, max_seq_len=max_seq_len,
                                        bos_id=tokenizer.bos_id)


def _record_documents(items: Iterable[Item], tokenizer: Tokenizer, max_seq_len: int,
                      sft: SftCounts) -> Iterator[list[Row]]:
    """The rows of JSONL/Parquet records, one list per record: a text's tokens (UTF-8 bytes
    without a tokenizer), the BOS of a tokenizer that has one before them and the EOS after,
    cut into chunks of `max_seq_len`; a fine-tuning example's one row with its loss mask (none
    when it is dropped: `sft.TRUNCATION_RULE`), counted in `sft`."""
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    records = iter(items)
    while batch := list(itertools.islice(records, ENCODE_BATCH_RECORDS)):
        texts = [item for item in batch if isinstance(item, str)]
        if tokenizer.kind == "bytes":
            encoded = iter([np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts])
        else:
            encoded = iter([np.asarray(bos + ids + eos, dtype=np.int32) if ids else None
                            for ids in tokenizer.encode_batch(texts)])
        for item in batch:
            if isinstance(item, str):
                ids = next(encoded)
                if ids is not None:
                    yield chunk_rows(ids, max_seq_len)
                continue
            row = encode_example(item, tokenizer, max_seq_len, sft)
            yield [] if row is None else [row]


def gather_rows(files: Sequence[Path], tokenizer: Tokenizer, max_seq_len: int,
                fields: RecordFields | str) -> Gathered:
    """All rows of all files (`Gathered`). Documents are numbered in input order: files in the
    order given, documents in file order (a text file's Python definitions or paragraphs, a
    JSONL or Parquet file's records), counting only those that gave rows."""
    rows = _RowBuffer()
    doc = 0
    for index, file in enumerate(files):
        suffix = file.suffix.lower()
        if suffix == ".jsonl":
            made = _record_documents(iter_jsonl_records(file, fields), tokenizer, max_seq_len,
                                     rows.sft)
        elif suffix == ".parquet":
            made = _record_documents(iter_parquet_records(file, fields), tokenizer, max_seq_len,
                                     rows.sft)
        else:
            made = _text_file_documents(file, tokenizer, max_seq_len)
        doc = rows.add_documents(index, made, doc)
    return rows.finish()


def no_text_message(inputs, skipped: list, sft: SftCounts | None = None,
                    max_seq_len: int = 0) -> str:
    """The error for inputs that held no text (counting the binary files skipped), or whose
    every fine-tuning example was dropped (`sft`: saying why)."""
    if sft is not None and sft.examples and sft.dropped == sft.examples:
        return sft.dropped_all(max_seq_len)
    shown = ", ".join(f"'{item}'" for item in inputs) or "(no inputs given)"
    extra = (f" (skipped {len(skipped)} binary file(s), not text: {_named(skipped)}; text must "
             "be UTF-8: convert other encodings first, e.g. iconv -f latin1 -t utf-8)"
             if skipped else "")
    return f"no input text found in {shown}{extra}"


def _named(skipped: list) -> str:
    """The first three skipped files, each with why."""
    return ", ".join(f"'{file}' ({why})" for file, why in skipped[:3]) + (
        ", ..." if len(skipped) > 3 else "")


def warn_skipped(skipped: list) -> None:
    """One warning that counts the binary files skipped, naming the first three."""
    if skipped:
        logging.getLogger("elastic_train.prepare").warning(
            "skipped %d binary file(s), not text: %s", len(skipped), _named(skipped))
