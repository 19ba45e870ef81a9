"""What failed, in one line, and a bound on failures that repeat without progress.

Ray Train V2 retries a worker group that cannot start without end (a ControllerError wrapping
`WorkerGroupStartupFailedError` is retried up to `FailureConfig.controller_failure_limit`, -1 by
default), and in place (`max_failures=-1`) a worker that fails the same way at every start is
retried forever too: a dead torchft lighthouse looped 78 times in 10 minutes, a traceback each.
`BoundedFailurePolicy` is Ray's default policy with one bound added: the same failure
`SAME_FAILURE_LIMIT` times in a row with no step logged in between ends the run with that failure.
Start-up timeouts (no room for the workers yet) are not counted here: the driver's `StartWatch`
bounds the wait by `scaling.start_timeout_s`, for elastic runs too (their policy waits without
raising anything).

Every failure it sees is also described (`describe_failure`: kind, rank, node, cause) and sent to
the RunLog (`record_failure`), which ends the attempt in attempts.json and logs an event; the
driver prints one line of it (`failure_line`).

Reaches into Ray 2.60's private code (`RAY_VERSION_READ`): the failure-policy classes
(`ray/train/v2/_internal/execution/failure_handling`), the start-up exceptions
(`_internal/exceptions.py`), and the controller kwarg `failure_policy` that
`driver.Trainer._initialize_and_run_controller` replaces. tests/test_raycompat.py fails by name if
they move.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import asdict, dataclass

import ray
from ray.exceptions import RayActorError
from ray.train.v2._internal.exceptions import (
    UserExceptionWithTraceback,
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
)
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
from ray.train.v2.api.exceptions import ControllerError, PreemptionError, WorkerGroupError

logger = logging.getLogger("elastic_train")

RAY_VERSION_READ = "2.60"
SAME_FAILURE_LIMIT = 3  # the same failure this many times in a row, no step between: the run ends
RUNLOG_CALL_TIMEOUT_S = 5.0
# A rank that fails because a peer died (its collective lost the peer) is not the cause.
_COLLATERAL = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|"
                         r"NCCL communicator was aborted|ProcessGroup.*(abort|shut ?down)|"
                         r"torchft.*(abort|quorum)", re.IGNORECASE)
_EXCEPTION_LINE = re.compile(r"^([\w.]+(?:Error|Exception|Interrupt|Exit)\b):?\s*(.*)$")


@dataclass
class Failure:
    """One failure as the driver reports it."""

    kind: str  # worker (an attempt's worker failed) | start (the group did not start) | preemption
    cause: str  # one line: "process died (SYSTEM_ERROR: ...)", "ValueError: ..."
    rank: int | None = None
    node: str | None = None  # the node's IP where known
    traceback: str | None = None  # the failing worker's own traceback, where it raised one

    @property
    def signature(self) -> str:
        """The failure without its numbers (pids, ports, ids) and its rank (every rank fails the
        same way; which one Ray names first varies): equal for the same failure."""
        return re.sub(r"\d+", "#", f"{self.kind}|{self.cause}")

    def record(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "traceback"}


def _last_exception_line(text: str) -> str | None:
    """The last `SomeError: message` line of a traceback text."""
    for line in reversed(text.strip().splitlines()):
        match = _EXCEPTION_LINE.match(line.strip())
        if match:
            return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}".rstrip(": ")
    return None


def _died(error: RayActorError) -> tuple[str, str | None]:
    """(cause, node ip) of a worker process that died."""
    text = str(error)
    node = re.search(r"^\s*ip: (\S+)", text, re.MULTILINE)
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    detail = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text, re.MULTILINE)
    if error.actor_init_failed:
        cause = "its process failed to start: " + (_last_exception_line(text) or text.splitlines()[0])
    elif error.preempted:
        cause = "its node was preempted"
    else:
        cause = "its process died" + (f" ({exit_type.group(1)}" if exit_type else "") + (
            f": {detail.group(1).strip()}" if detail else "") + (")" if exit_type else "")
    return cause[:300], node.group(1) if node else None


def _rank_snippet(message: str, rank: int) -> str | None:
    """Rank `rank`'s part of a WorkerGroupError's message ("[Rank 0,1 Error Snippet]:\\n...")."""
    parts = re.split(r"^\[Rank ([\d,]+) Error Snippet\]:\n", message, flags=re.MULTILINE)
    for ranks, text in zip(parts[1::2], parts[2::2], strict=False):
        if str(rank) in ranks.split(","):
            return text.strip()
    return None


def _describe_worker(error: WorkerGroupError) -> Failure:
    """The rank that caused a worker-group failure: a dead process first, then an error of its
    own, then an error caused by a lost peer; the lowest rank among equals."""
    def priority(item: tuple[int, BaseException]) -> tuple[int, int]:
        rank, exc = item
        inner = exc.health_check_failure if isinstance(exc, WorkerHealthCheckFailedError) else exc
        if isinstance(inner, RayActorError):
            return 0, rank
        return (2 if _COLLATERAL.search(str(exc)) else 1), rank

    rank, exc = min(error.worker_failures.items(), key=priority)
    inner = exc.health_check_failure if isinstance(exc, WorkerHealthCheckFailedError) else exc
    if isinstance(inner, RayActorError):
        cause, node = _died(inner)
        return Failure("worker", cause, rank, node)
    base = exc._base_exc if isinstance(exc, UserExceptionWithTraceback) else exc
    snippet = _rank_snippet(getattr(error, "_error_message", ""), rank) or str(exc)
    cause = f"{type(base).__name__}: {str(base).strip().splitlines()[0] if str(base).strip() else ''}"
    return Failure("worker", cause.rstrip(": ")[:300], rank, None, snippet)


def _describe_start(exc: BaseException) -> Failure:
    if isinstance(exc, WorkerGroupStartupTimeoutError):
        return Failure("start_timeout", f"no room for {exc.num_workers} workers yet")
    root = exc.__cause__ or exc.__context__
    if isinstance(root, RayActorError):
        cause, node = _died(root)
        return Failure("start", f"a worker or helper actor did not start: {cause}", None, node,
                       str(root))
    if isinstance(exc, WorkerGroupStartupFailedError):
        text = str(exc)
        return Failure("start", "the worker group did not start: "
                       + (_last_exception_line(text) or text.splitlines()[0] if text else "")[:300],
                       traceback=text)
    text = str(exc).strip()
    return Failure("start", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300],
                   traceback=text)


def describe_failure(error: BaseException) -> Failure:
    """A Ray Train failure (what the failure policy or `fit` sees) as one `Failure`."""
    if isinstance(error, PreemptionError):
        return Failure("preemption", f"nodes drained (ranks {error.preemption_info.preempted_ranks})")
    if isinstance(error, WorkerGroupError) and error.worker_failures:
        return _describe_worker(error)
    if isinstance(error, ControllerError):
        return _describe_start(error.controller_failure)
    text = str(error).strip()
    return Failure("controller", (_last_exception_line(text) or type(error).__name__)[:300],
                   traceback=text)


class BoundedFailurePolicy(DefaultFailurePolicy):
    """Ray's default failure policy; the same failure `limit` times in a row without a step
    logged in between raises instead of retrying, and every failure goes to the RunLog."""

    def __init__(self, failure_config, runlog, limit: int = SAME_FAILURE_LIMIT,
                 in_place: bool = False) -> None:
        super().__init__(failure_config)
        self.runlog, self.limit, self.in_place = runlog, limit, in_place
        self._last: tuple[str, object] | None = None  # (signature, progress) of the last failure
        self.repeats = 0

    def _run_state(self) -> dict:
        """The RunLog's latest (attempt, step) and fatal reason; {} once it is gone."""
        try:
            return ray.get(self.runlog.run_state.remote(), timeout=RUNLOG_CALL_TIMEOUT_S)
        except Exception:  # the RunLog is gone: the run is ending anyway
            return {}

    def make_decision(self, training_failed_error) -> FailureDecision:
        failure = describe_failure(training_failed_error)
        state = self._run_state()
        # a start timeout is bounded by time (the driver's RunWatch): neither counted nor a break
        # in a series (X, timeout, X, timeout... is X three times in a row)
        if failure.kind != "start_timeout":
            now = (failure.signature, state.get("latest"))
            self.repeats = self.repeats + 1 if now == self._last else 1
            self._last = now
        if state.get("fatal"):  # a worker said the run cannot go on: a new group would not either
            decision = FailureDecision.RAISE
        elif failure.kind != "start_timeout" and self.repeats >= self.limit:
            decision = FailureDecision.RAISE
            logger.warning("the same failure %d times in a row without a step: %s", self.repeats,
                           failure.cause)
        else:
            decision = super().make_decision(training_failed_error)
        record = {"time": time.time(), **failure.record(), "repeats": self.repeats, "in_place": self.in_place,
                  "decision": "give_up" if decision == FailureDecision.RAISE else "retry",
                  "max_failures": self.failure_config.max_failures}
        try:
            ray.get(self.runlog.record_failure.remote(record), timeout=RUNLOG_CALL_TIMEOUT_S)
        except Exception as exc:
            logger.warning("could not record the failure in the run folder: %s", exc)
        return decision
