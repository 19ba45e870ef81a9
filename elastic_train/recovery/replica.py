"""One replica's side of torchft (`fault.recovery=in_place`): its state as torchft heals it
(`Replica`: whom it takes a heal from), what a replacement without the run's state does after a
quorum (`settle_unrestored`: restore the last checkpoint when no live replica holds the state),
its Manager with the process group and the two timeouts that bound every wait, the heal
transport, and what it needs from the worker beyond `WorkerEnv` (`InPlaceEnv`).

The step and the loop that use them are inplace.py.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from elastic_train.config import Config
from elastic_train.observe.summary import LOST_STATE
from elastic_train.training.build import Training
from elastic_train.training.env import WorkerEnv
from elastic_train.training.loop import check_restored_position
from elastic_train.training.step import TrainState

# The step's numbers that ride after the gradient in its one all-reduce (see Layout).
QUIET_RUST_LOG = "warn"  # torchft's Rust side logs every quorum and commit at info
STALE_POLL_S = 0.2  # a replica that waits for a peer: how often it asks for a quorum again


@dataclass
class Replica:
    """This worker's torchft Manager, and the state a joining replica heals from."""

    t: Training
    manager: Any = None
    healed_from_step: int | None = None  # set by a heal (the peer's step)
    heals: int = 0
    # a replacement that skipped its restore (a live peer heals it): no state of the run until a
    # heal from a peer that has it, or the restore it falls back to (`restore_instead`), so it
    # must not train before
    unrestored: bool = False
    # it restored the last checkpoint because no live replica held the run's state: it holds the
    # newest state there is, never "behind the run" (`settle_unrestored`)
    restored_for_all: bool = False
    quorum_announced: bool = False  # a replacement: env.asked_for_quorum was called

    def state_dict(self) -> dict[str, Any]:
        t = self.t
        return {"model": t.raw_model.state_dict(), "optim": t.optimizer.state_dict(),
                "train_state": asdict(t.state), "holds_run_state": not self.unrestored}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """A heal. Not taken by a replica without the run's state from a peer without it either:
        torchft heals every replica from the quorum's first when its highest step is 0 (its
        first-step weight sync), which, when every live replica is a fresh replacement, is a
        peer as empty as this one (a "heal" at step 0 after the run trained and checkpointed
        further: issue 39). The loop restores the last checkpoint instead, at once."""
        if self.unrestored and not sd.get("holds_run_state", True):
            return
        t = self.t
        t.raw_model.load_state_dict(sd["model"])
        t.optimizer.load_state_dict(sd["optim"])
        t.state = TrainState(**sd["train_state"])
        self.healed_from_step, self.heals, self.unrestored = t.state.step, self.heals + 1, False


def settle_unrestored(env: InPlaceEnv, replica: Replica, cfg: Config, heal_deadline: float) -> str:
    """A replacement that skipped its restore, still without the run's state after its quorum.

    Without an error in the quorum, no live replica holds the run's state: torchft heals a
    replica behind the quorum's highest step, so there was no heal, or only its first-step sync
    from a peer as fresh as this one, which `Replica.load_state_dict` refuses; the highest step
    is 0, while every replica with the run's state is past it (the run committed a step before
    this one started, `heal_first`). The last replica that had it was lost before this one
    joined: the last checkpoint is the newest state there is, restored now, by every replica of
    this quorum alike (none trains this step, unless there was nothing to restore: then all
    start from the same built state at once). With an error (the heal failed: its peer died
    sending it, or the group's rendezvous did), it waits for the next quorum, and restores past
    its deadline."""
    manager = replica.manager
    if manager.errored() is None:
        restore_instead(env, cfg, replica, LOST_STATE)
        replica.restored_for_all = True
        if replica.t.state.step == 0:
            return "train"
    manager.report_error(RuntimeError("a replacement not healed yet"))
    manager.should_commit()  # False: the step count stays as it was
    if env.run_finished() is not None:
        return "over"
    if not replica.unrestored:
        return "wait"
    if time.monotonic() > heal_deadline:
        restore_instead(env, cfg, replica, "no heal within its deadline")
    else:
        time.sleep(STALE_POLL_S)
    return "wait"


def restore_instead(env: InPlaceEnv, cfg: Config, replica: Replica, reason: str) -> None:
    """A replacement that skipped its restore to heal from a peer restores the last checkpoint
    now (a heal may still follow: a replica behind the others heals at the next quorum they
    share)."""
    t = replica.t
    env.heal_first = False
    directory = env.latest_checkpoint_dir()
    if directory is not None:
        from elastic_train.training.checkpoint import load_checkpoint
        from elastic_train.training.optim import set_hyperparameters

        t.state = TrainState(**load_checkpoint(directory, t.raw_model, t.optimizer, t.setup.scaler))
        set_hyperparameters(t.optimizer, cfg.optim)
        t.state.grad_reduce = "exact"
        check_restored_position(cfg, env, t.state)
    replica.unrestored = False
    replica.manager.load_state_dict({"step": t.state.step, "batches_committed": t.state.step})
    env.log_event({"event": "restored_instead_of_healing", "step": t.state.step, "reason": reason})


def behind_the_run(env: WorkerEnv, state: TrainState) -> bool:
    """A replacement alone in its quorum is behind the run if the run has ended or its step is
    behind the run's latest committed one (then a live peer exists, or existed)."""
    if env.run_finished() is not None:
        return True
    latest = env.latest_step()
    return latest is not None and latest > state.step


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
    # the first replica to ask writes a checkpoint ("final" | "best") of a step
    def claim_writer(self, what: str, attempt: int, step: int) -> bool: ...
    # a committed step's record and sample ids (all partitions'; None: not recorded), sent by
    # every participant: the first to arrive is kept
    def log_committed(self, record: dict[str, Any], ids: list[int] | None) -> None: ...
    def fence(self, world_rank: int, pid: int, missing_s: float) -> None: ...
    def save_in_place(self, snap: dict[str, Any], step: int) -> None: ...  # outside Ray's barrier
    def wait_for_checkpoints(self) -> None: ...  # the periodic one in flight, written
    def maybe_crash_in_heal(self) -> None: ...  # test hook: die as a heal starts to arrive
    def asked_for_quorum(self) -> None: ...  # a replacement is about to ask for its first quorum
    # too many non-finite steps in a row: roll back or stop, as the RunLog answers every replica
    # of the step (`participants`: world rank: pid) alike; raises either way
    def handle_nonfinite_in_place(self, step: int, participants: dict[int, int], ids: list[int],
                                  whole_step: bool) -> None: ...
