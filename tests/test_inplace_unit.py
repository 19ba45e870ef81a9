"""In-place recovery without Ray: the partition pool follows ownership changes step by step and
gives exactly the micro-batches of the fixed plan; what the mode does not do is refused by name;
a frozen replica's process is found and ended, never another."""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys

import psutil
import pytest
from test_plan import K, spec, table_of, write_rows

from elastic_train import load_config
from elastic_train.config import ConfigError
from elastic_train.data.blocks import BlockReader, iter_rank_steps
from elastic_train.data.plan import owned_partitions
from elastic_train.recovery.fence import MissingReplicas, end_process
from elastic_train.recovery.inplace import PartitionPool

pytestmark = pytest.mark.unit


def test_pool_gives_the_plans_micro_batches_whatever_the_owners(tmp_path):
    """Steps taken by 2, then 1 (a death), then 3 replicas, one step attempted and not committed:
    every step's micro-batches are those of the fixed plan, in the same rows, to the end of the
    epoch."""
    write_rows(tmp_path, 900)
    table, s = table_of(tmp_path), spec()
    steps = iter_rank_steps(BlockReader(table), s, partitions=list(range(K)), epoch=0)
    planned = [{mb.partition: mb.ids.tolist() for mb in step}
               for step in itertools.takewhile(bool, (step for step, _ in steps))]
    pools = [PartitionPool(BlockReader(table), s, 0) for _ in range(3)]
    for pool in pools:
        pool.at_epoch(0)
    cursors: dict[int, tuple[int, int]] = {}
    got = []
    step = 0
    while not pools[0].epoch_over(cursors):
        live = 2 if step < 5 else 1 if step < 9 else 3
        taken, after = {}, {}
        for rank in range(live):
            batches, mine = pools[rank].take(owned_partitions(rank, live, K), cursors)
            taken.update({mb.partition: mb.ids.tolist() for mb in batches})
            after.update(mine)
        if step == 7 and len(got) == 7:  # this attempt's all-reduce failed: not committed
            got.append(None)
            continue
        assert sorted(after) == list(range(K))
        cursors = after
        got.append(taken)
        step += 1
    assert [g for g in got if g is not None] == planned


def test_in_place_refuses_what_it_does_not_do():
    base = ["fault.recovery=in_place", "scaling.min_workers=2", "scaling.max_workers=2"]
    load_config(None, base)
    for extra, match in [
        (["scaling.max_workers=3"], "fixed worker count"),
        (["train.grad_reduce=ddp"], "train.grad_reduce=ddp is not supported"),
        (["data.reader=ray_data"], "data.reader=pyarrow"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, [*base, *extra])
    with pytest.raises(ConfigError, match="fault.recovery must be restart or in_place"):
        load_config(None, ["fault.recovery=sometimes"])
    with pytest.raises(ConfigError, match="test hook of fault.recovery=in_place"):
        load_config(None, ["fault.wait_for_replacement_at_step=3"])
    with pytest.raises(ConfigError, match="fault.fence_after_s applies to fault.recovery=in_place"):
        load_config(None, ["fault.fence_after_s=30"])
    with pytest.raises(ConfigError, match="fault.fence_after_s must be >= 1"):
        load_config(None, [*base, "fault.fence_after_s=0"])
    assert load_config(None, [*base, "fault.fence_after_s=30"]).fault.fence_after_s == 30


def test_a_replica_missing_past_the_deadline_is_due_once_and_never_its_replacement():
    """Ranks 0 and 1 (pid 11) take part, then rank 1 misses the steps: due once its absence
    reaches the deadline (asked between steps too: the survivor may be waiting), never again for
    that process; its replacement (pid 12) is not tracked before it takes part, and when it does
    the clock starts over."""
    now = [0.0]
    missing = MissingReplicas(after_s=10, clock=lambda: now[0])
    missing.observe({0: 10, 1: 11})
    for t, observe, due in [(1, True, []), (10.5, True, []), (11, False, [(1, 11, 10.0)]),
                            (30, True, []), (31, False, [])]:
        now[0] = t
        if observe:
            missing.observe({0: 10})
        assert missing.due() == due, t
    now[0] = 32
    missing.observe({0: 10, 1: 12})  # the replacement joined
    for t, observe, due in [(35, True, []), (44, False, []), (45, False, [(1, 12, 10.0)])]:
        now[0] = t  # ... and went missing too
        if observe:
            missing.observe({0: 10})
        assert missing.due() == due, t
    assert missing.due() == []


def test_end_process_kills_a_frozen_process_only_if_it_is_the_one_that_went_missing():
    """A real child process, stopped with SIGSTOP: a wrong start time (its pid reused by another
    process) leaves it alone; the right one ends it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.send_signal(signal.SIGSTOP)
        started = psutil.Process(child.pid).create_time()
        assert end_process(child.pid, started - 5) == "gone (its pid is another process's now)"
        assert child.poll() is None
        assert end_process(child.pid, started) == "killed"
        assert child.wait(timeout=30) == -signal.SIGKILL
        assert end_process(child.pid, started) == "gone"
    finally:
        child.kill()
        child.wait()
