"""A grow of a running group waits for a checkpoint of the step it is at: the hold's bookkeeping
with a fake clock and a fake RunLog, and the Ray seams it is plugged into (they fail here, by
name, if a later Ray moves them; the Ray run is in test_elastic.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


class FakeRunLog:
    def __init__(self) -> None:
        self.asked: list[str] = []
        self.done_tickets: set[int] = set()
        self.events: list[dict] = []

    def ask(self, reason: str) -> int:
        self.asked.append(reason)
        return len(self.asked)

    def done(self, ticket: int) -> bool:
        return ticket in self.done_tickets


def hold_with(runlog: FakeRunLog, wait_s: float = 60.0):
    from elastic_train.cluster.nodewatch import GrowHold

    now = [0.0]
    hold = GrowHold(runlog.ask, runlog.done, runlog.events.append, wait_s=wait_s, clock=lambda: now[0])
    return hold, now


def test_a_grow_waits_for_the_checkpoint_it_asked_for():
    runlog = FakeRunLog()
    hold, now = hold_with(runlog)
    assert not hold.allow(group_start=1.0, from_workers=1, to_workers=2)
    assert runlog.asked == ["growing from 1 to 2 workers"]
    for t in (0.1, 5.0, 59.0):
        now[0] = t
        assert not hold.allow(1.0, 1, 2)
    assert runlog.asked == ["growing from 1 to 2 workers"]  # asked once, not at every poll
    runlog.done_tickets.add(1)
    assert hold.allow(1.0, 1, 2)
    assert runlog.events == []


def test_a_checkpoint_committed_before_the_ask_does_not_count():
    runlog = FakeRunLog()
    hold, now = hold_with(runlog)
    runlog.done_tickets.add(0)  # an earlier request, long committed
    assert not hold.allow(1.0, 1, 2)
    runlog.done_tickets.add(1)
    assert hold.allow(1.0, 1, 2)
    # the next grow (of the grown group, or after a clear) asks for a checkpoint of its own
    assert not hold.allow(2.0, 2, 3)
    assert runlog.asked == ["growing from 1 to 2 workers", "growing from 2 to 3 workers"]


def test_a_new_group_or_a_grow_no_longer_wanted_asks_again():
    runlog = FakeRunLog()
    hold, now = hold_with(runlog)
    assert not hold.allow(1.0, 1, 2)
    assert not hold.allow(7.0, 1, 2)  # the group restarted (a failure) meanwhile
    hold.clear()  # the node left again before the checkpoint
    assert not hold.allow(7.0, 1, 2)
    assert len(runlog.asked) == 3
    runlog.done_tickets.add(2)  # the stale ticket's checkpoint does not let the new ask through
    assert not hold.allow(7.0, 1, 2)
    runlog.done_tickets.add(3)
    assert hold.allow(7.0, 1, 2)


def test_a_grow_goes_ahead_after_the_wait_and_says_so():
    runlog = FakeRunLog()
    hold, now = hold_with(runlog, wait_s=30.0)
    assert not hold.allow(1.0, 1, 2)
    now[0] = 29.9
    assert not hold.allow(1.0, 1, 2)
    now[0] = 30.0
    assert hold.allow(1.0, 1, 2)
    assert runlog.events == [{"event": "grow_without_checkpoint", "waited_s": 30.0,
                              "from_workers": 1, "to_workers": 2}]


def test_the_ray_seams_the_hold_is_plugged_into_are_there():
    """Ray 2.60: the trainer passes its scaling policy to `_initialize_and_run_controller`, an
    elastic ScalingConfig gets `ElasticScalingPolicy`, whose running-group decision we wrap."""
    import inspect

    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import create_scaling_policy

    from elastic_train.cluster.driver import Trainer
    from elastic_train.cluster.nodewatch import CheckpointBeforeGrow, ElasticScalingPolicy

    source = inspect.getsource(Trainer.__mro__[1].fit)
    assert "self._initialize_and_run_controller(" in source and "scaling_policy=" in source
    policy = create_scaling_policy(ScalingConfig(num_workers=(1, 2)))
    assert type(policy) is ElasticScalingPolicy
    assert "_latest_monitor_time" in vars(policy)  # reset by CheckpointBeforeGrow while it holds
    assert issubclass(CheckpointBeforeGrow, type(policy))


def test_a_request_read_at_the_step_that_ends_an_epoch_is_saved_for_at_the_next(small_dataset):
    """The loop reads the checkpoint request at every step's all-reduce, the empty one that ends
    an epoch included, and rank 0 has taken the request then (a grow's ticket, a drain notice
    marked seen): that step ends the epoch without saving, so the next step saves and commits
    for it. (It was dropped: the grow waited its 120 s and restarted from an older checkpoint.)"""
    from conftest import TINY
    from localenv import LocalEnv, train_locally

    from elastic_train.config import load_config

    class AskAtTheEpochsEnd(LocalEnv):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.began: list[int] = []
            self.committed: list[int] = []
            self.saved: list[int] = []

        def step_began(self, step: int) -> None:
            self.began.append(step)

        def checkpoint_requested(self) -> bool:  # once: when step ask_at is first begun
            return self.began[-1:] == [self.ask_at] and self.began.count(self.ask_at) == 1

        def save_checkpoint(self, snap, step: int, final: bool) -> None:
            super().save_checkpoint(snap, step, final)
            self.saved.append(step)

        def checkpoint_committed(self, step: int) -> None:
            self.committed.append(step)

    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.preflight.inputs import data_tables, table_horizon

    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", "train.epochs=2",
                             "train.max_steps=1000", "checkpoint.every_steps=0"])
    one = load_config(None, [*TINY, f"data.path={small_dataset}", "train.epochs=1"])
    epoch_end = table_horizon(one, data_tables(one, inspect_dataset(small_dataset)).train).total
    AskAtTheEpochsEnd.ask_at = epoch_end + 1  # the empty step is begun as step epoch_end + 1
    env = train_locally(cfg, env_cls=AskAtTheEpochsEnd)
    assert max(r["step"] for r in env.steps if r["epoch"] == 0) == epoch_end
    assert env.began.count(epoch_end + 1) == 2  # the empty step, then the first of epoch 1
    assert env.committed == [epoch_end + 1] and epoch_end + 1 in env.saved
