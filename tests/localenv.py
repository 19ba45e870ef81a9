"""A `loop.WorkerEnv` without Ray: one process trains a config from start to end, so that a Ray run
(resized, restarted, of any world size) can be compared with a run that never was interrupted."""

from __future__ import annotations

from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist

from elastic_train.config import Config
from elastic_train.data.dataset import inspect_dataset
from elastic_train.preflight.inputs import data_tables, table_horizon
from elastic_train.training.checkpoint import BestCheckpointWriter
from elastic_train.training.loop import train_loop


class LocalEnv:
    """World size 1 on the CPU; keeps the final snapshot and the step records in memory."""

    device = torch.device("cpu")
    world_rank, world_size = 0, 1

    def __init__(self, block_table, extra_columns: tuple[str, ...] = (), eval_table=None,
                 folder: str | None = None) -> None:
        self.block_table = block_table
        self.eval_table = eval_table
        self.extra_columns = extra_columns
        self.folder = folder  # where best checkpoints go (checkpoint.keep_best)
        self.provenance: dict[str, Any] = {}
        self.startup: dict[str, float] = {}
        self.last_saved_step = -1
        self.final: dict[str, Any] | None = None
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.consumed: dict[tuple[int, int], list[int]] = {}  # (epoch, step): the step's sample ids
        self.cursors: dict[int, dict[str, list[int]]] = {}  # step: the data cursors saved then

    def prepare_model(self, model: torch.nn.Module, ddp_kwargs: dict | None) -> torch.nn.Module:
        return model

    def latest_checkpoint_dir(self) -> str | None:
        return None

    def save_checkpoint(self, snap: dict | None, step: int, final: bool) -> None:
        self.last_saved_step = step
        if snap is not None and "state" in snap:
            self.cursors[step] = snap["state"]["train_state"]["cursors"]
        if snap is not None:  # the last one saved holds the final weights: the final save
            self.final = snap  # right after a periodic one of the same step is skipped (loop.save)

    def checkpoint_requested(self) -> bool:
        return False

    def begin_attempt(self) -> int:
        return 0

    def log_step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)

    def log_eval(self, record: dict[str, Any]) -> None:
        self.evals.append(record)

    def best_writer(self) -> BestCheckpointWriter:
        assert self.folder is not None, "LocalEnv(folder=...) keeps best checkpoints"
        return BestCheckpointWriter(pafs.LocalFileSystem(), self.folder)

    def checkpoint_committed(self, step: int) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...

    def log_consumed(self, attempt: int, state, micro_batches) -> None:
        self.consumed[(state.epoch, state.step)] = sorted(int(i) for mb in micro_batches for i in mb.ids)

    def inject_faults(self, step: int) -> None: ...
    def step_began(self, step: int) -> None: ...
    def step_ended(self, step_time_s: float | None) -> None: ...
    def maybe_crash_in_eval(self, step: int) -> None: ...
    def maybe_poison_gradient(self, model: torch.nn.Module, step: int) -> None: ...

    def handle_nonfinite(self, step: int, micro_batches) -> None:
        raise RuntimeError(f"non-finite gradients at step {step}")


def train_locally(cfg: Config, model_fn=None, loss_fn=None,
                  extra_columns: tuple[str, ...] = (), folder: str | None = None,
                  env_cls: type[LocalEnv] = LocalEnv) -> LocalEnv:
    """Train `cfg` (a resolved config, e.g. a run's config.yaml) in this process, uninterrupted."""
    tables = data_tables(cfg, inspect_dataset(cfg.data.path))
    if cfg.optim.schedule_steps is None:  # the cosine's end, as check_inputs resolves it for a run
        cfg.optim.schedule_steps = table_horizon(cfg, tables.train).total
    env = env_cls(tables.train, extra_columns, tables.eval, folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    had_group = dist.is_initialized()
    try:
        train_loop(cfg, env, model_fn, loss_fn)
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized() and not had_group:  # sharding's one-rank group (sharding.py)
            dist.destroy_process_group()
    return env
