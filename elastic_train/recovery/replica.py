"""One replica's side of torchft (`fault.recovery=in_place`): its state as torchft heals it
(`Replica`), its Manager with the process group and the two timeouts that bound every wait, the
heal transport, and what it needs from the worker beyond `WorkerEnv` (`InPlaceEnv`).

The step and the loop that use them are inplace.py.
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from elastic_train.config import Config
from elastic_train.training.build import Training
from elastic_train.training.env import WorkerEnv
from elastic_train.training.step import TrainState

# The step's numbers that ride after the gradient in its one all-reduce (see Layout).
QUIET_RUST_LOG = "warn"  # torchft's Rust side logs every quorum and commit at info


@dataclass
class Replica:
    """This worker's torchft Manager, and the state a joining replica heals from."""

    t: Training
    manager: Any = None
    healed_from_step: int | None = None  # set by a heal (the peer's step)
    heals: int = 0
    # a replacement that skipped its restore (a live peer heals it): no state of the run until a
    # heal, or the restore it falls back to (`_restore_instead`), so it must not train before
    unrestored: bool = False

    def state_dict(self) -> dict[str, Any]:
        t = self.t
        return {"model": t.raw_model.state_dict(), "optim": t.optimizer.state_dict(),
                "train_state": asdict(t.state)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        t = self.t
        t.raw_model.load_state_dict(sd["model"])
        t.optimizer.load_state_dict(sd["optim"])
        t.state = TrainState(**sd["train_state"])
        self.healed_from_step, self.heals, self.unrestored = t.state.step, self.heals + 1, False


def start_manager(cfg: Config, env: InPlaceEnv, replica: Replica) -> Any:
    """A Manager for this worker as a replica group of one, at the restored step. The quorum is
    synchronous (a joining replica heals before the forward and takes part in the same step).

    Two kinds of wait, two timeouts (torchft 0.2.0 gives every wait the one `timeout`; with
    scaling.collective_timeout_s, 300 s, a survivor sat out 300 s for a replacement killed as it
    joined: issue 32):
    - On a peer that may be gone: `fault.in_place_timeout_s` (seconds). The process group's
      rendezvous with the quorum's members (`configure`: a TCPStore wait for each member's
      address, "wait timeout after 300000ms" when a member died after the lighthouse counted it),
      a heal's transfer (`send_checkpoint`/`recv_checkpoint`), the peer manager's checkpoint
      address, the commit vote and every RPC connection. A killed peer's sockets close with it, so
      a transfer or a connection fails at once; only a member that never reaches the rendezvous
      costs the whole timeout, and one such step: the step is not committed, torchft bumps the
      quorum id after a commit failure, and the next quorum (without the dead, whose heartbeat
      stopped 1 s after it died: inplace_ray.py) configures a fresh group. A timeout too short for
      a live but slow peer costs the same one step, never correctness.
    - On a peer's work: `scaling.collective_timeout_s`. A step's all-reduce waits for a peer still
      computing its share (`InPlaceGloo` sets it per collective), and the quorum call to the
      lighthouse, which answers within its join timeout (3 s) unless it is itself unreachable.
      A hung (not dead) peer blocks a step this long; the step watchdog allows three of them.
    """
    os.environ.setdefault("RUST_LOG", QUIET_RUST_LOG)  # before torchft starts its Rust runtime
    # a line per quorum and commit (torchft_commits: an empty one, for its structured handlers)
    for name in ("torchft", "torchft_quorums", "torchft_commits"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torchft 0.2.0's own use of deprecated torch APIs in its checkpoint transport, once a process
    warnings.filterwarnings("ignore", module=r"torchft\.checkpointing")
    from torchft import Manager

    peer = timedelta(seconds=cfg.fault.in_place_timeout_s)
    work = timedelta(seconds=cfg.scaling.collective_timeout_s)
    pg = build_process_group(env.device, peer, work)
    manager = Manager(
        pg=pg, min_replica_size=1, load_state_dict=replica.load_state_dict,
        state_dict=replica.state_dict, use_async_quorum=False, timeout=peer,
        quorum_timeout=work, connect_timeout=peer, rank=0, world_size=1,
        replica_id=f"{cfg.run.name}_{env.world_rank}_{uuid.uuid4().hex[:8]}",
        checkpoint_transport=heal_transport(pg, peer, env))
    step = replica.t.state.step
    manager.load_state_dict({"step": step, "batches_committed": step})
    replica.manager = manager
    return manager


def build_process_group(device: torch.device, peer: timedelta, work: timedelta) -> Any:
    """torchft's reconfigurable process group whose `configure` (the rendezvous of a new quorum)
    waits at most `peer`, and whose collectives wait `work` (start_manager says why)."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    class InPlaceGloo(ProcessGroupGloo):
        """Gloo fixes a context's default timeout when the group is made (the rendezvous's
        too): made with `peer`; each collective asks for `work` in its options (gloo honours an
        op's own timeout: measured, an all-reduce waited 4 s for a late peer on a group of 2 s)."""

        def _opts_hook(self, opts: Any) -> Any:
            if hasattr(opts, "timeout"):
                opts.timeout = work
            return opts

    class InPlaceNCCL(ProcessGroupNCCL):
        """torchft's NCCL group times each operation by its `_timeout` (aborting the
        communicator): `peer` while it configures, `work` after."""

        def configure(self, *args: Any, **kwargs: Any) -> None:
            self._timeout = peer
            try:
                super().configure(*args, **kwargs)
            finally:
                self._timeout = work

    return InPlaceNCCL(timeout=work) if device.type == "cuda" else InPlaceGloo(timeout=peer)


def heal_transport(pg: Any, timeout: timedelta, env: InPlaceEnv) -> Any:
    """torchft's transport of a heal over the process group (model, optimizer, counters and
    cursors), with the test hook that kills a replacement as it starts to receive one."""
    from torchft.checkpointing.pg_transport import PGTransport

    class HealTransport(PGTransport):
        def recv_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
            env.maybe_crash_in_heal()
            return super().recv_checkpoint(*args, **kwargs)

    return HealTransport(pg, timeout=timeout, device=env.device)


class InPlaceEnv(WorkerEnv, Protocol):
    """What `in_place_loop` uses beyond `loop.WorkerEnv` (Ray: `worker.RayWorkerEnv`)."""

    joining: bool  # this worker replaces a lost replica of a running group
    heal_first: bool  # set by the loop: skip the restore, a live peer heals this replica
    fence_after_s: float  # a replica missing from the steps this long is ended (fence.py)

    def run_finished(self) -> int | None: ...  # the step the run's training ended at, if it has
    def latest_step(self) -> int | None: ...  # the latest step logged
    def mark_finished(self, step: int) -> None: ...
    # a committed step's record and sample ids (all partitions'; None: not recorded), sent by
    # every participant: the first to arrive is kept
    def log_committed(self, record: dict[str, Any], ids: list[int] | None) -> None: ...
    def fence(self, world_rank: int, pid: int, missing_s: float) -> None: ...
    def save_in_place(self, snap: dict[str, Any], step: int) -> None: ...  # outside Ray's barrier
    def wait_for_checkpoints(self) -> None: ...  # the periodic one in flight, written
    def maybe_crash_in_heal(self) -> None: ...  # test hook: die as a heal starts to arrive
