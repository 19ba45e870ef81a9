"""How many steps a run will train, known before it starts: the number the progress line counts
to, and which limit (train.max_steps or train.epochs) ends the run.

An epoch lasts as many global steps as its fullest partition has micro-batches (`plan.py`: step j
is micro-batch j of every partition that still has one), and a partition's micro-batches follow
from its blocks' row lengths alone (`bucket_window`, with the RNG the stream uses). So the driver
reads only the `length` column of the training blocks and runs the plan's own functions: the count
is exact, for every epoch (each deals the blocks anew), with no token read. A data set of more than
`MAX_ROWS_READ` rows is not read for it: the total is then train.max_steps (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_train.data.plan import StreamSpec, assign_blocks, bucket_window, window_rng, window_spans
from elastic_train.data.rowgroups import BlockTable, read_row_group

MAX_ROWS_READ = 2_000_000  # ~8 MB of lengths; more and the count is left to train.max_steps
MAX_EPOCHS_COUNTED = 100  # past this many epochs, later ones are taken as long as the mean


@dataclass(frozen=True)
class Horizon:
    """The steps a run trains from step 0 (`total`), the limit that ends it, and whether the
    count is exact (False: the data set was too large to read its lengths)."""

    total: int
    limit: str  # "train.max_steps" | "train.epochs"
    exact: bool = True


def block_lengths(table: BlockTable) -> list[np.ndarray]:
    """Each block's row lengths, in row order (the `length` column only)."""
    cache: dict = {}
    return [read_row_group(table, b, ["length"], cache)[0].column("length").to_numpy()
            for b in range(len(table))]


def epoch_steps(table: BlockTable, lengths: list[np.ndarray], spec: StreamSpec, epoch: int) -> int:
    """Global steps of `epoch`: the most micro-batches any partition has in it."""
    most = 0
    for p, blocks in enumerate(assign_blocks(table.tokens, spec.num_partitions, spec.seed, epoch)):
        count = 0
        for w, (start, end) in enumerate(window_spans(table.rows[blocks], spec.shuffle_window)):
            rows = np.concatenate([lengths[b] for b in blocks[start:end]])
            count += len(bucket_window(rows, spec.micro_batch_tokens,
                                       window_rng(spec.seed, epoch, p, w), spec.bucketing))
        most = max(most, count)
    return most


def plan_horizon(table: BlockTable, spec: StreamSpec, max_steps: int, epochs: int) -> Horizon:
    """The run's steps: epochs' steps summed until train.max_steps or train.epochs binds."""
    if int(table.rows.sum()) > MAX_ROWS_READ:
        return Horizon(max_steps, "train.max_steps", exact=False)
    lengths = block_lengths(table)
    total, counted = 0, []
    for epoch in range(epochs):
        if total >= max_steps:
            break
        if len(counted) >= MAX_EPOCHS_COUNTED:  # the rest at the mean: nearly exact, bounded time
            total += int(np.mean(counted)) * (epochs - epoch)
            break
        counted.append(epoch_steps(table, lengths, spec, epoch))
        total += counted[-1]
    if total >= max_steps:
        return Horizon(max_steps, "train.max_steps")
    return Horizon(total, "train.epochs", exact=len(counted) == epochs)
