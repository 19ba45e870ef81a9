"""The per-worker training loop: build, restore, then for each step forward/backward, step, log.

It reads top to bottom like nanoGPT: `train_loop` -> `train_step` -> `forward_backward`. Everything
Ray-specific (checkpoints, data shard, logging actor) sits behind the `WorkerEnv` protocol (see
`worker.py`), so a step is plain torch and torch.distributed and runs in a 2-process gloo test
without Ray. The loop does not know which model it trains, nor its loss: both come in as a
`losses.LossModule` that maps a batch to (loss sum, targets).
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import psutil
import torch

from elastic_train.config import (
    Config,
    batch_tokens,
    num_partitions,
)
from elastic_train.data.batches import Prefetcher
from elastic_train.data.blocks import (
    BlockReader,
    check_cursors,
    iter_rank_steps,
    make_reader,
    plan_positions,
)
from elastic_train.data.plan import (
    StreamSpec,
    assign_blocks,
    owned_partitions,
    partition_balance,
    utilisation,
)
from elastic_train.observe.profile import StepProfiler
from elastic_train.observe.stragglers import RANK_BUSY, RANK_DATA_WAIT
from elastic_train.training.build import Training, build_training
from elastic_train.training.checkpoint import checkpoint_name, snapshot
from elastic_train.training.collectives import all_reduce_sum, collective_seconds, gather_from_all, rank_slots
from elastic_train.training.commhooks import (
    forget_powersgd_memory,
    powersgd_state_dict,
)
from elastic_train.training.env import WorkerEnv
from elastic_train.training.evaluate import run_eval
from elastic_train.training.losses import LossFn
from elastic_train.training.model import (
    BYTE_VOCAB,
    ModelFn,
    count_parameters,
    input_embedding_rows,
    model_flops_per_token,
)
from elastic_train.training.optim import (
    lr_at,
    optimizer_state_bytes,
)
from elastic_train.training.sharding import sharded_snapshot
from elastic_train.training.step import TrainState, dry_rank_batch, train_step


def stream_spec(cfg: Config) -> StreamSpec:
    return StreamSpec(num_partitions(cfg), batch_tokens(cfg)[0], cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)


def check_restored_position(cfg: Config, env: WorkerEnv, state: TrainState) -> None:
    """A restored data position must be the plan's for its step (blocks.check_cursors): each rank
    checks the partitions it owns at this world size, so together they check every one once.
    With data.on_change=keep_position (a resume onto other data, let through by the driver) the
    positions are the plan's of the data as it is now, after the saved step of the epoch: each
    rank sets those of its partitions (the next save gathers them all)."""
    if not state.step_in_epoch:
        return
    spec, reader = stream_spec(cfg), BlockReader(env.block_table)
    owned = owned_partitions(env.world_rank, env.world_size, num_partitions(cfg))
    if cfg.data.on_change == "keep_position":
        positions = plan_positions(reader, spec, partitions=owned, epoch=state.epoch,
                                   step_in_epoch=state.step_in_epoch)
        state.cursors.update((str(p), list(c)) for p, c in positions.items())
        return
    check_cursors(reader, spec, partitions=owned, epoch=state.epoch,
                  step_in_epoch=state.step_in_epoch,
                  cursors={int(p): (c[0], c[1]) for p, c in state.cursors.items()},
                  shown=checkpoint_name(state.step))


def _epoch_stream(cfg: Config, reader: BlockReader, state: TrainState, partitions: list[int]) -> Prefetcher:
    """This rank's steps of `state.epoch` from where the state says the run is, read ahead."""
    spec = stream_spec(cfg)
    cursors = {int(p): (c[0], c[1]) for p, c in state.cursors.items()}
    if state.step_in_epoch and not cursors:
        raise RuntimeError("checkpoint without data cursors mid-epoch (written by an older version)")
    return Prefetcher(
        iter_rank_steps(reader, spec, partitions=partitions, epoch=state.epoch, cursors=cursors,
                        pad_id=cfg.data.pad_id or 0),
        cfg.data.prefetch_steps,
    )


def _log_epoch_plan(env: WorkerEnv, cfg: Config, epoch: int) -> None:
    """How evenly the epoch's blocks fill the partitions (largest / mean tokens: the last steps,
    where smaller partitions are dry, leave ranks idle)."""
    k = num_partitions(cfg)
    assignment = assign_blocks(env.block_table.tokens, k, cfg.data.seed, epoch)
    env.log_event({"event": "epoch_plan", "epoch": epoch, "partitions": k,
                   "partition_balance": partition_balance(env.block_table.tokens, assignment),
                   "blocks_per_partition": min(len(a) for a in assignment)})


def _log_reads(env: WorkerEnv, attempt: int, reader: BlockReader) -> None:
    env.log_event({"event": "data_read", "attempt": attempt, "rank": env.world_rank,
                   "rows_read": reader.counter.rows, "bytes_read": reader.counter.bytes})


def _memory(process: psutil.Process) -> dict[str, int]:
    """The worker's resident memory, and the part of it that is its own: without the pages it
    shares (Ray's object store, mapped files), which grow as it touches more of them and are
    no leak of the process."""
    mem = process.memory_info()
    return {"rss_bytes": mem.rss, "rss_private_bytes": mem.rss - getattr(mem, "shared", 0)}


def train_loop(cfg: Config, env: WorkerEnv, model_fn: ModelFn | None = None,
               loss_fn: LossFn | None = None) -> None:
    """Run (or resume) training on this worker until max_steps or the last epoch."""
    t = build_training(cfg, env, model_fn, loss_fn)
    check_restored_position(cfg, env, t.state)
    state, rank, world_size = t.state, env.world_rank, env.world_size
    attempt = env.begin_attempt()
    partitions = owned_partitions(rank, world_size, num_partitions(cfg))
    flops_per_token = model_flops_per_token(cfg.model, cfg.data.max_seq_len, t.raw_model)
    process = psutil.Process()
    state_logged = False  # optimizer-state bytes per parameter, logged once per attempt
    reader = make_reader(cfg.data.reader, env.block_table, env.extra_columns,
                         input_embedding_rows(t.raw_model, cfg.model.vocab_size or BYTE_VOCAB))
    # the dry-rank step's row (see dry_rank_batch): a real micro-batch's once this process has
    # seen one; before that (a resume where this rank's data is used up) pad tokens, the extra
    # columns zeros of their own kinds, so that a user's loss indexes them as real ones
    template = dry_rank_batch(None, t.setup.pad_id, env.extra_columns, reader.extra_kinds())
    evaluating = env.eval_table is not None
    # the best checkpoint: rank 0 writes it, or with fsdp each rank its own rows (evaluate.py)
    writes_best = rank == 0 or t.setup.sharded is not None
    best = env.best_writer() if evaluating and cfg.checkpoint.keep_best and writes_best else None
    if best is not None:
        best.adopt(state)
    env.log_event({"event": "start", "attempt": attempt, "world_size": world_size,
                   "resumed_step": state.step, "rank": rank,
                   "utilisation": utilisation(num_partitions(cfg), world_size),
                   "build_peak_rss_bytes": t.build_peak_bytes})
    previous: tuple[float, float] | None = None  # this rank's (busy, data wait) of its last step
    tail_s = 0.0  # the last step's time after its record (the record's call, fault hooks)
    profiler = StepProfiler(cfg.log.profile_steps if rank == 0 else [], env.device)
    # a checkpoint request read at the empty step that ends an epoch: rank 0 has taken it (a
    # grow's, a drain's), so the next step saves for it
    carried = 0.0
    while state.step < cfg.train.max_steps and state.epoch < cfg.train.epochs:
        if rank == 0:
            _log_epoch_plan(env, cfg, state.epoch)
        stream = _epoch_stream(cfg, reader, state, partitions)
        try:
            while state.step < cfg.train.max_steps:
                t0, collective0 = time.perf_counter(), collective_seconds()
                env.step_began(state.step + 1)
                marked = profiler.step(state.step + 1)
                marked.__enter__()
                (micro_batches, cursors), wait_s = stream.next()
                env.startup.setdefault("first_batch", time.time())
                template = micro_batches[0] if micro_batches else template
                n_mb, targets, real, padded, rows, requested, *per_rank = all_reduce_sum(
                    [len(micro_batches), sum(mb.targets for mb in micro_batches),
                     sum(mb.real_tokens for mb in micro_batches),
                     sum(mb.padded_tokens for mb in micro_batches),
                     sum(len(mb.ids) for mb in micro_batches), env.checkpoint_requested(),
                     *rank_slots(world_size, rank, *(previous or (0.0, 0.0)))],
                    env.device,
                )
                requested, carried = requested or carried, 0.0  # the same on every rank
                if n_mb == 0:  # every rank's partitions are exhausted: the epoch is over
                    carried = requested
                    marked.__exit__(None, None, None)
                    state.epoch, state.step_in_epoch, state.cursors = state.epoch + 1, 0, {}
                    env.step_ended(None)
                    break
                lr = lr_at(state.step, cfg.optim, cfg.train.max_steps)
                result = train_step(
                    t.model, t.raw_model, t.optimizer, micro_batches, setup=t.setup,
                    data_targets=targets, step=state.step, lr=lr, dry_template=template,
                    poison=lambda m: env.maybe_poison_gradient(m, state.step + 1))
                if result.skipped:
                    forget_powersgd_memory(t.powersgd)
                elif rank == 0 and not state_logged:  # the state exists after the first step
                    state_logged = True
                    env.log_event({"event": "optimizer_state", "bytes_per_param":
                                   optimizer_state_bytes(t.optimizer) / count_parameters(t.raw_model)})
                if state.count_step(result.skipped, real, padded, rows,
                                    cfg.train.max_consecutive_skips, result.overflow):
                    env.handle_nonfinite(state.step, micro_batches)
                t.cursors = cursors
                env.log_consumed(attempt, state, micro_batches)
                step_time_s = time.perf_counter() - t0
                if rank == 0 and "first_step" not in env.startup:
                    env.startup["first_step"] = time.time()
                    env.log_event({"event": "startup", "attempt": attempt, **env.startup})
                if rank == 0:
                    env.log_step(_step_record(
                        state, attempt=attempt, world_size=world_size, loss=result.loss, lr=lr,
                        grad_norm=result.grad_norm, real_tokens=int(real), padded_tokens=int(padded),
                        step_time_s=step_time_s, data_wait_s=wait_s,
                        forward_backward_s=result.forward_backward_s, optimizer_s=result.optimizer_s,
                        # host overhead: neither data wait nor compute (the counters' all-reduce,
                        # bookkeeping, actor calls), this step's and the last one's tail
                        host_s=step_time_s - wait_s - result.forward_backward_s - result.optimizer_s
                        + tail_s,
                        tokens_per_s=real / step_time_s,
                        mfu=flops_per_token * real / step_time_s / (cfg.log.peak_flops * world_size),
                        **_memory(process), skipped=result.skipped, rows=int(rows),
                        micro_batches=int(n_mb), **_cuda_memory(env.device),
                        **(_rank_fields(per_rank, world_size) if previous else {}),
                    ))
                if t.compiled is not None:  # graphs this step compiled or loaded: an event
                    t.compiled.after_step(state.step, time.perf_counter() - t0, env.log_event)
                env.inject_faults(state.step)
                marked.__exit__(None, None, None)
                if (summary := profiler.after_step(state.step)) is not None:
                    env.log_event({"event": "profile", "step": state.step, **summary})
                step_s = time.perf_counter() - t0
                tail_s = step_s - step_time_s
                previous = (step_s - (collective_seconds() - collective0), wait_s)
                env.step_ended(step_s)
                if evaluating and cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0:
                    run_eval(cfg, env, t, partitions, attempt, best, rank == 0)  # between steps: no watchdog
                # not on the last step: the final save follows, with the final evaluation in it
                periodic = (cfg.checkpoint.every_steps and state.step < cfg.train.max_steps
                            and state.step % cfg.checkpoint.every_steps == 0)
                if periodic or requested:
                    # requested: the driver expects a resize; commit it before going on (SYNC)
                    _log_reads(env, attempt, reader)
                    save(env, cfg, t, final=False, sync=bool(requested))
                    if requested:
                        env.checkpoint_committed(state.step)
        finally:
            stream.close()
            reader.close()
    if evaluating and state.eval_step != state.step:  # the end, unless just evaluated
        run_eval(cfg, env, t, partitions, attempt, best, rank == 0)
    if best is not None:
        best.wait()
    _log_reads(env, attempt, reader)
    save(env, cfg, t, final=True)


def _step_record(state: TrainState, **fields: Any) -> dict[str, Any]:
    record = {"step": state.step, "epoch": state.epoch, "time": time.time()}
    record.update(fields)
    record.update(skipped_steps=state.skipped_steps)
    return record


def _rank_fields(per_rank: list[float], world_size: int) -> dict[str, list[float]]:
    """Every rank's busy time and data wait of the step before (see `timed_all_reduce`), gathered by
    this step's all-reduce."""
    return {RANK_BUSY: per_rank[:world_size], RANK_DATA_WAIT: per_rank[world_size:]}


def _cuda_memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"cuda_allocated_bytes": torch.cuda.memory_allocated(device),
            "cuda_reserved_bytes": torch.cuda.memory_reserved(device),
            "cuda_peak_allocated_bytes": torch.cuda.max_memory_allocated(device)}


def merge_cursors(saved: dict[str, list[int]], owned: list[dict[int, tuple[int, int]]]
                  ) -> dict[str, list[int]]:
    """Each partition's cursor from the rank that owns it (`owned`: every rank's own partitions'),
    carried from the last saved state where no rank spoke for it. Ranks own disjoint partitions,
    so no rank's value can overwrite another's."""
    merged = {int(p): list(c) for p, c in saved.items()}
    for part in owned:
        merged.update((int(p), list(c)) for p, c in part.items())
    return {str(p): c for p, c in sorted(merged.items())}


def save(env: WorkerEnv, cfg: Config, t: Training, final: bool, sync: bool = False) -> float:
    """Snapshot this rank's share (the blocking part) and hand it to Ray to write in the background."""
    state = t.state
    if state.step == env.last_saved_step:  # e.g. the final save right after a periodic one
        return 0.0
    t0 = time.perf_counter()
    if state.step_in_epoch:  # every partition's cursor, so any world size can resume
        state.cursors = merge_cursors(state.cursors, gather_from_all(t.cursors))
    # Every rank copies and writes its share of the replicated state, in parallel (checkpoint.py),
    # and its own PowerSGD state (error feedback), which only it has.
    comm_hook = None
    if t.powersgd is not None:
        comm_hook = {"kind": "powersgd", "world_size": env.world_size,
                     "state": powersgd_state_dict(t.powersgd)}
    if t.setup.sharded is not None:  # each rank holds, and writes, only its rows (sharding.py)
        snap = sharded_snapshot(t.raw_model, t.optimizer, asdict(state), cfg.to_dict(),
                                shard=env.world_rank, shards=env.world_size,
                                provenance=env.provenance, copy=not (final or sync))
    else:
        snap = snapshot(t.raw_model, t.optimizer, t.setup.scaler, asdict(state), cfg.to_dict(),
                        env.world_size, env.provenance, shard=env.world_rank, shards=env.world_size,
                        comm_hook=comm_hook)
    env.save_checkpoint(snap, state.step, final=final or sync)
    blocked_s = time.perf_counter() - t0
    if env.world_rank == 0:
        env.log_event({"event": "checkpoint", "step": state.step, "blocked_s": blocked_s,
                       "final": final})
    return blocked_s

