"""`prepare` as a Ray Data pipeline: every CPU of a cluster tokenizes, and the shards written are
exactly those of the single-process `prepare.prepare` for the same inputs and arguments.

Why exactly the same: a data set's sample ids, rows and shard layout must not depend on how it
was made (how many CPUs, which engine, which run). The single-process version gathers the rows of
all files in input order, numbers their documents in that order, holds out the documents
`heldout.held_documents` picks (none without --eval-fraction), permutes the training rows with
`numpy.random.default_rng(seed).permutation(N)` (and the held-out rows alike, numbered after them:
`heldout.row_ids`) and writes them in that order, `rows_per_shard` to a shard, the id of a row
being its position. Here:

1. The driver validates everything it can before any Ray task (arguments, the output, the inputs
   through `sources.collect_input_files`, the tokenizer, which it loads once), and lists the input
   files in that same order, cut into pieces: a file is one piece, but a JSONL or Parquet file
   larger than `PIECE_BYTES` is cut into consecutive pieces of whole lines or whole row groups.
2. Tokenize (`map_batches`): each task takes a few consecutive pieces (grouped by size, only to
   balance the tasks: the grouping changes nothing in the output) and turns each into its rows
   with `sources.gather_rows([file])`, the function the single-process version runs on all files
   (for a slice, with the same `sources` helpers on its records): the rows are those it makes for
   that file. Each row carries (piece, row index in piece, offset in the piece's token stream,
   document number in the piece). The result is materialized in the object store.
3. The driver gathers the row and token counts and the rows of each document per piece (one
   small record per piece and block), so row `r` of piece `p` has the global index
   `g = first_row[p] + r`, its index in the single-process gather, a document `d` of the piece
   is document `first_doc[p] + d` of the input, and offsets move by the tokens of the file's
   earlier pieces. It picks the same held-out documents, computes every row's id as the
   single-process version does (`heldout.row_ids`) and ships them (8 bytes a row, through the
   object store once); the shard is `id // rows_per_shard`, held-out shards after the training
   ones. Nothing here depends on the block or task layout.
4. Write (`groupby("shard").map_groups`, through Ray Data's pull-based sort shuffle: much faster
   here than its default hash shuffle): each group is one shard's rows; the task sorts them by id
   and writes `part-NNNNN.parquet` itself (in `eval/` for a held-out shard; local folder or any
   URI pyarrow.fs opens) with `row_group_size=rows_per_block`, the blocks training reads
   (`blocks.py`).
   Fine-tuning rows (`sft.py`) carry their loss mask through the stages (null on a plain-text
   row, written as all 1s when the data set has any mask, as the single-process version does),
   and a piece that read fine-tuning examples adds one counts row (row = -2) that the summary
   adds up for `_prepare.json`'s `sft` and the later stages drop.
5. The driver writes the tokenizer copies first and each `_prepare.json` last, the training
   set's at the very end: the keys of the single-process version plus `"engine": "ray"`.

Errors a task meets (a malformed JSONL line, a Parquet file without the text column) come back
as the one-line ValueError the single-process version raises: the driver reads the first bad
file (in input order) again with the `sources` readers, so the message names it as given, with
the line. Nothing is written: the output folder is only created once every input is tokenized.

Cluster: the one this process is already connected to; else `RAY_ADDRESS`'s when set (inputs and
output must then be reachable from every node: a shared folder, or a URI for the output); else a
local cluster started here with `num_cpus` (default `os.cpu_count()`) logical CPUs, shut down at
the end. The tokenizer is loaded once on the driver and shipped pickled (a Rust
`tokenizers.Tokenizer` pickles), unpickled once per worker process: no node needs its path.
Ray Data shows its progress bars; a final line says rows, tokens, shards and tokens/s.

`elastic-train prepare --engine auto` (the default) runs this pipeline when `RAY_ADDRESS` is set or
the inputs hold at least `AUTO_RAY_MIN_BYTES`, else `prepare.prepare`: starting Ray costs seconds
that a small corpus does not repay, and both give the same shards. `--engine ray|local` forces one.

Left for later: input URIs (inputs are local paths, as for `prepare.prepare`); a large text file
is still one piece.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data.dataset import (
    STATS_FILE,
    TOKENIZER_DIR,
    _resolve_dataset_path,
    pending_marker,
)
from elastic_train.data.heldout import EVAL_DIR, held_documents, row_ids, split_record
from elastic_train.data.pieces import (
    jsonl_bounds,
    mask_column,
    parquet_bounds,
    summarize_pieces,
    token_type_for,
    tokenize_pieces,
)
from elastic_train.data.prepare import (
    _check_arguments,
    _check_output_free,
    check_output_apart,
    folder_stats,
    prepare,
    store_output,
    with_defaults,
)
from elastic_train.data.rechunk import is_token_dataset
from elastic_train.data.rowgroups import auto_rows_per_block
from elastic_train.data.sft import SFT_COUNTS, RecordFields, SftCounts
from elastic_train.data.sources import (
    PathLike,
    collect_input_files,
    gather_rows,
    iter_jsonl_records,
    iter_parquet_records,
    no_text_message,
    warn_skipped,
)
from elastic_train.data.tokenizer import Tokenizer, load_tokenizer

# Tasks per CPU in the tokenize stage: enough that a slow file does not leave CPUs idle, few
# enough that task overhead stays small. Only the scheduling depends on it, never the output.
TASKS_PER_CPU = 4
# JSONL and Parquet inputs larger than this are cut into pieces of about this size (whole lines,
# whole row groups), so that one large file is tokenized by several tasks.
PIECE_BYTES = 64 << 20
# `--engine auto` picks Ray from this many input bytes on (or whenever RAY_ADDRESS is set): below
# it, starting a cluster costs more than it saves, and the output is the same either way.
AUTO_RAY_MIN_BYTES = 64 << 20
ENGINES = ("auto", "ray", "local")
logger = logging.getLogger("elastic_train.prepare")


def _assign(table: pa.Table, *, first_rows: np.ndarray, first_tokens: np.ndarray,
            first_docs: np.ndarray, ids_ref, train_rows: int, rows_per_shard: int) -> pa.Table:
    """Ids, documents and shards: a row's id is the one `heldout.row_ids` gives its global index
    (its position in the single-process permutation of its side); its document number moves
    from the piece's count to the global one, its offset from the piece's token stream to the
    file's. Held-out rows (ids from `train_rows` on) go to the shards after the training ones."""
    import ray

    ids_by_row = ray.get(ids_ref)
    table = table.filter(pc.greater_equal(table.column("row"), 0))  # not a piece's counts row
    pieces = table.column("piece").to_numpy()
    ids = ids_by_row[first_rows[pieces] + table.column("row").to_numpy()]
    offsets = first_tokens[pieces] + table.column("offset").to_numpy()
    docs = first_docs[pieces] + table.column("doc").to_numpy()
    train_shards = -(-train_rows // rows_per_shard)
    shards = np.where(ids < train_rows, ids // rows_per_shard,
                      train_shards + (ids - train_rows) // rows_per_shard)
    return (table.set_column(table.schema.get_field_index("offset"), "offset", pa.array(offsets))
            .set_column(table.schema.get_field_index("doc"), "doc", pa.array(docs))
            .append_column("id", pa.array(ids))
            .append_column("shard", pa.array(shards)))


def _write_shard(group: pa.Table, *, output: str, names: list[str], token_type: str,
                 rows_per_block: int, train_shards: int, with_mask: bool) -> pa.Table:
    """Write one shard's rows, sorted by id, as `part-NNNNN.parquet` (in `eval/` for a held-out
    shard; with a `loss_mask` column when `with_mask`); one summary row back: shard, rows,
    tokens, largest token id."""
    group = group.sort_by("id")
    shard = int(group.column("shard")[0].as_py())
    tokens = group.column("tokens").combine_chunks()
    table = pa.table({
        "id": group.column("id").cast(pa.int64()),
        "tokens": tokens.cast(pa.list_(pa.from_numpy_dtype(np.dtype(token_type)))),
        "length": pc.list_value_length(tokens).cast(pa.int32()),
        "source": pa.array([names[piece] for piece in group.column("piece").to_numpy()],
                           type=pa.string()),
        "offset": group.column("offset").cast(pa.int64()),
        "doc": group.column("doc").cast(pa.int64()),
    })
    if with_mask:
        table = table.append_column("loss_mask", mask_column(tokens, group.column("loss_mask")))
    fs, root = _resolve_dataset_path(output)
    folder, number = (root, shard) if shard < train_shards else (
        f"{root}/{EVAL_DIR}", shard - train_shards)
    pq.write_table(table, f"{folder}/part-{number:05d}.parquet", filesystem=fs,
                   row_group_size=rows_per_block)
    flat = pc.list_flatten(tokens)
    return pa.table({"shard": [shard], "rows": [len(table)], "tokens": [len(flat)],
                     "max_token": [int(pc.max(flat).as_py() or 0) if len(flat) else 0]})


def _list_pieces(files: list[Path]) -> list[dict]:
    """The pieces of all files, in order: a whole file, or consecutive slices of a JSONL or
    Parquet file larger than PIECE_BYTES (a Parquet file that does not open stays whole: its
    task reports why)."""
    pieces: list[dict] = []
    for index, file in enumerate(files):
        size = file.stat().st_size
        suffix, bounds = file.suffix.lower(), [0, 0]
        kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(suffix) if size > PIECE_BYTES else None
        try:
            bounds = jsonl_bounds(file, size, PIECE_BYTES) if kind == "jsonl" else (
                parquet_bounds(file, PIECE_BYTES) if kind == "parquet" else bounds)
        except (pa.ArrowException, OSError):
            kind = None
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            pieces.append({"piece": len(pieces), "file": index, "path": str(file.resolve()),
                           "kind": kind or "file", "start": start, "end": end,
                           "bytes": max(size * (end - start) // max(bounds[-1], 1), 1)
                           if kind else max(size, 1)})
    return pieces


def _task_groups(pieces: list[dict], num_cpus: int) -> list[dict]:
    """Consecutive pieces grouped into about `TASKS_PER_CPU * num_cpus` tasks of similar size."""
    target = sum(piece["bytes"] for piece in pieces) / max(TASKS_PER_CPU * num_cpus, 1)
    groups: list[list[dict]] = []
    filled = target  # start a new group at the first piece
    for piece in pieces:
        if filled >= target:
            groups.append([])
            filled = 0.0
        groups[-1].append(piece)
        filled += piece["bytes"]
    return [{"pieces": json.dumps(group)} for group in groups]


def _local_error(file: Path, tokenizer: Tokenizer, max_seq_len: int, text_field: RecordFields
                 ) -> ValueError | None:
    """The ValueError the single-process prepare raises for `file`, found by reading it here
    (only once a task has failed on it: its message names the file as given and the line or
    row). Its records are read first (cheap: no tokenizing); only when they are all sound is
    the file gathered whole, for an error of the chat template, which names its record too."""
    suffix = file.suffix.lower()
    try:
        if suffix == ".jsonl":
            for _ in iter_jsonl_records(file, text_field):
                pass
        elif suffix == ".parquet":
            for _ in iter_parquet_records(file, text_field):
                pass
        gather_rows([file], tokenizer, max_seq_len, text_field)
    except ValueError as exc:
        return exc
    return None


def _output_location(output: PathLike) -> tuple[pafs.FileSystem, str, str]:
    """The output's filesystem, its path inside it, and the string tasks resolve it from.
    Refuses (ValueError) a file, or a folder already holding what a prepare writes."""
    shown = str(output)
    if not shown.strip():
        raise ValueError("--output: an empty path")
    if "://" not in shown:
        _check_output_free(Path(output))
        fs, root = _resolve_dataset_path(shown)
        return fs, root, root
    fs, root = store_output(shown)
    return fs, root, shown


def _create_output(fs: pafs.FileSystem, root: str, shown: str, tokenizer: Tokenizer,
                   held_out: bool) -> None:
    """The output folder (and `eval/` in it for a held-out set), each with the tokenizer copy
    in `tokenizer/` (through a local folder for a URI) unless bytes."""
    folders = [root, f"{root}/{EVAL_DIR}"] if held_out else [root]
    try:
        for folder in folders:
            fs.create_dir(folder, recursive=True)
    except OSError as exc:
        raise ValueError(f"output '{shown}' cannot be created: {exc}") from None
    if tokenizer.kind == "bytes":
        return
    for folder in folders:
        if isinstance(fs, pafs.LocalFileSystem):
            tokenizer.save(Path(folder) / TOKENIZER_DIR)
            continue
        with tempfile.TemporaryDirectory(prefix="elastic_train-tokenizer-") as scratch:
            tokenizer.save(scratch)
            pafs.copy_files(scratch, f"{folder}/{TOKENIZER_DIR}",
                            source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


@contextmanager
def _ray_cluster(num_cpus: int | None) -> Iterator[int]:
    """Ray for the pipeline: the cluster already joined, else `RAY_ADDRESS`'s, else a local one
    with `num_cpus` CPUs (default all), shut down at the end. Yields the cluster's CPU count."""
    import ray

    started = not ray.is_initialized()
    if started and os.environ.get("RAY_ADDRESS"):
        from elastic_train.cluster.driver import join_cluster

        join_cluster(os.environ["RAY_ADDRESS"], "RAY_ADDRESS", log_to_driver=False)
    elif started:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                 include_dashboard=False, log_to_driver=False)
    try:
        yield max(int(ray.cluster_resources().get("CPU", 1)), 1)
    finally:
        if started:
            ray.shutdown()


@contextmanager
def _data_context(progress: bool) -> Iterator[None]:
    """Ray Data settings for the pipeline, restored after: progress bars or not, and the pull-based
    sort shuffle for the write stage's groupby (measured here on the embedded corpus: 1.1-1.4 s,
    against 7-10 s for Ray 2.60's default hash shuffle)."""
    import ray.data
    from ray.data.context import ShuffleStrategy

    context = ray.data.DataContext.get_current()
    saved = context.enable_progress_bars, context.shuffle_strategy
    context.enable_progress_bars = progress
    context.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
    try:
        yield
    finally:
        context.enable_progress_bars, context.shuffle_strategy = saved


def _tokenize_all(files: list[Path], tokenizer: Tokenizer, cpus: int, max_seq_len: int,
                  text_field: RecordFields) -> tuple:
    """Stages 1 and 2: the pieces, their materialized rows, and per piece its rows, tokens,
    largest token id (arrays indexed by piece) and rows per document (a list of arrays), then
    the fine-tuning counts and whether any row has a loss mask. Raises the first bad file's
    ValueError."""
    import ray

    pieces = _list_pieces(files)
    kwargs = {"tokenizer_blob": pickle.dumps(tokenizer), "max_seq_len": max_seq_len,
              "text_field": text_field, "token_type": token_type_for(int(tokenizer.vocab_size) - 1).name}
    groups = _task_groups(pieces, cpus)
    tokenized = (ray.data.from_items(groups, override_num_blocks=len(groups))
                 .map_batches(tokenize_pieces, batch_size=1, batch_format="pyarrow", fn_kwargs=kwargs)
                 .materialize())
    summary = tokenized.map_batches(summarize_pieces, batch_size=None, batch_format="pyarrow").take_all()
    errors = sorted((record["piece"], record["error"]) for record in summary if record["error"])
    if errors:
        file = files[pieces[errors[0][0]]["file"]]
        raise _local_error(file, tokenizer, max_seq_len, text_field) or ValueError(errors[0][1])
    rows, tokens, top = (np.zeros(len(pieces), dtype=np.int64) for _ in range(3))
    doc_rows = [np.zeros(0, dtype=np.int64) for _ in pieces]
    sft, masked = SftCounts(), False
    for record in summary:
        sft.add(SftCounts(*(record[key] for key in SFT_COUNTS)))
        masked = masked or record["masked"] > 0
        piece, first, counts = record["piece"], record["first_doc"], record["doc_rows"]
        rows[piece] += record["rows"]
        tokens[piece] += record["tokens"]
        top[piece] = max(top[piece], record["max_token"])
        if len(doc_rows[piece]) < first + len(counts):
            doc_rows[piece] = np.pad(doc_rows[piece], (0, first + len(counts) - len(doc_rows[piece])))
        doc_rows[piece][first:first + len(counts)] += np.asarray(counts, dtype=np.int64)
    if any(int(counts.sum()) != rows[piece] for piece, counts in enumerate(doc_rows)):
        raise RuntimeError("the tokenize stage's rows per document do not add up to its rows")
    return pieces, tokenized, rows, tokens, top, doc_rows, sft, masked


def _write_all(tokenized, pieces: list[dict], rows: np.ndarray, tokens: np.ndarray,
               doc_rows: list[np.ndarray], held: np.ndarray, *, cpus: int, seed: int,
               rows_per_shard: int, rows_per_block: int, target: str, names: list[str],
               token_type: np.dtype, with_mask: bool) -> tuple[int, list[dict]]:
    """Stages 3 and 4: ids from the single-process split and permutations (`heldout.row_ids`),
    then one task per shard writes it. Returns the number of training rows and a record per
    shard written (shard, rows, tokens, max_token), training shards first."""
    import ray

    first_rows = np.zeros(len(rows), dtype=np.int64)
    np.cumsum(rows[:-1], out=first_rows[1:])
    first_tokens = np.zeros(len(rows), dtype=np.int64)  # where a piece starts in its file
    for index in range(1, len(pieces)):
        if pieces[index]["file"] == pieces[index - 1]["file"]:
            first_tokens[index] = first_tokens[index - 1] + tokens[index - 1]
    first_docs = np.zeros(len(rows), dtype=np.int64)  # a piece's first document, globally
    np.cumsum(np.array([len(counts) for counts in doc_rows[:-1]], dtype=np.int64),
              out=first_docs[1:])
    ids, train_rows = row_ids(np.repeat(held, np.concatenate(doc_rows)), seed)
    assign = {"first_rows": first_rows, "first_tokens": first_tokens, "first_docs": first_docs,
              "ids_ref": ray.put(ids), "train_rows": train_rows, "rows_per_shard": rows_per_shard}
    train_shards = -(-train_rows // rows_per_shard)
    write = {"output": target, "names": [names[piece["file"]] for piece in pieces],
             "token_type": token_type.name, "rows_per_block": rows_per_block,
             "train_shards": train_shards, "with_mask": with_mask}
    expected = train_shards + -(-(len(ids) - train_rows) // rows_per_shard)
    written = (tokenized.map_batches(_assign, batch_size=None, batch_format="pyarrow", fn_kwargs=assign)
               .groupby("shard", num_partitions=min(expected, TASKS_PER_CPU * cpus))
               .map_groups(_write_shard, batch_format="pyarrow", fn_kwargs=write)
               .take_all())
    written.sort(key=lambda record: record["shard"])
    shards = [record["shard"] for record in written]
    if shards != list(range(expected)) or sum(record["rows"] for record in written) != len(ids):
        raise RuntimeError(f"the write stage wrote shards {shards}, not 0..{expected - 1}")
    return train_rows, written


def _side_counts(records: list[dict]) -> dict:
    """Rows, tokens, shards and largest token id of one side's shard records."""
    return {"rows": sum(r["rows"] for r in records), "tokens": sum(r["tokens"] for r in records),
            "shards": len(records), "max_token_id": max((r["max_token"] for r in records), default=0)}


def _write_stats(fs: pafs.FileSystem, folder: str, stats: dict) -> None:
    with fs.open_output_stream(f"{folder}/{STATS_FILE}") as handle:
        handle.write((json.dumps(stats, indent=2, sort_keys=True) + "\n").encode())


def summary_line(stats: dict, seconds: float) -> str:
    """The final line: rows, tokens, shards, seconds and tokens/s."""
    return (f"prepared {stats['rows']} rows, {stats['tokens']} tokens, {stats['shards']} shards "
            f"in {seconds:.1f} s ({stats['tokens'] / max(seconds, 1e-9):.0f} tokens/s)")


def prepare_ray(
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
    num_cpus: int | None = None,
    progress: bool = True,
) -> dict:
    """`prepare.prepare` as a Ray Data pipeline (see the module docstring): the same arguments,
    the same shards and ids (the held-out `eval/` too), and the same `_prepare.json` plus
    `"engine": "ray"`, which it returns. `output` may also be a URI pyarrow.fs understands.
    `num_cpus`: CPUs of the local cluster started when this process has no Ray yet and
    `RAY_ADDRESS` is unset (default: all). `progress`: Ray Data's progress bars, and the final
    line on stderr.

    Raises ValueError naming the culprit, as `prepare.prepare` does; all the checks that need no
    tokenizing run before Ray starts.
    """
    _check_arguments(max_seq_len, rows_per_shard, rows_per_block, seed, eval_fraction)
    if is_token_dataset(inputs, text_field):  # a re-chunk: new row groups, no tokenizing
        return prepare(inputs, output, max_seq_len=max_seq_len, rows_per_shard=rows_per_shard,
                       rows_per_block=rows_per_block, seed=seed, tokenizer=tokenizer,
                       text_field=text_field, eval_fraction=eval_fraction)
    max_seq_len, seed, eval_fraction = with_defaults(max_seq_len, seed, eval_fraction)
    fs, root, target = _output_location(output)
    if "://" not in str(output):
        check_output_apart(inputs, Path(output))
    if tokenizer is None or isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    skipped: list[tuple[Path, str]] = []
    files = collect_input_files(inputs, skipped)
    if not files:
        raise ValueError(no_text_message(inputs, skipped))
    started = time.perf_counter()
    with _ray_cluster(num_cpus) as cpus, _data_context(progress):
        fields = RecordFields(text=text_field, prompt=prompt_field, response=response_field)
        pieces, tokenized, rows, tokens, top, doc_rows, sft, masked = _tokenize_all(
            files, tokenizer, cpus, max_seq_len, fields)
        if rows.sum() == 0:
            raise ValueError(no_text_message(inputs, skipped, sft, max_seq_len))
        warn_skipped(skipped)
        rows_per_block = rows_per_block or auto_rows_per_block(int(rows.sum()))
        held = held_documents(sum(len(counts) for counts in doc_rows), eval_fraction, seed)
        token_type = token_type_for(max(int(tokenizer.vocab_size) - 1, int(top.max())))
        _create_output(fs, root, str(output), tokenizer, bool(held.any()))
        with pending_marker(fs, root):
            train_rows, written = _write_all(
                tokenized, pieces, rows, tokens, doc_rows, held, cpus=cpus, seed=seed,
                rows_per_shard=rows_per_shard, rows_per_block=rows_per_block, target=target,
                names=[str(file) for file in files], token_type=token_type, with_mask=masked)
            common = {"max_seq_len": max_seq_len, "source_files": len(files),
                      "skipped": len(skipped), "tokenizer": tokenizer, "token_type": token_type,
                      "rows_per_block": rows_per_block,
                      "sft": sft.record() if sft.examples else None}
            train_shards = -(-train_rows // rows_per_shard)
            stats = {**folder_stats(_side_counts(written[:train_shards]), **common),
                     "engine": "ray"}
            if held.any():
                counts = _side_counts(written[train_shards:])
                _write_stats(fs, f"{root}/{EVAL_DIR}",
                             {**folder_stats(counts, **common), "engine": "ray",
                              "held_out": {"fraction": eval_fraction}})
                stats["eval"] = split_record(eval_fraction, int(held.sum()), counts["rows"],
                                             counts["tokens"])
            _write_stats(fs, root, stats)
    if progress:
        print(summary_line(stats, time.perf_counter() - started), file=sys.stderr, flush=True)
    return stats


def choose_engine(engine: str, inputs: Sequence[PathLike], text_field: str = "text") -> str:
    """"ray" or "local" for `engine` ("auto" | "ray" | "local"). Auto: Ray when `RAY_ADDRESS` is
    set or the input files hold at least `AUTO_RAY_MIN_BYTES`; both give the same shards. A
    prepared data set is re-chunked, which tokenizes nothing: local."""
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not '{engine}'")
    if engine != "auto":
        return engine
    if is_token_dataset(inputs, text_field):
        return "local"
    if os.environ.get("RAY_ADDRESS"):
        return "ray"
    total = 0
    for file in collect_input_files(inputs):
        total += file.stat().st_size
        if total >= AUTO_RAY_MIN_BYTES:
            return "ray"
    return "local"
