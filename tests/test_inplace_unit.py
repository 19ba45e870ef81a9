"""In-place recovery without Ray: the partition pool follows ownership changes step by step and
gives exactly the micro-batches of the fixed plan; what the mode does not do is refused by name;
a frozen replica's process is found and ended, never another."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
import torch
from test_plan import K, spec, table_of, write_rows

from elastic_train import load_config
from elastic_train.config import ConfigError
from elastic_train.data.blocks import BlockReader, iter_rank_steps
from elastic_train.data.plan import owned_partitions
from elastic_train.recovery.fence import MissingReplicas, end_process
from elastic_train.recovery.inplace import PartitionPool, _join_quorum
from elastic_train.recovery.replica import Replica
from elastic_train.training.checkpoint import snapshot, write_checkpoint
from elastic_train.training.step import TrainState

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
        (["train.grad_compression=bf16"], "train.grad_compression=bf16 with fault.recovery="
                                          "in_place: the replicas' gradients are summed exactly"),
        (["train.grad_compression=powersgd"], "set train.grad_compression=none"),
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


class _Manager:
    """torchft's Manager as `_join_quorum` uses it: `quorum` is what its next quorum does to the
    replica (a heal: load_state_dict of a peer's state) and whether it ends in an error."""

    def __init__(self, replica: Replica, participants: int) -> None:
        self.replica, self.participants = replica, participants
        self.quorum: tuple[dict | None, Exception | None] = (None, None)
        self.step, self.errors = replica.t.state.step, []

    def start_quorum(self) -> None:
        heal, self.error = self.quorum
        if heal is not None:
            self.replica.load_state_dict(heal)

    def errored(self) -> Exception | None:
        return self.error

    def report_error(self, exc: Exception) -> None:
        self.errors.append(exc)

    def should_commit(self) -> bool:
        return False

    def num_participants(self) -> int:
        return self.participants

    def load_state_dict(self, sd: dict) -> None:
        self.step = sd["step"]


class _Env(SimpleNamespace):
    joining, heal_first, startup = True, True, {}

    def run_finished(self):
        return None

    def latest_step(self):
        return 16  # the run's latest committed step, beyond its last checkpoint (12)

    def latest_checkpoint_dir(self):
        return self.checkpoint

    def log_event(self, record):
        self.events.append(record)

    def asked_for_quorum(self):  # what fault.wait_for_replacement_at_step waits for
        self.quorums_asked = getattr(self, "quorums_asked", 0) + 1


class _Pool:
    def at_epoch(self, epoch: int) -> None:
        pass

    def epoch_over(self, cursors) -> bool:
        return False


def _replica(step: int = 0, unrestored: bool = False) -> Replica:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    t = SimpleNamespace(raw_model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        state=TrainState(step=step), setup=SimpleNamespace(scaler=None))
    replica = Replica(t, unrestored=unrestored)
    replica.manager = _Manager(replica, participants=1)
    return replica


def test_a_replacement_heals_only_from_a_peer_that_holds_the_runs_state():
    """torchft heals every replica from the quorum's first when its highest step is 0 (its
    first-step sync). A replacement without the run's state refuses that from a peer as fresh as
    itself (issue 39: it then trained from step 0); it takes a heal from a peer that has the
    state, and a replica of a group start takes the first-step sync as before."""
    fresh, holder = _replica(unrestored=True), _replica(step=40)
    with torch.no_grad():
        holder.t.raw_model.weight.add_(1.0)
    assert fresh.state_dict()["holds_run_state"] is False
    fresh.load_state_dict(_replica(unrestored=True).state_dict())
    assert fresh.unrestored and fresh.heals == 0 and fresh.healed_from_step is None
    fresh.load_state_dict(holder.state_dict())
    assert not fresh.unrestored and fresh.healed_from_step == 40
    assert torch.equal(fresh.t.raw_model.weight, holder.t.raw_model.weight)
    starting = _replica()
    starting.load_state_dict(_replica().state_dict())
    assert starting.heals == 1 and starting.healed_from_step == 0


@pytest.mark.parametrize("participants", [1, 2])
def test_with_no_live_replica_holding_the_state_a_replacement_restores_at_once(tmp_path,
                                                                               participants):
    """The last replica with the run's state was lost before its replacement joined: every
    replica of the quorum is fresh (alone, or with another replacement whose first-step sync it
    refuses). It restores the last checkpoint (step 12) in that same quorum, without waiting for
    a heal that cannot come, and trains on from it at the next quorum, alone or not: it holds the
    newest state there is, not a state "behind the run" (the run got to step 16)."""
    saved = _replica(step=12)
    checkpoint = tmp_path / "checkpoint_000000012"
    write_checkpoint(snapshot(saved.t.raw_model, saved.t.optimizer, None,
                              {"step": 12, "epoch": 0, "step_in_epoch": 0}, {}, 2), checkpoint)
    env, cfg = _Env(checkpoint=str(checkpoint), events=[]), load_config(None, [])
    replica = _replica(unrestored=True)
    replica.manager.participants = participants
    if participants == 2:  # the other replacement is the quorum's first: its sync is refused
        replica.manager.quorum = (_replica(unrestored=True).state_dict(), None)
    far = time.monotonic() + 600  # a heal deadline far off: nothing waits for it
    assert _join_quorum(env, replica, cfg, _Pool(), True, far) == "wait"
    assert replica.t.state.step == 12 and replica.manager.step == 12 and not replica.unrestored
    assert len(replica.manager.errors) == 1  # this quorum trains no step
    restored = [e for e in env.events if e["event"] == "restored_instead_of_healing"]
    assert restored == [{"event": "restored_instead_of_healing", "step": 12,
                         "reason": "no live replica holds the run's state"}]
    assert torch.equal(replica.t.raw_model.weight, saved.t.raw_model.weight)
    replica.manager.quorum = (None, None)
    assert _join_quorum(env, replica, cfg, _Pool(), True, far) == "train"


def test_a_replacement_whose_heal_failed_waits_for_the_next_quorum_until_its_deadline(tmp_path):
    """A quorum with a peer to heal from whose heal failed (the peer died sending it): the next
    quorum may bring another; only past the deadline does the replacement restore instead. With
    nothing to restore at all (no checkpoint yet), it trains from the built state at once."""
    env, cfg = _Env(checkpoint=None, events=[]), load_config(None, [])
    replica = _replica(unrestored=True)
    replica.manager.quorum = (None, RuntimeError("the peer died sending the heal"))
    assert _join_quorum(env, replica, cfg, _Pool(), True, time.monotonic() + 600) == "wait"
    assert replica.unrestored and not env.events
    assert _join_quorum(env, replica, cfg, _Pool(), True, time.monotonic() - 1) == "wait"
    assert not replica.unrestored and env.events[0]["reason"] == "no heal within its deadline"
    assert env.quorums_asked == 1  # a replacement says so at its first quorum only
    fresh = _replica(unrestored=True)
    assert _join_quorum(env, fresh, cfg, _Pool(), True, time.monotonic() + 600) == "train"
    assert fresh.t.state.step == 0 and not fresh.manager.errors


class _InProcess:
    """A Ray actor handle over the real RunLog class in this process: `log.f.remote(...)` calls
    `f` at once (the returned value stands for its ObjectRef; `ray.get` is stubbed to return it)."""

    def __init__(self, log) -> None:
        self.log = log

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self.log, name))


def _replica_env(runlog: _InProcess, world_rank: int):
    """A worker's env as in place (`group` set), without Ray Train's context."""
    from elastic_train.cluster.worker import RayWorkerEnv

    env = RayWorkerEnv.__new__(RayWorkerEnv)
    env.runlog, env.world_rank, env.group, env.fatal = runlog, world_rank, "group-start", None
    return env


def _nonfinite_at(envs, step: int, pids: dict[int, int]) -> list[str]:
    """Every replica of one committed step reaches max_consecutive_skips at `step` at once (each
    on its own thread, as the RunLog's threads take their calls); what each raised."""
    from concurrent.futures import ThreadPoolExecutor

    from elastic_train.training.step import NonFiniteError

    def one(env) -> str:
        with pytest.raises(NonFiniteError) as raised:
            env.handle_nonfinite_in_place(step, pids, [7, 3, 5], whole_step=True)
        return str(raised.value)

    with ThreadPoolExecutor(len(envs)) as pool:
        return list(pool.map(one, envs))


def test_nonfinite_steps_in_place_roll_every_replica_back_then_stop_every_replica(tmp_path,
                                                                                  monkeypatch):
    """In place each replica's process group is itself alone: world rank 0's broadcast of its
    rollback claim reached no one, and every other replica took the first time for the second
    (the run stopped on those replicas, silently: no reason in the RunLog, nothing rolled back).
    Now the RunLog answers every replica of the step alike: all roll back the first time (all
    raise, so none is left to heal a replacement from the state past the skips), and when the
    replay (other processes) reaches the step again, all stop, the reason recorded once; a run
    resumed by a new driver remembers the rollback."""
    import ray

    from elastic_train.cluster.runlog import RunLog

    monkeypatch.setattr(ray, "get", lambda ref, **_: ref)
    log = RunLog.__ray_actor_class__(str(tmp_path / "run"))
    runlog = _InProcess(log)
    first = [_replica_env(runlog, rank) for rank in (0, 1)]
    raised = _nonfinite_at(first, 12, {0: 4100, 1: 4101})
    assert raised == ["non-finite gradients up to step 12: rolling back"] * 2
    assert [env.fatal for env in first] == [None, None]  # train_worker raises: Ray replaces them
    assert log.progress()["fatal"] is None

    replay = [_replica_env(runlog, rank) for rank in (0, 1)]  # the replacements, from the checkpoint
    raised = _nonfinite_at(replay, 12, {0: 4200, 1: 4201})
    reason = ("non-finite gradients at step 12 again after a rollback; the sample ids of that "
              "step's batch (3, every partition): [3, 5, 7]")
    assert raised == [reason] * 2 and [env.fatal for env in replay] == [reason] * 2
    assert log.progress()["fatal"] == reason  # before any replica returns from train_worker
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("step")) for e in events] == [("rollback", 12), ("fatal", None)]

    resumed = RunLog.__ray_actor_class__(str(tmp_path / "run"))  # a new driver: faults.json
    assert resumed.claim_rollback(12, "0:4300,1:4301", reason) == "fatal"
    assert resumed.claim_rollback(13, "0:4300,1:4301", reason) == "rollback"
