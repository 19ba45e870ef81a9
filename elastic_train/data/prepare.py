"""Turn text into Parquet shards of tokens, and check such shards.

A prepared dataset is a folder of `part-NNNNN.parquet` files with the columns
`id` (int64, unique, 0..N-1), `tokens` (list<int16>, or list<int32> when the tokenizer's ids do
not fit int16), `length` (int32), plus `source` (the input file a row came from), `offset`
(where the row starts in that file's token stream: its documents' tokens in order, each with
the tokenizer's EOS after it; for bytes without a tokenizer, the byte offset in the file), so
that every token of the input can be traced to exactly one row, and `doc` (int64: the number of
the document the row was cut from, in input order). When some records are fine-tuning examples
(prompt/response or messages: `sft.py`), a `loss_mask` column too (list<int8>, 1 on target
tokens; all 1 on plain-text rows), and `_prepare.json` counts the examples under `sft`.
Beside the shards, `_prepare.json` records the counts, the tokenizer ({kind, vocab_size,
eos_id, pad_id}), `max_token_id` and `max_seq_len`, and `tokenizer/` holds
a copy of the tokenizer (absent for bytes).

With `eval_fraction` F > 0 the documents whose salted hash falls below F go, all their rows,
into `eval/` instead, a prepared data set of its own (shards, `_prepare.json`, tokenizer copy)
with ids N.. after the training rows' 0..N-1; the training set's `_prepare.json` records the
split under `eval` (`heldout.py`), and training evaluates on it.

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
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data.dataset import (
    INT16_MAX,
    PENDING_FILE,
    STATS_FILE,
    TOKENIZER_DIR,
    _resolve_dataset_path,
    pending_marker,
)
from elastic_train.data.heldout import (
    EVAL_DIR,
    check_fraction,
    held_documents,
    row_ids,
    split_record,
)
from elastic_train.data.rowgroups import auto_rows_per_block
from elastic_train.data.sft import RecordFields
from elastic_train.data.sources import (
    PathLike,
    collect_input_files,
    gather_rows,
    no_text_message,
    warn_skipped,
)
from elastic_train.data.tokenizer import Tokenizer, load_tokenizer

DEFAULT_CORPUS_BYTES = 4_000_000
# Part of the default corpus's cache folder name: bump it whenever the files chosen, the way
# they are cut or what `_prepare.json` records changes, so that a corpus cached by an older
# version is not reused.
CORPUS_FORMAT = 5
# What `prepare` and `prepare_ray` take for text when an argument is not given (the CLI's own
# defaults: --max-seq-len 512, --eval-fraction 0.03).
PREPARE_DEFAULTS = {"max_seq_len": 256, "seed": 0, "eval_fraction": 0.0}
# Rows of the default corpus when data.max_seq_len is unset (then it is taken from the corpus).
DEFAULT_CORPUS_SEQ_LEN = 512
# Documents of the default corpus held out in its `eval/` (the default config's eval.fraction).
DEFAULT_CORPUS_EVAL_FRACTION = 0.03
# Folders of the standard library left out of the default corpus: tests, GUI code, vendored
# or generated data tables, and third-party packages that happen to live next to it.
STDLIB_EXCLUDED_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "tkinter",
    "turtledemo", "ensurepip", "pydoc_data", "encodings", "lib-dynload", "__pycache__",
    "__phello__", "venv",
})
logger = logging.getLogger("elastic_train.prepare")


def _shard_table(first_id: int, spans: np.ndarray, values: np.ndarray, names: list[str],
                 token_type: np.dtype, mask: np.ndarray | None = None) -> pa.Table:
    """Build one shard's table from its rows of `gather_rows` spans, ids from `first_id` (with
    a `loss_mask` column when `mask`, aligned with `values`, is given)."""
    lengths = (spans[:, 3] - spans[:, 2]).astype(np.int32)
    offsets = np.zeros(len(spans) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([values[start:end] for start, end in spans[:, 2:4]])
    table = pa.table({
        "id": pa.array(np.arange(first_id, first_id + len(spans), dtype=np.int64)),
        "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens.astype(token_type))),
        "length": pa.array(lengths),
        "source": pa.array([names[index] for index in spans[:, 0]], type=pa.string()),
        "offset": pa.array(spans[:, 1]),
        "doc": pa.array(spans[:, 4]),
    })
    if mask is None:
        return table
    flat = np.concatenate([mask[start:end] for start, end in spans[:, 2:4]])
    return table.append_column("loss_mask", pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(flat.astype(np.int8))))


def _write_folder(folder: Path, spans: np.ndarray, values: np.ndarray, *, first_id: int,
                  names: list[str], token_type: np.dtype, rows_per_shard: int,
                  rows_per_block: int, mask: np.ndarray | None = None) -> dict:
    """Write rows `spans` (in id order, ids from `first_id`) as `folder/part-NNNNN.parquet`;
    the counts `_prepare.json` records of them."""
    folder.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(spans), rows_per_shard)
    tokens, max_token_id = 0, 0
    for shard, first in enumerate(starts):
        table = _shard_table(first_id + first, spans[first:first + rows_per_shard], values, names,
                             token_type, mask)
        pq.write_table(table, folder / f"part-{shard:05d}.parquet", row_group_size=rows_per_block)
        flat = table.column("tokens").combine_chunks().values.to_numpy()
        tokens += len(flat)
        max_token_id = max(max_token_id, int(flat.max()) if len(flat) else 0)
    return {"rows": len(spans), "tokens": tokens, "shards": len(starts),
            "max_token_id": max_token_id}


def folder_stats(counts: dict, *, max_seq_len: int, source_files: int, skipped: int,
                 tokenizer: Tokenizer, token_type: np.dtype, rows_per_block: int,
                 sft: dict | None = None) -> dict:
    """The `_prepare.json` of one prepared folder (both engines write it); `sft`: the
    fine-tuning examples' counts, when there were any."""
    stats = {**counts, "max_seq_len": max_seq_len, "source_files": source_files,
             "skipped_binary_files": skipped, "tokenizer": _tokenizer_record(tokenizer),
             "token_type": token_type.name, "rows_per_block": rows_per_block}
    return {**stats, "sft": sft} if sft else stats


def _tokenizer_record(tokenizer: Tokenizer) -> dict:
    """The `tokenizer` section of `_prepare.json` (`bos_id` only when it has one: the records
    of the others, and so their data hashes, are those earlier versions wrote)."""
    record = {"kind": tokenizer.kind, "vocab_size": int(tokenizer.vocab_size),
              "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}
    return record if tokenizer.bos_id is None else {**record, "bos_id": tokenizer.bos_id}


def prepare(
    inputs: Sequence[PathLike],
    output: PathLike,
    *,
    max_seq_len: int | None = None,
    rows_per_shard: int = 20000,
    rows_per_block: int | None = None,
    seed: int | None = None,
    tokenizer: Tokenizer | PathLike | None = None,
    text_field: str = "text",
    eval_fraction: float | None = None,
    prompt_field: str = "prompt",
    response_field: str = "response",
) -> dict:
    """Turn text files, JSONL and Parquet files, or folders of them, into shuffled Parquet
    shards of tokens (a folder of Parquet that is tokenized already, with id/tokens/length and
    no text column, is only re-chunked into `rows_per_block`-row groups: `rechunk.py`; None:
    `auto_rows_per_block` of the rows, the same for the held-out set): UTF-8
    bytes, or `tokenizer`'s (a Tokenizer, or a path `load_tokenizer`
    loads) with its EOS after each document. `text_field` names the text of JSONL/Parquet;
    records holding `prompt_field` and `response_field`, or `messages`, are fine-tuning
    examples (`sft.py`: one row each, with a `loss_mask`).
    `eval_fraction`: the share of documents held out, all their rows, into `output/eval/`, a
    prepared data set of its own (`heldout.py`).

    Writes `output/tokenizer/` (unless bytes), `output/part-NNNNN.parquet`, the held-out set,
    then `output/_prepare.json` (last: its presence means the whole is written), and returns
    the stats written there. Text files that look binary are skipped with a warning that counts
    them. Raises ValueError naming the culprit if the tokenizer does not load, an input is
    missing or malformed, no text is found, `output` is empty, already holds files of a prepare
    (`refuse_leftovers`), is an input or nests with one (`check_output_apart`), or when a
    re-chunk is asked options it does not honour (`rechunk.check_rechunk`).
    """
    _check_arguments(max_seq_len, rows_per_shard, rows_per_block, seed, eval_fraction)
    if not str(output).strip():
        raise ValueError("--output: an empty path")
    if "://" in str(output):  # a store: prepared into a local folder, then uploaded whole
        fs, root = store_output(str(output))
        with tempfile.TemporaryDirectory(prefix="elastic_train-prepare-") as scratch:
            stats = prepare(inputs, Path(scratch) / "out", max_seq_len=max_seq_len,
                            rows_per_shard=rows_per_shard, rows_per_block=rows_per_block,
                            seed=seed, tokenizer=tokenizer, text_field=text_field,
                            eval_fraction=eval_fraction, prompt_field=prompt_field,
                            response_field=response_field)
            upload_prepared(Path(scratch) / "out", fs, root, str(output))
        return stats
    out = Path(output)
    _check_output_free(out)
    check_output_apart(inputs, out)
    from elastic_train.data.rechunk import check_rechunk, is_token_dataset, rechunk

    if is_token_dataset(inputs, text_field):  # tokenized already: only new row groups
        check_rechunk(inputs[0], tokenizer=tokenizer, seed=seed, max_seq_len=max_seq_len,
                      eval_fraction=eval_fraction)
        return rechunk(inputs[0], out, rows_per_block)
    max_seq_len, seed, eval_fraction = with_defaults(max_seq_len, seed, eval_fraction)
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    skipped: list[tuple[Path, str]] = []
    files = collect_input_files(inputs, skipped)
    fields = RecordFields(text=text_field, prompt=prompt_field, response=response_field)
    values, spans, mask, sft = gather_rows(files, tokenizer, max_seq_len, fields)
    if len(spans) == 0:
        raise ValueError(no_text_message(inputs, skipped, sft, max_seq_len))
    warn_skipped(skipped)
    rows_per_block = rows_per_block or auto_rows_per_block(len(spans))
    held = held_documents(int(spans[-1, 4]) + 1, eval_fraction, seed)
    ids, train_rows = row_ids(held[spans[:, 4]], seed)
    order = np.empty_like(ids)
    order[ids] = np.arange(len(ids))
    spans = spans[order]  # in id order: training rows, then held-out rows
    widest = max(int(tokenizer.vocab_size) - 1, int(values.max()))
    token_type = np.dtype(np.int16 if widest <= INT16_MAX else np.int32)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"output '{out}' cannot be created: {exc.strerror or exc}") from None
    common = {"max_seq_len": max_seq_len, "source_files": len(files), "skipped": len(skipped),
              "tokenizer": tokenizer, "token_type": token_type, "rows_per_block": rows_per_block,
              "sft": sft.record() if sft.examples else None}
    write = {"names": [str(file) for file in files], "token_type": token_type,
             "rows_per_shard": rows_per_shard, "rows_per_block": rows_per_block, "mask": mask}
    with pending_marker(pafs.LocalFileSystem(), str(out)):
        for folder in [out, out / EVAL_DIR] if held.any() else [out]:
            if tokenizer.kind != "bytes":
                tokenizer.save(folder / TOKENIZER_DIR)
        stats = folder_stats(_write_folder(out, spans[:train_rows], values, first_id=0, **write),
                             **common)
        if held.any():
            counts = _write_folder(out / EVAL_DIR, spans[train_rows:], values,
                                   first_id=train_rows, **write)
            eval_stats = {**folder_stats(counts, **common),
                          "held_out": {"fraction": eval_fraction}}
            (out / EVAL_DIR / STATS_FILE).write_text(
                json.dumps(eval_stats, indent=2, sort_keys=True) + "\n")
            stats["eval"] = split_record(eval_fraction, int(held.sum()), counts["rows"],
                                         counts["tokens"])
        (out / STATS_FILE).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
    return stats


def with_defaults(max_seq_len: int | None, seed: int | None,
                  eval_fraction: float | None) -> tuple[int, int, float]:
    """Text to tokenize: the arguments, `PREPARE_DEFAULTS` where not given (None). A re-chunk
    takes only what was given (`rechunk.check_rechunk` refuses what it cannot honour)."""
    given = {"max_seq_len": max_seq_len, "seed": seed, "eval_fraction": eval_fraction}
    return tuple(PREPARE_DEFAULTS[k] if v is None else v for k, v in given.items())


def _check_arguments(max_seq_len: int | None, rows_per_shard: int, rows_per_block: int | None,
                     seed: int | None, eval_fraction: float | None) -> None:
    """ValueError naming the argument that cannot be used (both engines check these; None:
    not given)."""
    if rows_per_block is not None and rows_per_block < 1:
        raise ValueError(f"rows_per_block must be at least 1, got {rows_per_block}")
    if (max_seq_len is not None and max_seq_len < 1) or rows_per_shard < 1:
        raise ValueError(f"max_seq_len ({max_seq_len}) and rows_per_shard ({rows_per_shard}) "
                         "must both be at least 1")
    if seed is not None and seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    if eval_fraction is not None:
        check_fraction(eval_fraction)


def _check_output_free(output: Path) -> None:
    """Refuse an output that is a file or already holds what a prepare writes."""
    if output.exists() and not output.is_dir():
        raise ValueError(f"output '{output}' exists and is not a folder")
    if output.is_dir():
        refuse_leftovers(str(output), [entry.name for entry in output.iterdir()])


def store_output(shown: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) of output URI `shown`, refused (ValueError) as `_check_output_free`
    refuses a local one: a file, or a folder holding what a prepare writes."""
    fs, root = _resolve_dataset_path(shown)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        raise ValueError(f"output '{shown}' exists and is not a folder")
    if info.type == pafs.FileType.Directory:
        refuse_leftovers(shown, [entry.base_name for entry in
                                 fs.get_file_info(pafs.FileSelector(root, recursive=False))])
    return fs, root


def upload_prepared(local: Path, fs: pafs.FileSystem, root: str, shown: str) -> None:
    """A prepared folder `local` uploaded to `root` in `fs` (output URI `shown`): under
    `pending_marker`, `_prepare.json` last, so that an upload cut short is refused as an
    unfinished prepare rather than read as a data set of fewer shards."""
    files = sorted((path for path in local.rglob("*") if path.is_file()),
                   key=lambda path: (path == local / STATS_FILE, str(path)))
    try:
        fs.create_dir(root, recursive=True)
        with pending_marker(fs, root):
            for path in files:
                target = f"{root}/{path.relative_to(local).as_posix()}"
                fs.create_dir(target.rpartition("/")[0], recursive=True)
                with open(path, "rb") as source, fs.open_output_stream(target) as sink:
                    shutil.copyfileobj(source, sink, 1 << 20)
    except OSError as exc:
        raise ValueError(f"output '{shown}': the upload failed ({' '.join(str(exc).split())}); "
                         "what it left is marked unfinished: empty it and prepare again") from None


def refuse_leftovers(shown: str, names: Iterable[str]) -> None:
    """Refuse an output folder whose entries (`names`) include what a prepare writes: shards
    (*.parquet), `eval/`, `tokenizer/`, `_prepare.json`. Any of them left by an earlier prepare
    would be read with the new shards (another corpus's held-out rows, a stale tokenizer), and
    nothing a user saved is deleted here: they say how to go on."""
    found = sorted(f"{name}/" if name in (EVAL_DIR, TOKENIZER_DIR) else name for name in names
                   if name.endswith(".parquet")
                   or name in (EVAL_DIR, TOKENIZER_DIR, STATS_FILE, PENDING_FILE))
    if not found:
        return
    what = ("Parquet files" if any(name.endswith(".parquet") for name in found)
            else "files an earlier prepare wrote")
    listed = ", ".join(found[:4]) + (", ..." if len(found) > 4 else "")
    raise ValueError(f"output '{shown}' already contains {what} ({listed}); refusing to "
                     "overwrite them or mix an earlier prepare's data with new: empty it or "
                     "give another --output")


def check_output_apart(inputs: Sequence[PathLike], output: Path) -> None:
    """Refuse an output that is an input, lies inside an input folder, or holds an input: the
    shards would land among the inputs, and a later prepare of that folder would take them for
    its input (re-chunking them, ignoring the text beside them)."""
    out = output.expanduser().resolve()
    for item in inputs:
        if not str(item).strip():
            continue  # collect_input_files names it
        path = Path(item).expanduser().resolve()
        if out == path or path in out.parents or out in path.parents:
            how = "is" if out == path else ("lies inside" if path in out.parents else "holds")
            raise ValueError(f"--output '{output}' {how} input '{item}': the shards would be "
                             "mixed with the inputs; give an --output outside every input")


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


def default_corpus_dir(max_seq_len: int | None = None, cache_root: PathLike | None = None) -> Path:
    """The embedded default corpus, prepared once from standard library source and cached, with
    `DEFAULT_CORPUS_EVAL_FRACTION` of its documents held out in `eval/` (the default config's
    eval.fraction); rows of at most `max_seq_len` tokens (None: `DEFAULT_CORPUS_SEQ_LEN`).

    The cache folder is `<root>/stdlib-<max_seq_len>-<python version>-v<CORPUS_FORMAT>`, root
    `cache_root`, else $ELASTIC_TRAIN_CACHE, else ~/.cache/elastic_train. It is prepared in a
    temporary folder next to it and renamed into place, so it is either whole or absent;
    when concurrent processes race, the first rename wins and the others use its result.
    """
    max_seq_len = max_seq_len or DEFAULT_CORPUS_SEQ_LEN
    root = Path(cache_root or os.environ.get("ELASTIC_TRAIN_CACHE")
                or Path.home() / ".cache" / "elastic_train").expanduser()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    final = root / f"stdlib-{max_seq_len}-{version}-v{CORPUS_FORMAT}"
    if (final / STATS_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        prepare(stdlib_source_files(), scratch, max_seq_len=max_seq_len,
                eval_fraction=DEFAULT_CORPUS_EVAL_FRACTION)
        os.rename(scratch, final)
    except OSError as exc:
        if not (final / STATS_FILE).is_file():
            raise ValueError(f"could not create the default corpus at '{final}': {exc}") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final
