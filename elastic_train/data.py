"""Worker-side data stream: rows in read order -> this rank's padded micro-batches, step by step.

The rows come from Ray Data (`ray.train.get_dataset_shard`, every worker iterating the whole dataset
in a fixed order) or, in tests and benchmarks, straight from Parquet with pyarrow. Either way each
rank keeps only the rows of its canonical partitions (see `plan.py`), so the steps it produces are
the same whatever the world size, and a restart mid-epoch skips exactly the steps already trained.
A background thread assembles steps ahead of the loop; the loop's wait for one is `data_wait_s`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.plan import StepAssembler, partition_of

ROW_BATCH_SIZE = 1024  # rows per batch read from the source; any value gives the same steps


@dataclass
class MicroBatch:
    """One padded micro-batch: `tokens` is int64 [rows, longest], right-padded with 0."""

    partition: int
    ids: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def targets(self) -> int:
        """Next-token targets: every real token but the first of each row."""
        return int(np.maximum(self.lengths - 1, 0).sum())


def pad_rows(rows: list[tuple[int, np.ndarray]], partition: int) -> MicroBatch:
    """Stack (id, tokens) rows into a right-padded int64 matrix."""
    lengths = np.fromiter((len(t) for _, t in rows), dtype=np.int64, count=len(rows))
    tokens = np.zeros((len(rows), max(int(lengths.max()), 1)), dtype=np.int64)
    for i, (_, toks) in enumerate(rows):
        tokens[i, : len(toks)] = toks
    ids = np.fromiter((i for i, _ in rows), dtype=np.int64, count=len(rows))
    return MicroBatch(partition, ids, tokens, lengths)


def iter_rank_steps(
    batches: Iterable[dict[str, np.ndarray]],
    *,
    partitions: list[int],
    num_partitions: int,
    micro_batch_tokens: int,
    shuffle_window: int,
    seed: int,
    epoch: int,
    bucketing: bool = True,
    start_step: int = 0,
) -> Iterator[list[MicroBatch]]:
    """This rank's micro-batches for each step of one epoch, from `start_step` on.

    `batches` yields dicts with `id`, `tokens` (object array of int arrays) and `length`, in the
    same order on every rank and every attempt. After this rank's partitions run dry it yields
    empty steps forever: the epoch ends when the loop sees that every rank's step is empty.
    """
    assembler = StepAssembler(
        partitions,
        micro_batch_tokens=micro_batch_tokens,
        shuffle_window=shuffle_window,
        seed=seed,
        epoch=epoch,
        bucketing=bucketing,
        start_step=start_step,
    )
    owned = np.zeros(num_partitions, dtype=bool)
    owned[partitions] = True
    for batch in batches:
        ids = np.asarray(batch["id"], dtype=np.int64)
        part = partition_of(ids, num_partitions)
        tokens, lengths = batch["tokens"], batch["length"]
        for i in np.flatnonzero(owned[part]):
            assembler.add(int(part[i]), (int(ids[i]), tokens[i]), int(lengths[i]))
        for step in assembler.pop_steps():
            yield [pad_rows(mb.rows, mb.partition) for mb in step]
    assembler.finish()
    for step in assembler.pop_steps():
        yield [pad_rows(mb.rows, mb.partition) for mb in step]
    while True:
        yield []


def arrow_to_columns(rb) -> dict[str, Any]:
    """A pyarrow RecordBatch/Table -> {"id", "length": numpy arrays, "tokens": list of views}.

    Much faster than Ray Data's numpy format, which builds one object per row."""
    tokens = rb.column("tokens")
    if hasattr(tokens, "combine_chunks"):
        tokens = tokens.combine_chunks()
    values = tokens.values.to_numpy(zero_copy_only=False)
    offsets = tokens.offsets.to_numpy()
    return {
        "id": rb.column("id").to_numpy(),
        "length": rb.column("length").to_numpy(),
        "tokens": [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)],
    }


def iter_parquet_batches(files: list[str]) -> Iterator[dict[str, Any]]:
    """Rows of Parquet shards (local paths or pyarrow.fs URIs) in order, streamed with pyarrow:
    memory holds one record batch at a time, whatever the dataset's size."""
    for path in files:
        if "://" in path:
            fs, fs_path = pafs.FileSystem.from_uri(path)
            pf = pq.ParquetFile(fs.open_input_file(fs_path))
        else:
            pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=ROW_BATCH_SIZE, columns=["id", "tokens", "length"]):
            yield arrow_to_columns(rb)


def iter_ray_batches(data_iterator, prefetch_batches: int = 2) -> Iterator[dict[str, Any]]:
    """Rows of a Ray Data shard (a `DataIterator`), in the dataset's preserved order."""
    for table in data_iterator.iter_batches(
        batch_size=ROW_BATCH_SIZE, batch_format="pyarrow", prefetch_batches=prefetch_batches
    ):
        yield arrow_to_columns(table)


_DONE = object()


class Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead; measures the consumer's wait."""

    def __init__(self, iterator: Iterator, depth: int) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(iterator,), daemon=True)
        self._thread.start()

    def _run(self, iterator: Iterator) -> None:
        try:
            for item in iterator:
                while not self._stop.is_set():
                    try:
                        self._queue.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._queue.put((_DONE, exc))
            return
        self._queue.put((_DONE, None))

    def next(self) -> tuple[object, float]:
        """(next item, seconds waited for it); raises StopIteration at the end."""
        start = time.perf_counter()
        item, exc = self._queue.get()
        wait_s = time.perf_counter() - start
        if exc is not None:
            raise exc
        if item is _DONE:
            raise StopIteration
        return item, wait_s

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
