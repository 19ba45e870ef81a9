"""A `loop.WorkerEnv` without Ray: one process trains a config from start to end, so that a Ray run
(resized, restarted, of any world size) can be compared with a run that never was interrupted."""

from __future__ import annotations

from typing import Any

import torch

from elastic_train.api import dataset_blocks
from elastic_train.config import Config
from elastic_train.loop import train_loop
from elastic_train.prepare import inspect_dataset


class LocalEnv:
    """World size 1 on the CPU; keeps the final snapshot and the step records in memory."""

    device = torch.device("cpu")
    world_rank, world_size = 0, 1

    def __init__(self, block_table, extra_columns: tuple[str, ...] = ()) -> None:
        self.block_table = block_table
        self.extra_columns = extra_columns
        self.last_saved_step = -1
        self.final: dict[str, Any] | None = None
        self.steps: list[dict[str, Any]] = []

    def prepare_model(self, model: torch.nn.Module, ddp_kwargs: dict | None) -> torch.nn.Module:
        return model

    def latest_checkpoint_dir(self) -> str | None:
        return None

    def save_checkpoint(self, snap: dict | None, step: int, final: bool) -> None:
        self.last_saved_step = step
        if final:
            self.final = snap

    def checkpoint_requested(self) -> bool:
        return False

    def begin_attempt(self) -> int:
        return 0

    def log_step(self, record: dict[str, Any]) -> None:
        self.steps.append(record)

    def checkpoint_committed(self, step: int) -> None: ...
    def log_event(self, record: dict[str, Any]) -> None: ...
    def log_consumed(self, attempt: int, state, micro_batches) -> None: ...
    def maybe_crash(self, step: int) -> None: ...
    def maybe_poison_gradient(self, model: torch.nn.Module, step: int) -> None: ...

    def handle_nonfinite(self, step: int, micro_batches) -> None:
        raise RuntimeError(f"non-finite gradients at step {step}")


def train_locally(cfg: Config, model_fn=None, loss_fn=None,
                  extra_columns: tuple[str, ...] = ()) -> LocalEnv:
    """Train `cfg` (a resolved config, e.g. a run's config.yaml) in this process, uninterrupted."""
    env = LocalEnv(dataset_blocks(inspect_dataset(cfg.data.path)), extra_columns)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train_loop(cfg, env, model_fn, loss_fn)
    finally:
        torch.set_num_threads(threads)
    return env
