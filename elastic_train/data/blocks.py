"""Sharded reads: the data set as blocks (Parquet row groups), and each rank's stream of steps.

The driver lists the blocks once from Parquet metadata (`build_block_table`: rows and an estimate of
tokens per row group, nothing read but footers). A worker reads only the blocks of the partitions it
owns (`plan.assign_blocks`), a window at a time, and turns them into micro-batches
(`PartitionStream`); `iter_rank_steps` zips its partitions' streams into steps. Every step comes with
the cursors of this rank's partitions after it, (window, micro-batches taken from that window), which
the loop saves in checkpoints (gathered from all ranks): a resume, at any world size, starts each
partition at its cursor and reads at most one window of it again. Rows and bytes read are counted,
for `read_amplification` (rows read by all ranks / rows trained: 1.0 is ideal).

A rank speaks only for the partitions it owns: the cursors it yields are its own partitions', never
a copy of another's it was handed at a resume (a copy goes stale as the owner moves on, and a merge
that let it win rewound that partition in every later checkpoint). `check_cursors` holds a
restored position to the plan's own arithmetic: step j of an epoch is micro-batch j of every
partition that still has one, so after `step_in_epoch` steps partition p stands exactly
min(step_in_epoch, its micro-batches) into its stream, wherever the world size was.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data.batches import ColumnKind, MicroBatch, arrow_to_columns, stack_rows
from elastic_train.data.plan import StreamSpec, assign_blocks, bucket_window, window_rng, window_spans
from elastic_train.data.rowgroups import (
    BlockTable,
    DataError,
    build_block_table,
    check_block_rows,
    read_row_group,
)

Cursor = tuple[int, int]  # (window index, micro-batches already taken from that window)
MIN_BLOCKS_PER_PARTITION = 2


def check_blocks(table: BlockTable, num_partitions: int, shown: str) -> None:
    """Refuse a data set with too few blocks for its partitions to be balanced."""
    need = MIN_BLOCKS_PER_PARTITION * num_partitions
    if len(table) < need:
        rows = int(table.rows.sum())
        rechunk = (f"re-chunk it into smaller row groups (elastic-train prepare {shown} --output "
                   f"NEW_FOLDER --rows-per-block {rows // need}), or " if rows >= need else "")
        raise ValueError(
            f"data set {shown} has {len(table)} Parquet row groups, fewer than the {need} this run "
            f"needs ({MIN_BLOCKS_PER_PARTITION} per data partition, {num_partitions} partitions): "
            f"{rechunk}lower data.global_batch_tokens / data.micro_batch_tokens (the partitions "
            "are their ratio)")


@dataclass
class ReadCounter:
    """Rows and bytes (compressed, of the columns read) this process read from storage."""

    rows: int = 0
    bytes: int = 0


class BlockReader:
    """Reads whole blocks (row groups) of the shards with pyarrow, in this process, when asked;
    keeps the files it opened."""

    def __init__(self, table: BlockTable, extra_columns: tuple[str, ...] = (),
                 vocab_rows: int | None = None) -> None:
        self.table = table
        self.vocab_rows = vocab_rows  # token ids must be below it (the model's embedding rows)
        self.columns = ["id", "tokens", "length", *extra_columns]
        self.extra_columns = extra_columns
        self.counter = ReadCounter()
        self._open: dict[int, pq.ParquetFile] = {}
        self._kinds: dict[str, ColumnKind] | None = None

    def plan(self, windows: list[np.ndarray]) -> None:
        """The windows (block arrays) this epoch will ask for, in about that order: a reader
        that reads ahead starts on them (this one reads on demand)."""

    def read_blocks(self, blocks: np.ndarray) -> list[pa.Table]:
        out = []
        for b in blocks:
            rows, nbytes = read_row_group(self.table, int(b), self.columns, self._open)
            self.counter.bytes += nbytes
            out.append(rows)
        return out

    def read(self, blocks: np.ndarray) -> dict[str, Any]:
        """The rows of `blocks`, in that order, as columns (see `data.arrow_to_columns`); a row
        whose length or token ids are wrong raises `DataError` naming its file, row and id."""
        tables = self.read_blocks(blocks)
        for b, rows in zip(blocks, tables, strict=True):
            check_block_rows(rows, self.table, int(b), self.vocab_rows)
        self.counter.rows += sum(t.num_rows for t in tables)
        return arrow_to_columns(pa.concat_tables(tables), self.extra_columns)

    def extra_kinds(self) -> dict[str, ColumnKind]:
        """Each extra column's kind, (dtype, a list per row), as `arrow_to_columns` gives it:
        for a dry micro-batch (`step.dry_rank_batch`) shaped as a real one, where a rank has
        none to copy. From the schema of block 0's file (its footer, read once; the driver's
        `dataset.extra_columns` reads the first shard's schema too)."""
        if self._kinds is None:
            self._kinds = {}
            if self.extra_columns:
                read_row_group(self.table, 0, [], self._open)  # opens the file: reads no column
                schema = self._open[int(self.table.file_index[0])].schema_arrow
            for name in self.extra_columns:
                kind = schema.field(name).type
                per_row_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
                values = kind.value_type if per_row_list else kind
                self._kinds[name] = (np.dtype(values.to_pandas_dtype()), per_row_list)
        return self._kinds

    def close(self) -> None:
        """Stop reading ahead (nothing to stop here)."""

    def read_lengths(self, blocks: np.ndarray) -> np.ndarray:
        """The `length` column of `blocks`, in that order (for `check_cursors`; not counted as
        rows read: one int32 column chunk per block)."""
        return np.concatenate([read_row_group(self.table, int(b), ["length"], self._open)[0]
                               .column("length").to_numpy() for b in blocks]).astype(np.int64)


# `data.reader` -> its class. "ray_data" (Ray Data tasks read the blocks) is added by
# cluster/raydata.py, which the Ray worker imports: this wing imports no Ray.
READERS: dict[str, type[BlockReader]] = {"pyarrow": BlockReader}


def make_reader(kind: str, table: BlockTable, extra_columns: tuple[str, ...] = (),
                vocab_rows: int | None = None) -> BlockReader:
    """The block reader of `data.reader`: pyarrow (in the worker) or ray_data (Ray Data tasks)."""
    if kind not in READERS:
        raise ValueError(f"data.reader={kind}: no such reader here (have {sorted(READERS)})")
    return READERS[kind](table, extra_columns, vocab_rows)


@dataclass
class PartitionStream:
    """The micro-batches of one partition in one epoch, from a cursor on."""

    partition: int
    blocks: np.ndarray  # this partition's blocks, in read order
    spec: StreamSpec
    epoch: int
    reader: BlockReader
    pad_id: int = 0
    windows: list[tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.windows = window_spans(self.reader.table.rows[self.blocks], self.spec.shuffle_window)

    @property
    def done(self) -> Cursor:
        return (len(self.windows), 0)

    def position_after(self, micro_batches: int) -> Cursor:
        """The cursor after the first `micro_batches` micro-batches of the epoch (`done` when the
        partition has no more), from the plan alone: reads the length column of the windows it
        passes."""
        taken = 0
        for w, (start, end) in enumerate(self.windows):
            lengths = self.reader.read_lengths(self.blocks[start:end])
            rng = window_rng(self.spec.seed, self.epoch, self.partition, w)
            n = len(bucket_window(lengths, self.spec.micro_batch_tokens, rng, self.spec.bucketing))
            if taken + n > micro_batches:
                return (w, micro_batches - taken)
            taken += n
        return self.done

    def iter_from(self, cursor: Cursor) -> Iterator[tuple[MicroBatch, Cursor]]:
        """(micro-batch, cursor after it), from `cursor` to the end of the epoch."""
        first, skip = cursor
        for w in range(first, len(self.windows)):
            start, end = self.windows[w]
            columns = self.reader.read(self.blocks[start:end])
            rng = window_rng(self.spec.seed, self.epoch, self.partition, w)
            batches = bucket_window(columns["length"], self.spec.micro_batch_tokens, rng,
                                    self.spec.bucketing)
            for m in range(skip if w == first else 0, len(batches)):
                mb = stack_rows(columns, batches[m], self.partition, self.pad_id)
                yield mb, ((w, m + 1) if m + 1 < len(batches) else (w + 1, 0))


def iter_rank_steps(
    reader: BlockReader,
    spec: StreamSpec,
    *,
    partitions: list[int],
    epoch: int,
    cursors: dict[int, Cursor] | None = None,
    pad_id: int = 0,
) -> Iterator[tuple[list[MicroBatch], dict[int, Cursor]]]:
    """This rank's micro-batches for each step of one epoch, with its partitions' cursors after it.

    Partitions start at `cursors` (absent: the epoch's start). After all of this rank's partitions
    run dry it yields empty steps forever: the epoch ends when the loop sees every rank's step empty.
    """
    assignment = assign_blocks(reader.table.tokens, spec.num_partitions, spec.seed, epoch)
    # this rank's partitions only: a cursor it was handed for another's would go stale
    cursors = {p: (cursors or {}).get(p, (0, 0)) for p in partitions}
    live, streams = {}, []
    for p in partitions:
        stream = PartitionStream(p, assignment[p], spec, epoch, reader, pad_id)
        streams.append((stream, cursors[p][0]))
        live[p] = stream.iter_from(cursors[p])
    # The windows in about the order they will be asked for: window w of every partition, then w+1.
    rounds = max((len(s.windows) - first for s, first in streams), default=0)
    reader.plan([s.blocks[slice(*s.windows[first + k])] for k in range(rounds)
                 for s, first in streams if first + k < len(s.windows)])
    while True:
        step = []
        for p in list(live):
            item = next(live[p], None)
            if item is None:
                del live[p]
                cursors[p] = (len(window_spans(reader.table.rows[assignment[p]], spec.shuffle_window)), 0)
                continue
            mb, cursors[p] = item
            step.append(mb)
        yield step, dict(cursors)


def plan_positions(reader: BlockReader, spec: StreamSpec, *, partitions: list[int], epoch: int,
                   step_in_epoch: int) -> dict[int, Cursor]:
    """Where the plan stands after `step_in_epoch` steps of `epoch`, for each of `partitions`."""
    assignment = assign_blocks(reader.table.tokens, spec.num_partitions, spec.seed, epoch)
    return {p: PartitionStream(p, assignment[p], spec, epoch, reader).position_after(step_in_epoch)
            for p in partitions}


def check_cursors(reader: BlockReader, spec: StreamSpec, *, partitions: list[int], epoch: int,
                  step_in_epoch: int, cursors: dict[int, Cursor], shown: str) -> None:
    """Refuse a restored data position that is not where the plan stands after `step_in_epoch`
    steps of `epoch` (see the module's docstring), for `partitions` (each rank checks its own):
    a resume from it would train some samples twice and others never. `shown` names the
    checkpoint. Costs one read of the length column of the rows before each cursor and a sort
    per window (measured: docs/fault_tolerance.md)."""
    if not step_in_epoch:
        return
    for p, expected in plan_positions(reader, spec, partitions=partitions, epoch=epoch,
                                      step_in_epoch=step_in_epoch).items():
        found = cursors.get(p)
        if found != expected:
            raise DataError(
                f"checkpoint {shown}: data partition {p} is at {found} (window, micro-batch), "
                f"not at {expected} where the plan is after step {step_in_epoch} of epoch {epoch}: "
                "a resume from it would train other data; move it out of the run folder to "
                "resume from the one before")


def local_rank_steps(files: list[str], spec: StreamSpec, *, partitions: list[int], epoch: int = 0,
                     pad_id: int = 0) -> Iterator[list[MicroBatch]]:
    """A rank's steps of one epoch over local shard files, ending at its first empty step (for
    benchmarks and scripts: no cursors, no read counts)."""
    table = build_block_table(pafs.LocalFileSystem(), files, files)
    for step, _ in iter_rank_steps(BlockReader(table), spec, partitions=partitions, epoch=epoch,
                                   pad_id=pad_id):
        if not step:
            return
        yield step
