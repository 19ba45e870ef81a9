"""Held-out evaluation: the loss over the eval blocks, summed in float64 over every rank, and the
best checkpoint it may make."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from elastic_train.config import (
    Config,
    batch_tokens,
    num_partitions,
)
from elastic_train.data.blocks import BlockReader, iter_rank_steps, make_reader
from elastic_train.data.plan import (
    StreamSpec,
)
from elastic_train.training.build import Training
from elastic_train.training.checkpoint import (
    BestCheckpointWriter,
    snapshot,
)
from elastic_train.training.collectives import all_reduce_sum
from elastic_train.training.env import WorkerEnv
from elastic_train.training.losses import LossModule
from elastic_train.training.model import (
    BYTE_VOCAB,
    input_embedding_rows,
)
from elastic_train.training.sharding import sharded_snapshot
from elastic_train.training.step import StepSetup, autocast_context, dry_rank_batch


@dataclass
class EvalResult:
    loss: float  # per target token, over the whole evaluation (all ranks)
    targets: int
    micro_batches: int
    seconds: float


def evaluate(loss_module: LossModule, reader: BlockReader, spec: StreamSpec, partitions: list[int], *,
             setup: StepSetup, max_batches: int | None = None, on_batch=None) -> EvalResult:
    """The loss per target token over the held-out blocks of `reader`'s table.

    They are dealt to the run's K partitions and cut into micro-batches as a training epoch is
    (epoch 0 of that table), and this rank evaluates its partitions' micro-batches, the first
    `max_batches` of each: the same rows in the same micro-batches at any world size. Loss sums
    are added in float64 and all-reduced once; a float64 sum of fp32 losses is exact, so the
    result is the same to the bit at any world size (with the same weights: exact reduction).
    Sharded, a forward gathers each block from every rank: each rank runs as many forwards as
    the rank with the most micro-batches (dry ones after its own), until no rank has any.
    """
    t0 = time.perf_counter()
    total = torch.zeros((), dtype=torch.float64, device=setup.device)
    targets, count = 0.0, 0
    steps = iter_rank_steps(reader, spec, partitions=partitions, epoch=0, pad_id=setup.pad_id)
    modes = {module: module.training for module in loss_module.modules()}
    loss_module.eval()  # no dropout
    try:
        with torch.no_grad():
            for j, (micro_batches, _) in enumerate(steps):
                if max_batches is not None and j >= max_batches:
                    break
                sharded = setup.sharded
                rounds = len(micro_batches) if sharded is None else sharded.rounds(len(micro_batches))
                if not rounds:
                    break
                for _ in range(rounds - len(micro_batches)):
                    with autocast_context(setup.precision, setup.device):
                        loss_module(dry_rank_batch(None, setup.pad_id, setup.extra_columns,
                                                   reader.extra_kinds()).to_batch(setup.device))
                for mb in micro_batches:
                    with autocast_context(setup.precision, setup.device):
                        loss_sum, n_targets = loss_module(setup.batch(mb))
                    total += loss_sum.detach().double()
                    targets += float(n_targets)
                    count += 1
                    if on_batch is not None:
                        on_batch()
    finally:
        for module, training in modes.items():  # each as it was: a user's frozen part stays
            module.training = training          # in eval mode, as a resume rebuilds it
        reader.close()
    loss_sum, targets, count = all_reduce_sum([float(total), targets, count], setup.device)
    return EvalResult(loss_sum / max(targets, 1.0), int(targets), int(count),
                      time.perf_counter() - t0)


def run_eval(cfg: Config, env: WorkerEnv, t: Training, partitions: list[int], attempt: int,
             best: BestCheckpointWriter | None, log: bool,
             claim: Callable[[], bool] | None = None) -> None:
    """Evaluate `partitions` after the current step; if `log`, log it; keep a new best
    checkpoint through `best` if given (rank 0's alone, or with fsdp every rank's; in place
    every replica's, the one whose `claim` of it comes first writing it)."""
    state = t.state
    reader = make_reader(cfg.data.reader, env.eval_table, env.extra_columns,
                         input_embedding_rows(t.raw_model, cfg.model.vocab_size or BYTE_VOCAB))
    spec = StreamSpec(num_partitions(cfg), batch_tokens(cfg)[0], cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)
    result = evaluate(t.loss_module, reader, spec, partitions, setup=t.setup,
                      max_batches=cfg.eval.max_batches,
                      on_batch=lambda: env.maybe_crash_in_eval(state.step))
    state.eval_step = state.step
    improved = state.best_eval_loss is None or result.loss < state.best_eval_loss
    if improved:
        state.best_eval_loss, state.best_step = result.loss, state.step
    if log:
        env.log_eval({"step": state.step, "epoch": state.epoch, "time": time.time(),
                      "attempt": attempt, "eval_loss": result.loss,
                      "eval_perplexity": math.exp(min(result.loss, 700.0)),
                      "eval_targets": result.targets, "eval_micro_batches": result.micro_batches,
                      "eval_s": result.seconds, "best_eval_loss": state.best_eval_loss,
                      "best_step": state.best_step})
    if not improved or best is None or (claim is not None and not claim()):
        return
    if t.setup.sharded is not None:  # every rank has a writer and writes its own rows
        snap = sharded_snapshot(t.raw_model, t.optimizer, asdict(state), cfg.to_dict(),
                                shard=env.world_rank, shards=env.world_size,
                                provenance=env.provenance)
        best.write_shard(snap, state.step, result.loss,
                         barrier=lambda: all_reduce_sum([0.0], t.setup.device))
    else:  # rank 0 alone: it holds the whole model
        best.submit(snapshot(t.raw_model, t.optimizer, t.setup.scaler, asdict(state),
                             cfg.to_dict(), env.world_size, env.provenance), state.step, result.loss)
