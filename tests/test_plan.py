"""The batch plan and the data stream: world-size invariance, exactly-once, resume, padding."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from elastic_train.data import iter_parquet_batches, iter_rank_steps
from elastic_train.plan import bucket_window, owned_partitions, partition_of

pytestmark = pytest.mark.unit

K = 8


def synthetic_rows(n: int, seed: int = 1, max_len: int = 64):
    """Long-tailed lengths (lognormal, clipped), batched like a reader would."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.0, 0.9, n).astype(np.int64), 1, max_len)
    ids = rng.permutation(n).astype(np.int64) * 7 + 3  # arbitrary unique ids
    batches = []
    for start in range(0, n, 97):  # an odd batch size: batching must not matter
        sl = slice(start, start + 97)
        batches.append({"id": ids[sl], "length": lengths[sl],
                        "tokens": [np.full(k, i % 256) for i, k in zip(ids[sl], lengths[sl], strict=False)]})
    return batches, dict(zip(ids.tolist(), lengths.tolist(), strict=False))


def run_epoch(batches, world_size: int, start_step: int = 0, epoch: int = 0, bucketing=True,
              micro_batch_tokens: int = 256, window: int = 50):
    """Global steps as {step: sorted ids per partition}, assembled rank by rank."""
    steps: dict[int, dict[int, list[int]]] = {}
    for rank in range(world_size):
        it = iter_rank_steps(batches, partitions=owned_partitions(rank, world_size, K),
                             num_partitions=K, micro_batch_tokens=micro_batch_tokens,
                             shuffle_window=window, seed=5, epoch=epoch, bucketing=bucketing,
                             start_step=start_step)
        for step in itertools.count(start_step):
            mbs = next(it)
            if not mbs:
                # Once this rank is dry it stays dry: check a few more.
                assert all(not next(it) for _ in range(3))
                break
            for mb in mbs:
                steps.setdefault(step, {})[mb.partition] = mb.ids.tolist()
    return steps


@pytest.mark.parametrize("world_size", range(1, K + 1))
def test_steps_do_not_depend_on_world_size(world_size):
    batches, _ = synthetic_rows(3000)
    assert run_epoch(batches, world_size) == run_epoch(batches, 1)


def test_every_sample_exactly_once_per_epoch_and_epochs_differ():
    batches, lengths = synthetic_rows(2500)
    for epoch in (0, 1):
        ids = [i for step in run_epoch(batches, 3, epoch=epoch).values()
               for part in step.values() for i in part]
        assert sorted(ids) == sorted(lengths)
    assert run_epoch(batches, 2, epoch=0) != run_epoch(batches, 2, epoch=1)


@pytest.mark.parametrize("world_size, start", [(1, 5), (2, 17), (4, 1), (3, 30)])
def test_resume_mid_epoch_skips_exactly_the_trained_steps(world_size, start):
    batches, _ = synthetic_rows(2000)
    full = run_epoch(batches, 2)
    resumed = run_epoch(batches, world_size, start_step=start)
    assert resumed == {s: v for s, v in full.items() if s >= start}


def test_micro_batches_respect_budget_and_pad_to_longest():
    batches, lengths = synthetic_rows(1500)
    for rank in range(2):
        it = iter_rank_steps(batches, partitions=owned_partitions(rank, 2, K), num_partitions=K,
                             micro_batch_tokens=256, shuffle_window=64, seed=0, epoch=0)
        while mbs := next(it):
            for mb in mbs:
                assert mb.tokens.shape == (len(mb.ids), max(lengths[i] for i in mb.ids.tolist()))
                assert mb.tokens.size <= 256
                assert [lengths[i] for i in mb.ids.tolist()] == mb.lengths.tolist()
                for row, n in zip(mb.tokens, mb.lengths, strict=False):
                    assert not row[n:].any()


def test_last_partial_steps_and_empty_partitions():
    # 6 rows over 8 partitions: at least two partitions, and so some ranks, have nothing.
    batches, lengths = synthetic_rows(6)
    assert len(set(partition_of(np.array(list(lengths)), K).tolist())) < K
    steps = run_epoch(batches, 2)
    assert sorted(i for s in steps.values() for v in s.values() for i in v) == sorted(lengths)
    assert run_epoch(batches, 5) == run_epoch(batches, 8) == steps
    # Partitions run dry at different steps: the last steps are partial, and stay so.
    batches, _ = synthetic_rows(400)
    sizes = [len(parts) for _, parts in sorted(run_epoch(batches, 2).items())]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == K and sizes[-1] < K


def test_odd_lengths_single_rows_and_budget_edge():
    lengths = np.array([1, 256, 255, 3, 128, 129, 1, 2])
    out = bucket_window(lengths, 256, np.random.default_rng(0))
    assert sorted(np.concatenate(out).tolist()) == list(range(len(lengths)))
    assert all(len(b) * lengths[b].max() <= 256 for b in out)
    with pytest.raises(ValueError, match="exceeds micro_batch_tokens"):
        bucket_window(np.array([300]), 256, np.random.default_rng(0))


def test_owned_partitions_cover_all_once():
    for world_size in range(1, K + 1):
        owned = [p for r in range(world_size) for p in owned_partitions(r, world_size, K)]
        assert sorted(owned) == list(range(K))
    with pytest.raises(ValueError):
        owned_partitions(0, K + 1, K)


def efficiency(files, bucketing: bool) -> float:
    real = padded = 0
    batches = list(iter_parquet_batches(files))
    for rank in range(2):
        it = iter_rank_steps(batches, partitions=owned_partitions(rank, 2, K), num_partitions=K,
                             micro_batch_tokens=2048, shuffle_window=1024, seed=0, epoch=0,
                             bucketing=bucketing)
        while mbs := next(it):
            real += sum(mb.real_tokens for mb in mbs)
            padded += sum(mb.padded_tokens for mb in mbs)
    return real / padded


def test_padding_efficiency_on_embedded_corpus(tmp_path):
    from elastic_train.prepare import default_corpus_dir, inspect_dataset

    files = inspect_dataset(str(default_corpus_dir(512, cache_root=tmp_path))).files
    bucketed, random = efficiency(files, True), efficiency(files, False)
    assert bucketed >= 0.95, bucketed
    assert random < 0.75, random
