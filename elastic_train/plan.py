"""The batch plan: which samples make each micro-batch and each global step. Pure numpy, no Ray/torch.

World-size invariance comes from canonical partitions. The data is split by a hash of the sample id
into K partitions, K = global_batch_tokens / micro_batch_tokens, fixed for the life of a run. Each
partition is a deterministic stream: its rows, in read order, are cut into windows of
`shuffle_window` rows; each window is shuffled with an RNG seeded by (seed, epoch, partition, window),
sorted by length (bucketing) and cut greedily into micro-batches whose padded size (rows x longest
row) fits `micro_batch_tokens`; the micro-batches of a window are then shuffled again.

Global step j of an epoch is micro-batch j of every partition that still has one. A worker of rank r
out of W owns partitions r, r+W, r+2W, ... and so trains on K/W micro-batches per step (gradient
accumulation). Nothing here depends on W: the same seed gives the same steps on 1 or 8 workers, and
the data position is just (epoch, step in epoch).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def partition_of(ids: np.ndarray, num_partitions: int) -> np.ndarray:
    """Canonical partition of each sample id (splitmix64 hash, so any id scheme spreads evenly)."""
    with np.errstate(over="ignore"):
        z = np.asarray(ids).astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = (z ^ (z >> np.uint64(31))) & _MASK64
    return (z % np.uint64(num_partitions)).astype(np.int64)


def owned_partitions(world_rank: int, world_size: int, num_partitions: int) -> list[int]:
    """Partitions trained by one rank: round robin, so shares differ by at most one."""
    if not 0 <= world_rank < world_size:
        raise ValueError(f"world_rank {world_rank} out of range for world_size {world_size}")
    if world_size > num_partitions:
        raise ValueError(f"world_size {world_size} exceeds the {num_partitions} data partitions")
    return list(range(world_rank, num_partitions, world_size))


def window_rng(seed: int, epoch: int, partition: int, window: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, partition, window])


def bucket_window(
    lengths: np.ndarray, micro_batch_tokens: int, rng: np.random.Generator, bucketing: bool = True
) -> list[np.ndarray]:
    """Cut one window of rows into micro-batches: lists of row indices into `lengths`.

    Each micro-batch's padded size, rows x its longest row, is at most `micro_batch_tokens`.
    With bucketing the rows are sorted by length first (ties in shuffled order), so rows of
    similar length share a micro-batch; without it the shuffled order is cut as it is.
    The returned micro-batches come in shuffled order.
    """
    lengths = np.asarray(lengths)
    if len(lengths) and int(lengths.max()) > micro_batch_tokens:
        raise ValueError(
            f"a row of {int(lengths.max())} tokens exceeds micro_batch_tokens={micro_batch_tokens}"
        )
    order = rng.permutation(len(lengths))
    if bucketing:
        order = order[np.argsort(lengths[order], kind="stable")]
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for i, row in enumerate(order):
        longest_with_row = max(longest, int(lengths[row]), 1)
        if i > start and (i - start + 1) * longest_with_row > micro_batch_tokens:
            batches.append(order[start:i])
            start, longest_with_row = i, max(int(lengths[row]), 1)
        longest = longest_with_row
    if start < len(order):
        batches.append(order[start:])
    return [batches[i] for i in rng.permutation(len(batches))]


@dataclass
class MicroBatchRows:
    """One micro-batch of one partition: the row payloads (whatever the caller added)."""

    partition: int
    rows: list[Any]
    lengths: np.ndarray


@dataclass
class _PartitionState:
    partition: int
    window_index: int = 0
    pending_rows: list[Any] = field(default_factory=list)
    pending_lengths: list[int] = field(default_factory=list)
    ready: deque = field(default_factory=deque)
    finished: bool = False


class StepAssembler:
    """Turns the rows of one epoch, in read order, into this rank's steps.

    Feed rows with `add`, call `finish` at the end of the epoch's data, and take complete steps
    from `pop_steps`. A step is the list of this rank's micro-batches for one global step (empty
    when all of this rank's partitions are exhausted but others may not be). Steps before
    `start_step` are dropped (resume mid-epoch) without being materialised by the caller.
    """

    def __init__(
        self,
        partitions: list[int],
        *,
        micro_batch_tokens: int,
        shuffle_window: int,
        seed: int,
        epoch: int,
        bucketing: bool = True,
        start_step: int = 0,
    ) -> None:
        self.states = {p: _PartitionState(p) for p in partitions}
        self.micro_batch_tokens = micro_batch_tokens
        self.shuffle_window = shuffle_window
        self.seed, self.epoch, self.bucketing = seed, epoch, bucketing
        self.start_step = start_step
        self.next_step = start_step  # epoch step index of the next step popped
        self._dropped = {p: 0 for p in partitions}

    def add(self, partition: int, row: Any, length: int) -> None:
        state = self.states[partition]
        state.pending_rows.append(row)
        state.pending_lengths.append(int(length))
        if len(state.pending_rows) >= self.shuffle_window:
            self._flush(state)

    def finish(self) -> None:
        for state in self.states.values():
            if state.pending_rows:
                self._flush(state)
            state.finished = True

    def _flush(self, state: _PartitionState) -> None:
        lengths = np.asarray(state.pending_lengths, dtype=np.int64)
        rng = window_rng(self.seed, self.epoch, state.partition, state.window_index)
        for idx in bucket_window(lengths, self.micro_batch_tokens, rng, self.bucketing):
            if self._dropped[state.partition] < self.start_step:
                self._dropped[state.partition] += 1  # trained before the restart
                continue
            rows = [state.pending_rows[i] for i in idx]
            state.ready.append(MicroBatchRows(state.partition, rows, lengths[idx]))
        state.window_index += 1
        state.pending_rows, state.pending_lengths = [], []

    def pop_steps(self) -> list[list[MicroBatchRows]]:
        """Steps that are complete now: every owned partition has its micro-batch or is done."""
        steps = []
        while self.states:
            if not all(s.ready or s.finished for s in self.states.values()):
                break
            if all(s.finished and not s.ready for s in self.states.values()):
                break
            steps.append([s.ready.popleft() for s in self.states.values() if s.ready])
            self.next_step += 1
        return steps
