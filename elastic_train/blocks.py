"""Sharded reads: the data set as blocks (Parquet row groups), and each rank's stream of steps.

The driver lists the blocks once from Parquet metadata (`build_block_table`: rows and an estimate of
tokens per row group, nothing read but footers). A worker reads only the blocks of the partitions it
owns (`plan.assign_blocks`), a window at a time, and turns them into micro-batches
(`PartitionStream`); `iter_rank_steps` zips its partitions' streams into steps. Every step comes with
the cursors of this rank's partitions after it, (window, micro-batches taken from that window), which
the loop saves in checkpoints (gathered from all ranks): a resume, at any world size, starts each
partition at its cursor and reads at most one window of it again. Rows and bytes read are counted,
for `read_amplification` (rows read by all ranks / rows trained: 1.0 is ideal).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.data import MicroBatch, arrow_to_columns, stack_rows
from elastic_train.plan import StreamSpec, assign_blocks, bucket_window, window_rng, window_spans

Cursor = tuple[int, int]  # (window index, micro-batches already taken from that window)
MIN_BLOCKS_PER_PARTITION = 2


@dataclass(frozen=True)
class BlockTable:
    """Every block of a data set: shard file (its path for workers), row group, rows, tokens."""

    files: tuple[str, ...]
    file_index: np.ndarray
    row_group: np.ndarray
    rows: np.ndarray
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)


def _row_group_tokens(meta: pq.RowGroupMetaData, rows: int) -> int:
    """Tokens of a row group from metadata: the `tokens` column's uncompressed values over their
    width (an estimate within the size of the list offsets, good enough to balance by)."""
    for i in range(meta.num_columns):
        column = meta.column(i)
        if column.path_in_schema.split(".")[0] == "tokens":
            width = 4 if column.physical_type == "INT32" else 8 if column.physical_type == "INT64" else 2
            return max(int(column.total_uncompressed_size) // width, rows)
    return rows


def build_block_table(filesystem: pafs.FileSystem, files: list[str], uris: list[str]) -> BlockTable:
    """The blocks of shards `files` (paths inside `filesystem`; `uris` as workers open them),
    from the Parquet footers only."""
    index, groups, rows, tokens = [], [], [], []
    for i, path in enumerate(files):
        with filesystem.open_input_file(path) as handle:
            meta = pq.ParquetFile(handle).metadata
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            if n:
                index.append(i)
                groups.append(g)
                rows.append(n)
                tokens.append(_row_group_tokens(meta.row_group(g), n))
    as_array = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return BlockTable(tuple(uris), as_array(index), as_array(groups), as_array(rows), as_array(tokens))


def check_blocks(table: BlockTable, num_partitions: int, shown: str) -> None:
    """Refuse a data set with too few blocks for its partitions to be balanced."""
    need = MIN_BLOCKS_PER_PARTITION * num_partitions
    if len(table) < need:
        raise ValueError(
            f"data set {shown} has {len(table)} Parquet row groups, fewer than the {need} this run "
            f"needs ({MIN_BLOCKS_PER_PARTITION} per data partition, {num_partitions} partitions): "
            f"prepare it again with smaller row groups (elastic-train prepare --rows-per-block N), "
            f"or lower data.global_batch_tokens / data.micro_batch_tokens")


@dataclass
class ReadCounter:
    """Rows and bytes (compressed, of the columns read) this process read from storage."""

    rows: int = 0
    bytes: int = 0


class BlockReader:
    """Reads whole blocks (row groups) of the shards; keeps the files it opened."""

    def __init__(self, table: BlockTable, extra_columns: tuple[str, ...] = ()) -> None:
        self.table = table
        self.columns = ["id", "tokens", "length", *extra_columns]
        self.extra_columns = extra_columns
        self.counter = ReadCounter()
        self._open: dict[int, pq.ParquetFile] = {}

    def _file(self, i: int) -> pq.ParquetFile:
        if i not in self._open:
            uri = self.table.files[i]
            if "://" in uri:
                fs, path = pafs.FileSystem.from_uri(uri)
                self._open[i] = pq.ParquetFile(fs.open_input_file(path))
            else:
                self._open[i] = pq.ParquetFile(uri)
        return self._open[i]

    def read(self, blocks: np.ndarray) -> dict[str, Any]:
        """The rows of `blocks`, in that order, as columns (see `data.arrow_to_columns`)."""
        tables = []
        for b in blocks:
            pf, group = self._file(int(self.table.file_index[b])), int(self.table.row_group[b])
            tables.append(pf.read_row_group(group, columns=self.columns))
            meta = pf.metadata.row_group(group)
            self.counter.rows += meta.num_rows
            self.counter.bytes += sum(meta.column(i).total_compressed_size
                                      for i in range(meta.num_columns)
                                      if meta.column(i).path_in_schema.split(".")[0] in self.columns)
        return arrow_to_columns(pa.concat_tables(tables), self.extra_columns)


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
    cursors = dict(cursors or {})
    live = {}
    for p in partitions:
        stream = PartitionStream(p, assignment[p], spec, epoch, reader, pad_id)
        live[p] = stream.iter_from(cursors.get(p, (0, 0)))
        cursors.setdefault(p, (0, 0))
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
