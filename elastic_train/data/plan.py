"""The batch plan: which samples make each micro-batch and each global step. Pure numpy, no Ray/torch.

World-size invariance comes from canonical partitions. The data's unit of assignment is a block: one
Parquet row group, which storage reads alone. In each epoch the blocks are dealt to K partitions,
K = global_batch_tokens / micro_batch_tokens, fixed for the life of a run: in an order shuffled by
(seed, epoch), each block to the partition with the fewest tokens so far, so partitions differ by at
most one block's tokens. Each partition reads its blocks in an order shuffled by (seed, epoch,
partition), cut into windows of consecutive blocks holding at least `shuffle_window` rows (so a
window mixes rows of several blocks from anywhere in the data set); each window is shuffled with an
RNG seeded by (seed, epoch, partition, window), sorted by length (bucketing) and cut greedily into
micro-batches whose padded size (rows x longest row) fits `micro_batch_tokens`; the micro-batches of
a window are then shuffled again.

Global step j of an epoch is micro-batch j of every partition that still has one. A worker of rank r
out of W owns partitions r, r+W, r+2W, ... and so trains on K/W micro-batches per step (gradient
accumulation), reading only its partitions' blocks. Nothing here depends on W: the same seed gives
the same steps on 1 or 8 workers. A partition's position is a cursor (window, micro-batches taken
from it): a resume at any world size reads at most one window per partition again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StreamSpec:
    """What defines the partition streams of a run (with the block table and the epoch)."""

    num_partitions: int
    micro_batch_tokens: int
    shuffle_window: int
    seed: int
    bucketing: bool = True


def assign_blocks(block_tokens: np.ndarray, num_partitions: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The blocks of each partition in one epoch, in that partition's read order.

    Blocks are dealt in an order shuffled by (seed, epoch), each to the partition with the fewest
    tokens so far (ties to the lowest partition), so partition sizes differ by at most one block.
    """
    tokens = np.asarray(block_tokens, dtype=np.int64)
    order = np.random.default_rng([seed, epoch, 0xB10C]).permutation(len(tokens))
    heap = [(0, p) for p in range(num_partitions)]
    owned: list[list[int]] = [[] for _ in range(num_partitions)]
    for block in order:
        total, p = heapq.heappop(heap)
        owned[p].append(int(block))
        heapq.heappush(heap, (total + int(tokens[block]), p))
    out = []
    for p, blocks in enumerate(owned):
        blocks_arr = np.array(sorted(blocks), dtype=np.int64)
        out.append(blocks_arr[np.random.default_rng([seed, epoch, p, 0x0DE5]).permutation(len(blocks_arr))])
    return out


def window_spans(block_rows: np.ndarray, shuffle_window: int) -> list[tuple[int, int]]:
    """Windows over a partition's blocks in read order: [start, end) runs of consecutive blocks
    holding at least `shuffle_window` rows (the last one may hold fewer)."""
    spans, start, rows = [], 0, 0
    for i, n in enumerate(np.asarray(block_rows)):
        rows += int(n)
        if rows >= shuffle_window:
            spans.append((start, i + 1))
            start, rows = i + 1, 0
    if start < len(block_rows):
        spans.append((start, len(block_rows)))
    return spans


def partition_balance(block_tokens: np.ndarray, assignment: list[np.ndarray]) -> float:
    """Tokens of the largest partition / the mean: 1.0 is perfect balance. The steps at an epoch's
    end where smaller partitions are dry leave their ranks idle."""
    totals = np.array([int(np.asarray(block_tokens)[b].sum()) for b in assignment], dtype=np.float64)
    return float(totals.max() / max(totals.mean(), 1.0))


def utilisation(num_partitions: int, world_size: int) -> float:
    """Share of the ranks' step time spent training when W ranks own K partitions round robin:
    a step lasts as long as the rank with ceil(K/W) micro-batches."""
    return num_partitions / (world_size * -(-num_partitions // world_size))


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
