"""Worker-side data: padded micro-batches, Arrow columns to numpy, and the prefetch thread.

`MicroBatch` is what the loop trains on (`to_batch` gives the tensors a model and loss see). Which
rows make each micro-batch is decided by `plan.py` and read by `blocks.py`. A background thread
(`Prefetcher`) assembles steps ahead of the loop; the loop's wait for one is `data_wait_s`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

ROW_BATCH_SIZE = 1024  # rows per batch read from the source; any value gives the same steps
# An extra column's kind: (numpy dtype of its values, whether it holds a list per row)
ColumnKind = tuple[np.dtype, bool]


@dataclass
class MicroBatch:
    """One padded micro-batch: `tokens` is int64 [rows, longest], right-padded with `pad_id`;
    `extras` holds the data set's other columns (a scalar per row, or lists padded with 0)."""

    partition: int
    ids: np.ndarray
    tokens: np.ndarray
    lengths: np.ndarray
    extras: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def targets(self) -> int:
        """Next-token targets: every real token but the first of each row; with a `loss_mask`
        column (fine-tuning data), only the tokens it marks (the answers), never a row's first."""
        mask = self.extras.get(LOSS_MASK)
        if mask is not None and mask.ndim == 2:
            return int((mask[:, 1:] != 0).sum())
        return int(np.maximum(self.lengths - 1, 0).sum())

    def to_batch(self, device: torch.device, pad_multiple: int = 1,
                 max_width: int | None = None, pad_id: int = 0) -> dict[str, torch.Tensor]:
        """The tensors a model and loss see (see `losses.py`): tokens, attention_mask,
        position_ids, labels (IGNORE_INDEX on padding), lengths, and the extra columns.

        `pad_multiple` > 1 pads the columns up to a multiple of it (never past `max_width`), so
        that a GPU sees few distinct shapes: its allocator and compiled graphs reuse them. The
        extra columns are padding (beyond every row's length): tokens `pad_id` (the micro-batch's
        own padding, so a loss that finds padding by `tokens == pad_id` finds these too), list
        columns 0, as `pad_rows` pads; no real token sees them. The figures (`real_tokens`,
        `padded_tokens`) stay those of the micro-batch itself."""
        tokens, extras = self.tokens, self.extras
        width = tokens.shape[1]
        wanted = -(-width // pad_multiple) * pad_multiple
        if max_width is not None:
            wanted = max(width, min(wanted, max_width))
        if wanted > width:
            tokens = np.pad(tokens, ((0, 0), (0, wanted - width)), constant_values=pad_id)
            extras = {name: np.pad(v, ((0, 0), (0, wanted - width))) if v.ndim == 2
                      and v.shape[1] == width else v for name, v in extras.items()}
        batch = make_batch(_to_device(tokens, device), _to_device(self.lengths, device))
        for name, values in extras.items():
            batch[name] = _to_device(values, device)
        mask = batch.get(LOSS_MASK)
        if mask is not None and mask.shape == batch["labels"].shape:  # answers only
            batch["labels"] = torch.where(mask != 0, batch["labels"], IGNORE_INDEX)
        return batch


def _to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device`; to a GPU through pinned memory, so the copy is truly
    asynchronous (from pageable memory the host waits for it to be staged)."""
    tensor = torch.from_numpy(values)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _stack_extra(values: list[Any]) -> np.ndarray:
    """A column's values for the rows of a micro-batch: stacked scalars, or lists padded with 0."""
    if values and isinstance(values[0], np.ndarray):
        out = np.zeros((len(values), max(max(len(v) for v in values), 1)), dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : len(v)] = v
        return out
    return np.asarray(values)


def pad_rows(rows: list[tuple], partition: int, pad_id: int = 0,
             extra_columns: tuple[str, ...] = ()) -> MicroBatch:
    """Stack (id, tokens, extras) rows into a right-padded int64 matrix."""
    lengths = np.fromiter((len(r[1]) for r in rows), dtype=np.int64, count=len(rows))
    tokens = np.full((len(rows), max(int(lengths.max()), 1)), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row[1])] = row[1]
    ids = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
    extras = {name: _stack_extra([r[2][j] for r in rows]) for j, name in enumerate(extra_columns)}
    return MicroBatch(partition, ids, tokens, lengths, extras)


def stack_rows(columns: dict[str, Any], rows: np.ndarray, partition: int, pad_id: int = 0) -> MicroBatch:
    """The micro-batch of rows `rows` of a window's `columns` (see `arrow_to_columns`)."""
    extra = tuple(name for name in columns if name not in ("id", "tokens", "length"))
    tokens, extras = columns["tokens"], [columns[name] for name in extra]
    picked = [(int(columns["id"][i]), tokens[i], tuple(c[i] for c in extras)) for i in rows]
    return pad_rows(picked, partition, pad_id, extra)


def _list_views(column) -> list[np.ndarray]:
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False)
    offsets = column.offsets.to_numpy()
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def arrow_to_columns(rb, extra_columns: tuple[str, ...] = ()) -> dict[str, Any]:
    """A pyarrow RecordBatch/Table -> {"id", "length": numpy arrays, "tokens": list of views},
    plus each extra column (numpy array, or a list of views for a list column).

    Much faster than Ray Data's numpy format, which builds one object per row."""
    out = {"id": rb.column("id").to_numpy(), "length": rb.column("length").to_numpy(),
           "tokens": _list_views(rb.column("tokens"))}
    for name in extra_columns:
        column = rb.column(name)
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            out[name] = _list_views(column)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out


def iter_parquet_batches(files: list[str], extra_columns: tuple[str, ...] = ()) -> Iterator[dict[str, Any]]:
    """Rows of Parquet shards (local paths or pyarrow.fs URIs) in order, streamed with pyarrow:
    memory holds one record batch at a time, whatever the dataset's size."""
    columns = ["id", "tokens", "length", *extra_columns]
    for path in files:
        if "://" in path:
            fs, fs_path = pafs.FileSystem.from_uri(path)
            pf = pq.ParquetFile(fs.open_input_file(fs_path))
        else:
            pf = pq.ParquetFile(path)
        for rb in pf.iter_batches(batch_size=ROW_BATCH_SIZE, columns=columns):
            yield arrow_to_columns(rb, extra_columns)


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


IGNORE_INDEX = -100
# The column of fine-tuning data that marks target tokens (prepare's `sft.py`): 1 on a target,
# 0 on a prompt token. `labels` hold IGNORE_INDEX where it is 0, and only its 1s count as targets.
LOSS_MASK = "loss_mask"


def make_batch(tokens: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """The batch of right-padded `tokens` [B, T] whose row i holds `lengths[i]` real tokens."""
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    real = positions < lengths[:, None]
    return {"tokens": tokens, "attention_mask": real.long(), "position_ids": positions,
            "labels": torch.where(real, tokens, IGNORE_INDEX), "lengths": lengths}
