"""The batch plan and the block streams on real Parquet files: world-size invariance, exactly-once,
resume from cursors at any world size, reads that scale with the workers, padding."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from elastic_train.data.blocks import BlockReader, check_blocks, check_cursors, iter_rank_steps
from elastic_train.data.plan import (
    StreamSpec,
    assign_blocks,
    bucket_window,
    owned_partitions,
    partition_balance,
    utilisation,
    window_spans,
)
from elastic_train.data.rowgroups import DataError, build_block_table
from elastic_train.training.loop import merge_cursors

pytestmark = pytest.mark.unit

K = 8


def write_rows(folder, n: int, seed: int = 1, max_len: int = 64, rows_per_block: int = 40,
               files: int = 3) -> dict[int, int]:
    """Long-tailed lengths (lognormal, clipped) in `files` shards of `rows_per_block`-row groups;
    returns {id: length}."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.0, 0.9, n).astype(np.int64), 1, max_len)
    ids = rng.permutation(n).astype(np.int64) * 7 + 3  # arbitrary unique ids
    folder.mkdir(parents=True, exist_ok=True)
    for f, part in enumerate(np.array_split(np.arange(n), files)):
        tokens = [np.full(lengths[i], ids[i] % 256, dtype=np.int16) for i in part]
        table = pa.table({"id": ids[part], "tokens": tokens, "length": lengths[part].astype(np.int32)})
        pq.write_table(table, folder / f"part-{f:05d}.parquet", row_group_size=rows_per_block)
    return dict(zip(ids.tolist(), lengths.tolist(), strict=True))


def table_of(folder):
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    return build_block_table(pafs.LocalFileSystem(), files, files)


def spec(micro_batch_tokens: int = 256, window: int = 100, bucketing: bool = True) -> StreamSpec:
    return StreamSpec(K, micro_batch_tokens, window, seed=5, bucketing=bucketing)


def run_epoch(table, world_size: int, epoch: int = 0, cursors=None, stream_spec=None,
              until_step: int | None = None):
    """Global steps as {step: {partition: ids}}, the merged cursors after each step, and each
    rank's reader (its read counts)."""
    steps: dict[int, dict[int, list[int]]] = {}
    after: dict[int, dict] = {}
    readers = []
    first = 0 if cursors is None else None
    for rank in range(world_size):
        reader = BlockReader(table)
        readers.append(reader)
        it = iter_rank_steps(reader, stream_spec or spec(), partitions=owned_partitions(rank, world_size, K),
                             epoch=epoch, cursors=cursors)
        for step in itertools.count(first or 0):
            mbs, cursor = next(it)
            if not mbs or (until_step is not None and step > until_step):
                break
            after.setdefault(step, {}).update(cursor)
            for mb in mbs:
                steps.setdefault(step, {})[mb.partition] = mb.ids.tolist()
    return steps, after, readers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    lengths = write_rows(folder, 3000)
    return table_of(folder), lengths


@pytest.mark.parametrize("world_size", range(1, K + 1))
def test_steps_do_not_depend_on_world_size(data, world_size):
    table, _ = data
    assert run_epoch(table, world_size)[0] == run_epoch(table, 1)[0]


def test_every_sample_exactly_once_per_epoch_and_epochs_differ(data):
    table, lengths = data
    for epoch in (0, 1):
        ids = [i for step in run_epoch(table, 3, epoch=epoch)[0].values()
               for part in step.values() for i in part]
        assert sorted(ids) == sorted(lengths)
    assert run_epoch(table, 2, epoch=0)[0] != run_epoch(table, 2, epoch=1)[0]


@pytest.mark.parametrize("world_size, resumed_size, stop", [(2, 1, 5), (2, 3, 17), (4, 2, 1), (1, 8, 30)])
def test_resume_from_cursors_at_another_world_size(data, world_size, resumed_size, stop):
    """The cursors after step `stop` (gathered from all ranks) restart every partition where it
    was: the same steps follow, and each partition reads at most one window again."""
    table, _ = data
    full, after, _ = run_epoch(table, world_size)
    cursors = after[stop]
    resumed, _, readers = run_epoch(table, resumed_size, cursors=cursors)
    assert {s - stop - 1: v for s, v in full.items() if s > stop} == resumed
    rows_left = sum(len(ids) for s, parts in full.items() if s > stop for ids in parts.values())
    rows_read = sum(r.counter.rows for r in readers)
    window_rows = 100 + 40  # a window: >= 100 rows, plus at most one block
    assert rows_left <= rows_read <= rows_left + K * window_rows, (rows_left, rows_read)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_each_rank_reads_only_its_share(data, world_size):
    """Rows read by all ranks = rows in the data set (read amplification 1.0), each rank's reads
    within 1.1 x its share of the steps' rows."""
    table, lengths = data
    steps, _, readers = run_epoch(table, world_size)
    assert sum(r.counter.rows for r in readers) == len(lengths)
    for rank, reader in enumerate(readers):
        mine = set(owned_partitions(rank, world_size, K))
        share = sum(len(ids) for parts in steps.values() for p, ids in parts.items() if p in mine)
        assert reader.counter.rows <= 1.1 * share and reader.counter.bytes > 0


def test_partitions_are_balanced_by_tokens():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 5000, size=203)
    assignment = assign_blocks(tokens, K, seed=1, epoch=0)
    assert sorted(np.concatenate(assignment).tolist()) == list(range(203))
    totals = [int(tokens[a].sum()) for a in assignment]
    assert max(totals) - min(totals) <= tokens.max()
    assert 1.0 <= partition_balance(tokens, assignment) < 1.05
    assert [a.tolist() for a in assign_blocks(tokens, K, 1, 1)] != [a.tolist() for a in assignment]


def test_windows_mix_several_blocks():
    assert window_spans(np.array([40] * 7), 100) == [(0, 3), (3, 6), (6, 7)]
    assert window_spans(np.array([500, 10]), 100) == [(0, 1), (1, 2)]


def test_utilisation_per_world_size():
    assert utilisation(8, 8) == utilisation(8, 4) == 1.0
    assert utilisation(16, 7) == pytest.approx(16 / 21)
    assert utilisation(8, 3) == pytest.approx(8 / 9)


def test_micro_batches_respect_budget_and_pad_to_longest(data):
    table, lengths = data
    steps, _, _ = run_epoch(table, 2)
    assert steps
    for rank in range(2):
        it = iter_rank_steps(BlockReader(table), spec(), partitions=owned_partitions(rank, 2, K), epoch=0)
        while (mbs := next(it)[0]):
            for mb in mbs:
                assert mb.tokens.shape == (len(mb.ids), max(lengths[i] for i in mb.ids.tolist()))
                assert mb.tokens.size <= 256
                assert [lengths[i] for i in mb.ids.tolist()] == mb.lengths.tolist()
                for row, n in zip(mb.tokens, mb.lengths, strict=True):
                    assert not row[n:].any()


def test_last_partial_steps_and_few_blocks(tmp_path):
    # 16 blocks over 8 partitions (2 each): partitions run dry at different steps.
    lengths = write_rows(tmp_path / "few", 400, rows_per_block=25, files=2)
    table = table_of(tmp_path / "few")
    steps, _, _ = run_epoch(table, 2)
    assert sorted(i for s in steps.values() for v in s.values() for i in v) == sorted(lengths)
    assert run_epoch(table, 5)[0] == run_epoch(table, 8)[0] == steps
    sizes = [len(parts) for _, parts in sorted(steps.items())]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == K and sizes[-1] < K
    check_blocks(table, K, "few")
    with pytest.raises(ValueError, match="fewer than the 32 this run needs.*--rows-per-block"):
        check_blocks(table, 16, "few")


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


def efficiency(table, bucketing: bool) -> float:
    real = padded = 0
    stream_spec = StreamSpec(K, 2048, 1024, seed=0, bucketing=bucketing)
    for rank in range(2):
        it = iter_rank_steps(BlockReader(table), stream_spec, partitions=owned_partitions(rank, 2, K),
                             epoch=0)
        while (mbs := next(it)[0]):
            real += sum(mb.real_tokens for mb in mbs)
            padded += sum(mb.padded_tokens for mb in mbs)
    return real / padded


def test_padding_efficiency_on_embedded_corpus(tmp_path):
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.data.prepare import default_corpus_dir

    info = inspect_dataset(str(default_corpus_dir(512, cache_root=tmp_path)))
    table = build_block_table(info.filesystem, info.files, info.files)
    bucketed, random = efficiency(table, True), efficiency(table, False)
    assert bucketed >= 0.95, bucketed
    assert random < 0.75, random


@pytest.mark.parametrize("bad, message", [
    ("length", r"row group \d+, row \d+ \(id 7\): its length column says 99 but it has \d+ tokens"),
    ("token", r"row \d+ \(id 7\): token id 300 is outside the model's vocabulary of 256"),
    ("mask", r"row \d+ \(id 7\): its column 'loss_mask' holds 8 values for its 7 tokens"),
])
def test_a_bad_row_is_named_while_streaming(tmp_path, bad, message):
    from elastic_train.data.rowgroups import DataError

    lengths = np.array([5, 9, 3, 7] * 10)
    ids = np.arange(40) + 4
    tokens = [np.full(n, 1, dtype=np.int16) for n in lengths]
    masks = [np.ones(n, dtype=np.int8) for n in lengths]  # a loss mask another tool wrote
    if bad == "length":
        lengths[3] = 99
    elif bad == "token":
        tokens[3][2] = 300
    else:
        masks[3] = np.ones(8, dtype=np.int8)
    pq.write_table(pa.table({"id": ids, "tokens": tokens, "length": lengths.astype(np.int32),
                             "loss_mask": masks}),
                   tmp_path / "part-00000.parquet", row_group_size=10)
    table = table_of(tmp_path)
    reader = BlockReader(table, ("loss_mask",), vocab_rows=256)
    with pytest.raises(DataError, match=message):
        for mbs, _ in iter_rank_steps(reader, StreamSpec(2, 256, 20, seed=0), partitions=[0, 1], epoch=0):
            if not mbs:
                break


def test_foreign_parquet_with_huge_row_groups_is_refused_then_rechunked_by_prepare(tmp_path):
    """A data set of one row group per file gets one error naming the fix; `prepare` with that
    fix re-chunks it (every column and id kept) into a data set the plan accepts."""
    from elastic_train.cli import main
    from elastic_train.data.dataset import inspect_dataset

    lengths = write_rows(tmp_path / "foreign", 600, rows_per_block=1000, files=2)
    fix = "has 2 Parquet row groups.*elastic-train prepare .* --rows-per-block 37\\)"
    with pytest.raises(ValueError, match=fix):
        check_blocks(table_of(tmp_path / "foreign"), K, str(tmp_path / "foreign"))
    assert main(["prepare", str(tmp_path / "foreign"), "--output", str(tmp_path / "rechunked"),
                 "--rows-per-block", "30", "--engine", "local"]) == 0
    table = table_of(tmp_path / "rechunked")
    check_blocks(table, K, "rechunked")
    assert len(table) == 20 and set(table.rows.tolist()) == {30}
    steps, _, _ = run_epoch(table, 2)
    assert sorted(i for s in steps.values() for v in s.values() for i in v) == sorted(lengths)
    assert inspect_dataset(str(tmp_path / "rechunked")).max_token_id == 255


def train_in_legs(table, legs: list[tuple[int, int]]):
    """One epoch trained in legs, each at its own world size and each resumed from the cursors
    the leg before saved (merged from its ranks as the loop's `save` merges them): `legs` is
    [(world_size, steps trained when the leg stops)]. Returns {step: {partition: ids}} and the
    saved cursors after each leg."""
    steps: dict[int, dict[int, list[int]]] = {}
    saved: dict[str, list[int]] = {}
    checkpoints = []
    done = 0
    for world_size, stop in legs:
        owned = []
        restored = {int(p): (c[0], c[1]) for p, c in saved.items()}
        for rank in range(world_size):
            it = iter_rank_steps(BlockReader(table), spec(), partitions=owned_partitions(rank, world_size, K),
                                 epoch=0, cursors=restored)
            cursor = {}
            for step in range(done, stop):
                mbs, cursor = next(it)
                for mb in mbs:
                    steps.setdefault(step, {})[mb.partition] = mb.ids.tolist()
            owned.append(cursor)
        saved = merge_cursors(saved, owned)
        checkpoints.append((stop, saved))
        done = stop
    return steps, checkpoints


@pytest.mark.parametrize("seed", range(6))
def test_repeated_resumes_at_drawn_world_sizes_keep_every_cursor(data, seed):
    """Faults come in series: a seeded draw of 3-6 resumes, each at a world size drawn from 1-8
    and each from the cursors saved after the last one. Every saved cursor equals the
    uninterrupted run's at the same step, the steps are the same ids, and the plan's own
    arithmetic (check_cursors) accepts every saved position."""
    table, _ = data
    full, after, _ = run_epoch(table, 2)
    rng = np.random.default_rng(seed)
    stops = sorted(rng.choice(np.arange(1, len(full) - 1), size=int(rng.integers(3, 7)), replace=False))
    legs = [(int(rng.integers(1, K + 1)), int(s)) for s in stops] + [(int(rng.integers(1, K + 1)), len(full))]
    steps, checkpoints = train_in_legs(table, legs)
    assert steps == full
    for stop, saved in checkpoints[:-1]:
        assert saved == {str(p): list(c) for p, c in after[stop - 1].items()}, stop
        check_cursors(BlockReader(table), spec(), partitions=list(range(K)), epoch=0,
                      step_in_epoch=stop, cursors={int(p): tuple(c) for p, c in saved.items()},
                      shown="checkpoint_x")


def test_a_cursor_off_the_plan_is_refused_naming_the_checkpoint_and_partition(data):
    """A partition left at an earlier step (what a stale copy did to every later checkpoint) and
    a cursor edited by hand are each refused by the plan's arithmetic."""
    table, _ = data
    _, after, _ = run_epoch(table, 2)
    good = {p: tuple(c) for p, c in after[19].items()}
    check_cursors(BlockReader(table), spec(), partitions=list(range(K)), epoch=0, step_in_epoch=20,
                  cursors=good, shown="checkpoint_000000020")
    stale = {**good, 3: tuple(after[9][3])}
    edited = {**good, 5: (good[5][0], good[5][1] + 1)}
    for bad, partition in ((stale, 3), (edited, 5)):
        with pytest.raises(DataError, match=f"checkpoint_000000020: data partition {partition} is at .* not"):
            check_cursors(BlockReader(table), spec(), partitions=list(range(K)), epoch=0,
                          step_in_epoch=20, cursors=bad, shown="checkpoint_000000020")
    # each rank checks only its own partitions: rank 0 of 2 does not see partition 3 or 5
    check_cursors(BlockReader(table), spec(), partitions=owned_partitions(0, 2, K), epoch=0,
                  step_in_epoch=20, cursors=stale, shown="checkpoint_000000020")


def test_keep_position_resumes_mid_epoch_at_the_plans_place_in_the_data_as_it_is(small_dataset):
    """data.on_change=keep_position lets a resume onto other data (here another data.seed)
    through the driver; the workers then took the saved cursors, of the other plan, for the
    plan's and refused the checkpoint mid-epoch. They now start every partition where the
    plan of the data as it is stands after the saved step; without keep_position the check
    still refuses."""
    from types import SimpleNamespace

    from conftest import TINY

    from elastic_train.config import load_config
    from elastic_train.data.blocks import plan_positions
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.data.rowgroups import DataError
    from elastic_train.preflight.inputs import data_tables
    from elastic_train.training.loop import check_restored_position, stream_spec
    from elastic_train.training.step import TrainState

    def config(*extra: str):  # small windows: where a partition stands depends on the seed
        return load_config(None, [*TINY, f"data.path={small_dataset}", "data.shuffle_window=16",
                                  *extra])

    before = config()
    table = data_tables(before, inspect_dataset(small_dataset)).train
    env = SimpleNamespace(block_table=table, world_rank=0, world_size=1)
    partitions = list(range(stream_spec(before).num_partitions))
    saved = {str(p): list(c) for p, c in plan_positions(
        BlockReader(table), stream_spec(before), partitions=partitions, epoch=0,
        step_in_epoch=5).items()}
    check_restored_position(before, env, TrainState(step=5, step_in_epoch=5, cursors=saved))
    reseeded = config("data.seed=3")
    with pytest.raises(DataError, match="not at"):
        check_restored_position(reseeded, env, TrainState(step=5, step_in_epoch=5,
                                                          cursors=dict(saved)))
    kept = config("data.seed=3", "data.on_change=keep_position")
    state = TrainState(step=5, step_in_epoch=5, cursors=dict(saved))
    check_restored_position(kept, env, state)
    expected = plan_positions(BlockReader(table), stream_spec(kept), partitions=partitions,
                              epoch=0, step_in_epoch=5)
    assert state.cursors == {str(p): list(c) for p, c in expected.items()} != saved
