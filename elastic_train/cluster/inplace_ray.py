"""In-place recovery, the driver's side: Ray's torchft backend and config (`fault.recovery=in_place`).

Read from Ray 2.60 (`ray/train/v2/torch/torchft_config.py`, `_internal/execution/worker_group`):
`_TorchftBackend.on_start` runs once with the whole `WorkerGroup` at a group start and once with a
`ReplicaGroup` when Ray replaces a failed replica; `_maybe_create_lighthouse_actor` starts the
lighthouse; `WorkerGroup.replace_replica_group` replaces one (`_retry_replacement_deaths`). If a
later Ray moves them, this module fails at import (the first two), the lighthouse logs at info
again (the third) or `tests/test_inplace_unit.py` fails (the fourth). The worker's side is
`inplace.py`.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError
from ray.train.v2._internal.execution.worker_group import ReplicaGroup
from ray.train.v2.torch.torchft_config import LighthouseServerActor, TorchftConfig, _TorchftBackend
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic_train.config import Config
from elastic_train.recovery.replica import QUIET_RUST_LOG

GROUP_ENV = "ELASTIC_TRAIN_GROUP"  # set by InPlaceBackend: a group start's token, or JOINING
JOINING = "join"
HEARTBEAT_TIMEOUT_MS = 1000
JOIN_TIMEOUT_MS = 3000


class InPlaceBackend(_TorchftBackend):
    """Ray's torchft backend, which also tells each worker (`GROUP_ENV`) whether it starts with
    its whole group (a fresh token per group start) or replaces a lost replica (`JOINING`), and
    starts the lighthouse with torchft's Rust logging at warnings (it logs every quorum)."""

    def _maybe_create_lighthouse_actor(self, backend_config) -> str:
        if self.lighthouse_actor is None:
            kwargs = {"bind": "[::]:0", **backend_config.lighthouse_kwargs}
            self.lighthouse_actor = LighthouseServerActor.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False),
                runtime_env={"env_vars": {"RUST_LOG": os.environ.get("RUST_LOG", QUIET_RUST_LOG)}},
            ).remote(lighthouse_kwargs=kwargs)
        return ray.get(self.lighthouse_actor.address.remote())

    def on_start(self, worker_group, backend_config) -> None:
        joining = isinstance(worker_group, ReplicaGroup)
        if not joining:  # the whole group (in the controller): its later replacements
            _retry_replacement_deaths(worker_group)
        worker_group.execute(_set_env, GROUP_ENV, JOINING if joining else uuid.uuid4().hex)
        super().on_start(worker_group, backend_config)


def _retry_replacement_deaths(worker_group) -> None:
    """A replacement that dies while Ray still starts it is retried, never the run's end.

    Ray 2.60's `WorkerGroup.replace_replica_group` turns a death of the new worker while its
    train context is set up into `WorkerGroupStartupFailedError`, which the controller retries
    (another replacement, the survivors untouched); but a death a moment later, in the backends'
    `on_start` (this class's and torchft's `execute` calls) or while it deserializes the train
    function (`run_train_fn`: imports of torch and this package, seconds under load), reaches the
    controller as a bare `RayActorError`, which its failure policy does not retry: the run failed
    with "The actor is dead because its worker process has died" (issue 32, the youngest worker
    killed every 30 s). Every death inside the replacement is made the retried kind, on this run's
    worker group alone (an attribute of the instance, not a patch of Ray's class)."""
    replace = worker_group.replace_replica_group
    worker_group.replace_replica_group = _startup_failure_on_death(replace)


def _startup_failure_on_death(replace: Callable[[int], None]) -> Callable[[int], None]:
    def replace_replica_group(replica_group_index: int) -> None:
        try:
            replace(replica_group_index)
        except RayActorError as exc:  # ActorDiedError, ActorUnavailableError
            raise WorkerGroupStartupFailedError(
                f"the replacement of replica group {replica_group_index} died while it "
                f"started: {exc}") from exc
    return replace_replica_group


class InPlaceConfig(TorchftConfig):
    """Ray's TorchftConfig with `InPlaceBackend`."""

    @property
    def backend_cls(self):
        return InPlaceBackend


def torch_config(cfg: Config) -> InPlaceConfig:
    """The lighthouse forgets a replica whose heartbeats stop for 1 s (the survivors' next quorum
    forms that soon after a death) and waits at most 3 s for a heartbeating replica to ask for a
    quorum (a peer still in its step)."""
    s = cfg.scaling
    return InPlaceConfig(
        lighthouse_kwargs={"min_replicas": 1, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS,
                           "join_timeout_ms": JOIN_TIMEOUT_MS},
        backend="nccl" if s.use_gpu else "gloo", timeout_s=s.collective_timeout_s)


def _set_env(name: str, value: str) -> None:
    os.environ[name] = value
