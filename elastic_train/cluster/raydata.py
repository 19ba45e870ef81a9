"""The Ray Data block reader (`data.reader=ray_data`): a rank's blocks read by Ray tasks.

Importing this module registers the reader in `data.blocks.READERS`; the Ray worker does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from elastic_train.data.blocks import READERS, BlockReader
from elastic_train.data.rowgroups import BlockTable


class RayDataBlockReader(BlockReader):
    """Reads a rank's blocks with Ray Data (`data.reader=ray_data`): one dataset per epoch over the
    blocks of its windows in the order `plan` gives, read by Ray tasks on any CPU of the cluster
    and prefetched; `read` takes the blocks it needs from that stream, keeping the ones that came
    early. The blocks and their rows are the same as the pyarrow reader's: only where and when
    they are read changes, so the steps are the same to the bit."""

    def __init__(self, table: BlockTable, extra_columns: tuple[str, ...] = (),
                 vocab_rows: int | None = None, prefetch_blocks: int = 8) -> None:
        super().__init__(table, extra_columns, vocab_rows)
        self.prefetch_blocks = prefetch_blocks
        self._stream: Iterator | None = None
        self._early: dict[int, pa.Table] = {}

    def plan(self, windows: list[np.ndarray]) -> None:
        import ray.data

        order = [int(b) for w in windows for b in w]
        self._early = {}
        if not order:  # nothing left to read (partitions done, or none held): no dataset of 0 blocks
            self._stream = iter(())
            return
        table, columns = self.table, self.columns

        def read(batch: dict[str, np.ndarray]) -> pa.Table:
            from elastic_train.data.rowgroups import read_row_group

            rows, nbytes = read_row_group(table, int(batch["block"][0]), columns)
            return rows.append_column("_block", pa.array(np.full(rows.num_rows, batch["block"][0])))\
                .append_column("_bytes", pa.array(np.full(rows.num_rows, nbytes)))

        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True
        context.enable_progress_bars = False
        ds = ray.data.from_items([{"block": b} for b in order], override_num_blocks=len(order)).map_batches(
            read, batch_size=1, batch_format="numpy", num_cpus=0.25,
            compute=ray.data.TaskPoolStrategy(size=2))  # (`concurrency=2` is deprecated since Ray 2.51)
        self._stream = iter(ds.iter_batches(batch_size=None, batch_format="pyarrow",
                                            prefetch_batches=self.prefetch_blocks))
        self._early = {}

    def read_blocks(self, blocks: np.ndarray) -> list[pa.Table]:
        if self._stream is None:  # read without a plan: as the pyarrow reader does
            return super().read_blocks(blocks)
        wanted = [int(b) for b in blocks]
        while any(b not in self._early for b in wanted):
            batch = next(self._stream)
            if batch.num_rows:
                block = int(batch.column("_block")[0].as_py())
                self.counter.bytes += int(batch.column("_bytes")[0].as_py())
                self._early[block] = batch.drop_columns(["_block", "_bytes"])
        return [self._early.pop(b) for b in wanted]

    def close(self) -> None:
        self._stream, self._early = None, {}


READERS["ray_data"] = RayDataBlockReader
