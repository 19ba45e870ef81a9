"""In-place recovery (`fault.recovery=in_place`): a lost worker is replaced while the others train on.

Each Ray Train worker is a torchft replica group of one (Ray's `TorchftConfig`: a lighthouse actor
forms a quorum of the live replicas before every step). A step is still all K canonical partitions
(plan.py), whatever the number of live replicas: the quorum's participants own them by their rank
among the participants, so when a worker dies the survivors take its partitions over at the next
step, from the cursors every replica holds. Everything a step exchanges rides in one float64 SUM
all-reduce through the torchft Manager: the gradient sums (`loop.ExactGradSum`), the loss and
target counts, the token and row counts, and every partition's cursor after the step. The gradient
is divided by the summed target count after the reduce, so a step's update is the same to the bit
at any number of participants. A step whose all-reduce failed (a peer died in it) is not committed
(`should_commit`): nothing changes, and the next quorum trains it again from the same cursors, so
every sample is trained exactly once. A replacement that Ray starts heals from a live peer inside
the quorum (torchft's checkpoint transport: model, optimizer, counters and all cursors) and takes
part in the same step; when no live replica holds the run's state (the last one was lost before
the replacement joined), the replacements restore the last checkpoint at once (replica.py).

What stays as in `restart` mode: checkpoints (now written by one replica, whole, and reported by
every worker only at steps where every worker took part), so that a whole-cluster loss or a run
resumed by name continues from them; metrics, events and consumed ids through the RunLog.

Ray 2.60 replaces a failing replica group in place only while the worker count is unchanged, and
turns its preemption watcher off in this mode: runs in this mode have a fixed worker count
(config/validate.py refuses min != max), and a drained node is a death like any other. The driver's side
(Ray's torchft backend, told apart from a group start and a replacement) is `inplace_ray.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.distributed import ReduceOp

from elastic_train.config import Config, batch_tokens, num_partitions
from elastic_train.data.batches import MicroBatch
from elastic_train.data.blocks import BlockReader, Cursor, PartitionStream, make_reader
from elastic_train.data.plan import StreamSpec, assign_blocks, owned_partitions
from elastic_train.recovery.fence import Fencer
from elastic_train.recovery.replica import (
    STALE_POLL_S,
    InPlaceEnv,
    Replica,
    behind_the_run,
    settle_unrestored,
    start_manager,
)
from elastic_train.training.build import Training, build_training
from elastic_train.training.checkpoint import BestCheckpointWriter, snapshot
from elastic_train.training.evaluate import run_eval
from elastic_train.training.loop import _log_reads, check_restored_position, stream_spec
from elastic_train.training.losses import LossFn
from elastic_train.training.model import (
    BYTE_VOCAB,
    ModelFn,
    input_embedding_rows,
    model_flops_per_token,
)
from elastic_train.training.optim import lr_at, set_lr
from elastic_train.training.step import TrainState, accumulate, optimizer_step

SLOTS = ("loss", "targets", "real", "padded", "rows", "micro_batches")
# a replacement that skipped its restore waits this many fault.in_place_timeout_s for a peer to
# heal from when its heals fail (a heal takes at most one), then restores the last checkpoint
HEAL_WAIT_TIMEOUTS = 3


class PartitionPool:
    """The partitions this replica trains at a step, each read from the committed cursor on.

    Ownership changes with the quorum, so streams are opened per partition: a partition whose
    stream already stands at the asked cursor goes on from it, any other is opened there (at
    most one window read again). A step that was not committed asks again for the same cursors."""

    def __init__(self, reader: BlockReader, spec: StreamSpec, pad_id: int) -> None:
        self.reader, self.spec, self.pad_id = reader, spec, pad_id
        self.epoch = -1
        self.streams: list[PartitionStream] = []
        self.open: dict[int, tuple[Cursor, Iterator[tuple[MicroBatch, Cursor]]]] = {}

    def at_epoch(self, epoch: int) -> None:
        if epoch == self.epoch:
            return
        assignment = assign_blocks(self.reader.table.tokens, self.spec.num_partitions,
                                   self.spec.seed, epoch)
        self.streams = [PartitionStream(p, assignment[p], self.spec, epoch, self.reader, self.pad_id)
                        for p in range(self.spec.num_partitions)]
        self.epoch, self.open = epoch, {}

    def epoch_over(self, cursors: dict[int, Cursor]) -> bool:
        return all(cursors.get(s.partition, (0, 0)) == s.done for s in self.streams)

    def take(self, partitions: list[int], cursors: dict[int, Cursor]
             ) -> tuple[list[MicroBatch], dict[int, Cursor]]:
        """One micro-batch of each of `partitions` that has one left, and their cursors after."""
        batches, after = [], {}
        for p in partitions:
            cursor = cursors.get(p, (0, 0))
            held = self.open.pop(p, None)
            if cursor == self.streams[p].done:
                after[p] = cursor
                continue
            it = held[1] if held is not None and held[0] == cursor else self.streams[p].iter_from(cursor)
            item = next(it, None)
            if item is None:
                after[p] = self.streams[p].done
                continue
            mb, after[p] = item
            batches.append(mb)
            self.open[p] = (after[p], it)
        for p in [p for p in self.open if p not in partitions]:
            del self.open[p]
        return batches, after


def state_cursors(state: TrainState) -> dict[int, Cursor]:
    return {int(p): (c[0], c[1]) for p, c in state.cursors.items()}


@dataclass(frozen=True)
class Layout:
    """The float64 slots after the gradient in a step's all-reduce: SLOTS; (window, taken) of
    every partition's cursor after the step (summed: each partition has one owner); each world
    rank's pid, 0 for a rank not taking part (fence.py); with data.record_ids, each partition's
    sample ids + 1 (0: no row; a micro-batch has at most micro_batch_tokens rows), so that any
    participant can log the whole step, and a replica lost right after it leaves no gap."""

    partitions: int
    world_size: int
    ids_per_partition: int  # 0: ids not recorded

    @classmethod
    def of(cls, cfg: Config, world_size: int) -> Layout:
        return cls(num_partitions(cfg), world_size,
                   batch_tokens(cfg)[0] if cfg.data.record_ids else 0)

    @property
    def cursors(self) -> int:
        return len(SLOTS)

    @property
    def pids(self) -> int:
        return self.cursors + 2 * self.partitions

    @property
    def ids(self) -> int:
        return self.pids + self.world_size

    @property
    def size(self) -> int:
        return self.ids + self.partitions * self.ids_per_partition


@dataclass
class ReducedStep:
    """A committed step, as every participant has it after the all-reduce."""

    loss: float  # per target, over all participants
    real: float
    padded: float
    rows: float
    micro_batches: float
    cursors: dict[str, list[int]]  # every partition's, after the step
    pids: dict[int, int]  # world rank: pid, of the participants
    ids: list[int] | None  # the step's sample ids, every partition's (data.record_ids)
    grad_norm: float
    skipped: bool
    forward_backward_s: float
    optimizer_s: float


def in_place_step(t: Training, manager: Any, env: InPlaceEnv, layout: Layout,
                  micro_batches: list[MicroBatch], after: dict[int, Cursor], *, lr: float,
                  grad_clip: float) -> ReducedStep | None:
    """This replica's micro-batches of step `t.state.step + 1`: gradient sums and counts into the
    float64 buffer, one SUM all-reduce through the Manager, and, if the quorum commits the step,
    the update (None if it does not: nothing changed, the step is trained again)."""
    state, reducer = t.state, t.setup.exact
    set_lr(t.optimizer, lr)
    t.optimizer.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    loss, targets = accumulate(t.model, micro_batches, setup=t.setup, scale=1.0, step=state.step)
    extra, n, k = reducer.extra, layout.cursors, layout.partitions
    extra[:n] = torch.tensor(
        [float(loss), float(targets), sum(mb.real_tokens for mb in micro_batches),
         sum(mb.padded_tokens for mb in micro_batches), sum(len(mb.ids) for mb in micro_batches),
         len(micro_batches)], dtype=torch.float64)
    for p, (window, taken) in after.items():
        extra[n + 2 * p: n + 2 * p + 2] = torch.tensor([window, taken], dtype=torch.float64)
    extra[layout.pids + env.world_rank] = os.getpid()
    if layout.ids_per_partition:
        for mb in micro_batches:
            start = layout.ids + mb.partition * layout.ids_per_partition
            extra[start: start + len(mb.ids)] = torch.from_numpy(mb.ids.astype("float64") + 1)
    manager.allreduce(reducer.buffer, reduce_op=ReduceOp.SUM).wait()
    if not manager.should_commit():
        reducer.buffer.zero_()
        t.optimizer.zero_grad(set_to_none=True)
        return None
    t1 = time.perf_counter()
    sums = reducer.extra.tolist()
    loss_sum, total_targets, real, padded, rows, n_mb = sums[:n]
    cursors = {str(p): [int(sums[n + 2 * p]), int(sums[n + 2 * p + 1])] for p in range(k)}
    pids = {rank: int(pid) for rank, pid in enumerate(sums[layout.pids:layout.ids]) if pid}
    ids = [int(i) - 1 for i in sums[layout.ids:] if i] if layout.ids_per_partition else None
    reducer.set_grads(divisor=max(total_targets, 1.0))
    env.maybe_poison_gradient(t.raw_model, state.step + 1)
    # every replica holds the same reduced gradient: the same norm and skip decision, no
    # collective (the default process group is this replica group of one)
    _, grad_norm, skipped = optimizer_step(t.raw_model, t.optimizer, None, grad_clip,
                                           torch.tensor(loss_sum), env.device, exact=True)
    return ReducedStep(loss_sum / max(total_targets, 1.0), real, padded, rows, n_mb, cursors, pids,
                       ids, grad_norm, skipped, t1 - t0, time.perf_counter() - t1)


@dataclass
class ReplicaRun:
    """What one replica's loop holds from its start to its end (`start_replica`)."""

    cfg: Config
    env: InPlaceEnv
    t: Training
    replica: Replica
    layout: Layout
    reader: BlockReader
    pool: PartitionPool
    attempt: int
    flops_per_token: float
    best: BestCheckpointWriter | None = None  # made by the first replica that logs an evaluation
    committed_here: int = 0  # steps this process committed
    seen: tuple[int, int] | None = None  # the last (quorum id, participants) logged
    prank: int | None = None  # this replica's rank among the last quorum's participants


def start_replica(cfg: Config, env: InPlaceEnv, model_fn: ModelFn | None,
                  loss_fn: LossFn | None) -> ReplicaRun:
    """Build (restoring the last checkpoint, unless a live peer is to heal this replacement),
    start the Manager, join the attempt, open the data; log the start."""
    layout = Layout.of(cfg, env.world_size)
    # a replacement while a peer trains heals from it at the run's current step: restoring the
    # last checkpoint first would only cost time (issue 32: ten replacements each read one)
    env.heal_first = env.joining and env.run_finished() is None and env.latest_step() is not None
    t = build_training(cfg, env, model_fn, loss_fn, reduce_extra=layout.size)
    check_restored_position(cfg, env, t.state)
    replica = Replica(t, unrestored=env.heal_first)
    start_manager(cfg, env, replica)
    attempt = env.begin_attempt()
    reader = make_reader("pyarrow", env.block_table, env.extra_columns,
                         input_embedding_rows(t.raw_model, cfg.model.vocab_size or BYTE_VOCAB))
    pool = PartitionPool(reader, stream_spec(cfg), cfg.data.pad_id or 0)
    flops_per_token = model_flops_per_token(cfg.model, cfg.data.max_seq_len, t.raw_model)
    env.log_event({"event": "start", "attempt": attempt, "world_size": env.world_size,
                   "resumed_step": t.state.step, "rank": env.world_rank, "recovery": "in_place",
                   "joining": env.joining, "build_peak_rss_bytes": t.build_peak_bytes})
    return ReplicaRun(cfg, env, t, replica, layout, reader, pool, attempt, flops_per_token)


def in_place_loop(cfg: Config, env: InPlaceEnv, model_fn: ModelFn | None = None,
                  loss_fn: LossFn | None = None) -> None:
    """Run (or resume) training on this worker as one replica among the live ones."""
    run = start_replica(cfg, env, model_fn, loss_fn)
    fencer = Fencer(env.fence_after_s, lambda rank, pid, missing_s: _fence(env, rank, pid, missing_s))
    stale_deadline = time.monotonic() + cfg.scaling.collective_timeout_s
    heal_deadline = time.monotonic() + HEAL_WAIT_TIMEOUTS * cfg.fault.in_place_timeout_s
    try:
        while not _advance(run.t.state, cfg, run.pool):
            env.step_began(run.t.state.step + 1)
            t0 = time.perf_counter()
            stale = run.committed_here == 0 and time.monotonic() < stale_deadline
            verdict = _join_quorum(env, run.replica, cfg, run.pool, stale, heal_deadline)
            if verdict == "over":
                env.step_ended(None)
                break
            if verdict != "train" or not _train_step(run, fencer, t0):
                env.step_ended(None)
                continue
            env.inject_faults(run.t.state.step)
            env.step_ended(time.perf_counter() - t0)
            _after_step(run)
        _finish(run)
    finally:
        fencer.stop()


def _train_step(run: ReplicaRun, fencer: Fencer, t0: float) -> bool:
    """Step `state.step + 1` with this quorum's participants: this replica's partitions, the
    all-reduce, the update, the step's record. False if the quorum did not commit it."""
    cfg, env, manager = run.cfg, run.env, run.replica.manager
    n, run.prank = manager.num_participants(), manager.participating_rank()
    env.participating_rank = run.prank
    if (manager._quorum_id, n) != run.seen:  # torchft 0.2.0 keeps the quorum id private
        run.seen = (manager._quorum_id, n)
        env.log_event({"event": "quorum", "step": run.t.state.step + 1, "participants": n,
                       "participating_rank": run.prank, "quorum_id": run.seen[0]})
    state = run.t.state  # after the quorum: a heal replaces it
    t_data = time.perf_counter()
    owned = owned_partitions(run.prank, n, run.layout.partitions) if run.prank is not None else []
    micro_batches, after = run.pool.take(owned, state_cursors(state))
    wait_s = time.perf_counter() - t_data
    lr = lr_at(state.step, cfg.optim, cfg.train.max_steps)
    r = in_place_step(run.t, manager, env, run.layout, micro_batches, after, lr=lr,
                      grad_clip=cfg.train.grad_clip)
    if r is None:
        env.log_event({"event": "step_not_committed", "step": state.step + 1,
                       "participants": n, "error": repr(manager.errored())[:300]})
        return False
    state.cursors = r.cursors
    if state.count_step(r.skipped, r.real, r.padded, r.rows, cfg.train.max_consecutive_skips):
        # roll back or stop, as the RunLog answers every replica of this step alike (raises)
        whole = r.ids is not None or n == 1  # the step's ids, or this replica's, the step's alone
        ids = r.ids if r.ids is not None else [int(i) for mb in micro_batches for i in mb.ids]
        env.handle_nonfinite_in_place(state.step, r.pids, ids, whole_step=whole)
    run.committed_here += 1
    fencer.observe(r.pids, acting=run.prank == 0)
    step_time_s = time.perf_counter() - t0
    # every participant sends it (the RunLog keeps the first): a replica lost right after the
    # step leaves no gap in metrics.jsonl or consumed/
    env.log_committed({"step": state.step, "epoch": state.epoch, "time": time.time(),
                       "attempt": run.attempt, "world_size": n, "loss": r.loss, "lr": lr,
                       "grad_norm": r.grad_norm, "real_tokens": int(r.real),
                       "padded_tokens": int(r.padded), "step_time_s": step_time_s,
                       "data_wait_s": wait_s, "quorum_s": t_data - t0,
                       "forward_backward_s": r.forward_backward_s, "optimizer_s": r.optimizer_s,
                       "tokens_per_s": r.real / step_time_s,
                       "mfu": run.flops_per_token * r.real / step_time_s / (cfg.log.peak_flops * n),
                       "skipped": r.skipped, "rows": int(r.rows),
                       "micro_batches": int(r.micro_batches), "logged_by": env.world_rank,
                       "skipped_steps": state.skipped_steps, "recovery": "in_place"}, r.ids)
    return True


def _after_step(run: ReplicaRun) -> None:
    """A committed step's evaluation and periodic checkpoint, when due."""
    cfg, env, state = run.cfg, run.env, run.t.state
    if run.env.eval_table is not None and cfg.eval.every_steps \
            and state.step % cfg.eval.every_steps == 0:
        run.best = _evaluate(cfg, env, run.t, run.attempt, run.best)
    every = cfg.checkpoint.every_steps
    if every and state.step % every == 0:
        _log_reads(env, run.attempt, run.reader)
        # the step's first participant: one lost right after committing the step leaves it to the
        # next periodic checkpoint or the final one (claimed: `_finish`), a replay at most
        save_in_place(env, cfg, run.t, writer=run.prank == 0, final=False)


def _finish(run: ReplicaRun) -> None:
    """The run's end as this replica sees it: the final evaluation, and the final checkpoint
    reported by every worker (Ray's report is a barrier of them all)."""
    cfg, env, t = run.cfg, run.env, run.t
    run.replica.manager.shutdown(wait=False)
    env.wait_for_checkpoints()
    run.reader.close()
    _log_reads(env, run.attempt, run.reader)
    if env.joining and not run.committed_here:
        # a replacement that found the run over joins the others' final report, without a
        # share; always, also when it restored that very step (the final step's periodic
        # checkpoint), which save_checkpoint would take for saved already and skip: the
        # others then waited in Ray's report barrier for ever (issue 32, found by killing 8
        # replacements in a row, the 9th starting after the last step)
        env.last_saved_step = -1
        env.save_checkpoint(None, env.run_finished(), final=True)
        return
    if env.eval_table is not None and t.state.eval_step != t.state.step:  # unless just evaluated
        run.best = _evaluate(cfg, env, t, run.attempt, run.best)
    if run.best is not None:
        run.best.wait()
    env.mark_finished(t.state.step)  # a replacement that starts from now on only reports
    # the first replica here writes: alive now (the last step's first participant may have died
    # right after committing it, and nobody wrote the run's last checkpoint)
    writer = env.claim_writer("final", run.attempt, t.state.step)
    save_in_place(env, cfg, t, writer=writer, final=True)


def _join_quorum(env: InPlaceEnv, replica: Replica, cfg: Config, pool: PartitionPool,
                 may_be_stale: bool, heal_deadline: float) -> str:
    """This step's quorum (a replica behind the others heals inside it): "train", "wait" (a
    replacement alone and behind the run: its peers come to the next quorum, so it never trains
    the run again; `may_be_stale` is False once it committed a step, or past its deadline, when
    every other replica was lost too; or a replacement not healed yet, see `settle_unrestored`)
    or "over" (the run ended while it started)."""
    manager = replica.manager
    if env.joining and not replica.quorum_announced:  # before: start_quorum waits for the quorum
        replica.quorum_announced = True
        env.asked_for_quorum()
    manager.start_quorum()
    if replica.healed_from_step is not None:
        age_s = time.time() - env.startup.get("process_start", time.time())
        env.log_event({"event": "healed", "step": replica.healed_from_step,
                       "process_age_s": round(age_s, 3)})
        replica.healed_from_step = None
        if _advance(replica.t.state, cfg, pool):  # a peer's state (never past the end: it is here)
            return "over"
    if replica.unrestored:
        return settle_unrestored(env, replica, cfg, heal_deadline)
    behind = (env.joining and may_be_stale and not replica.heals and not replica.restored_for_all
              and manager.num_participants() == 1 and behind_the_run(env, replica.t.state))
    if not behind:
        return "train"
    manager.report_error(RuntimeError("a replacement alone, behind the run"))
    manager.should_commit()  # False: the step count stays as it was
    if env.run_finished() is not None:
        return "over"
    time.sleep(STALE_POLL_S)
    return "wait"


def _fence(env: InPlaceEnv, rank: int, pid: int, missing_s: float) -> None:
    """End a replica's process that no step has seen for env.fence_after_s (fence.py)."""
    env.log_event({"event": "fencing", "lost_rank": rank, "lost_pid": pid,
                   "missing_s": round(missing_s, 1)})
    env.fence(rank, pid, missing_s)


def _evaluate(cfg: Config, env: InPlaceEnv, t: Training, attempt: int,
              best: BestCheckpointWriter | None) -> BestCheckpointWriter | None:
    """Every replica evaluates every partition itself, with no collective (a lost replica cannot
    hold the others in one): the same result on each, and at any number of replicas; it costs each
    replica the whole evaluation. Every replica sends the record (the RunLog keeps the first: a
    replica lost right after leaves no gap); the first to claim a new best writes it (one fixed
    in advance may die in the evaluation, and nobody wrote it: the best pointer stayed older)."""
    if best is None and cfg.checkpoint.keep_best:
        best = env.best_writer()
    step = t.state.step
    run_eval(cfg, env, t, list(range(num_partitions(cfg))), attempt, best, True,
             claim=lambda: env.claim_writer("best", attempt, step))
    return best


def _advance(state: TrainState, cfg: Config, pool: PartitionPool) -> bool:
    """Move to the next epoch when every partition's cursor is at its end; True when the run is
    over (max_steps or the last epoch). Every replica decides alike from the committed state."""
    while state.step < cfg.train.max_steps and state.epoch < cfg.train.epochs:
        pool.at_epoch(state.epoch)
        if not pool.epoch_over(state_cursors(state)):
            return False
        state.epoch, state.step_in_epoch, state.cursors = state.epoch + 1, 0, {}
    return True


def save_in_place(env: InPlaceEnv, cfg: Config, t: Training, *, writer: bool, final: bool) -> None:
    """One replica, `writer` (a live participant), saves the whole state (one shard: every
    replica holds all of it, cursors of every partition included), so a resume at any world size,
    in either mode, reads it. A periodic checkpoint is written outside Ray's report barrier
    (recovery/checkpoints.py: a barrier would wait for replicas outside the quorum); the final one
    is reported by every worker, so Ray's result names it."""
    state = t.state
    if not final and not writer:
        return
    t0 = time.perf_counter()
    snap = None
    if writer:
        snap = snapshot(t.raw_model, t.optimizer, t.setup.scaler, asdict(state), cfg.to_dict(),
                        env.world_size, env.provenance, shard=0, shards=1)
    if final:
        env.save_checkpoint(snap, state.step, final=True)
    else:
        env.save_in_place(snap, state.step)
    if writer:
        env.log_event({"event": "checkpoint", "step": state.step, "final": final,
                       "blocked_s": time.perf_counter() - t0})
