"""In place, the controller's side of a replacement (issue 32, the 30 s schedule), without a
cluster: a replacement that dies while Ray still starts it is the kind of failure Ray's own
failure policy retries, never the run's end. Ray's real classes and policy, no Ray session."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("torchft")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError  # noqa: E402
from ray.train.v2._internal.execution.failure_handling.default import (  # noqa: E402
    DefaultFailurePolicy,
)
from ray.train.v2._internal.execution.failure_handling.failure_policy import (  # noqa: E402
    FailureDecision,
)
from ray.train.v2._internal.execution.worker_group import WorkerGroup  # noqa: E402
from ray.train.v2.api.config import FailureConfig  # noqa: E402
from ray.train.v2.api.exceptions import ControllerError  # noqa: E402

from elastic_train.cluster.inplace_ray import _startup_failure_on_death  # noqa: E402

pytestmark = pytest.mark.unit


def test_a_replacement_that_dies_while_it_starts_is_retried_not_the_runs_end():
    """Ray 2.60 calls `WorkerGroup.replace_replica_group(index)` on the run's worker group; a
    death inside it reaches the controller's failure policy. Bare, the policy ends the run (the
    issue's "The actor is dead because its worker process has died"); through the wrapper that
    InPlaceBackend puts on the worker group, it retries, with no limit (max_failures=-1 as in
    this mode), however many replacements die."""
    assert list(inspect.signature(WorkerGroup.replace_replica_group).parameters) == \
        ["self", "replica_group_index"]
    policy = DefaultFailurePolicy(FailureConfig(max_failures=-1))
    death = ActorDiedError()
    assert policy.make_decision(ControllerError(death)) == FailureDecision.RAISE

    replaced = []

    def replace(index: int) -> None:
        replaced.append(index)
        raise death

    wrapped = _startup_failure_on_death(replace)
    for _ in range(20):  # a crash-looping node
        with pytest.raises(WorkerGroupStartupFailedError) as caught:
            wrapped(1)
        assert caught.value.__cause__ is death and "replica group 1" in str(caught.value)
        assert policy.make_decision(ControllerError(caught.value)) == FailureDecision.RETRY
    assert replaced == [1] * 20


def test_a_replacement_that_starts_or_fails_otherwise_is_left_as_it_is():
    """Only a death is changed: a replacement that starts returns as it did, and another error
    (a bug in a backend, say) still reaches the controller as it was raised."""
    calls = []
    assert _startup_failure_on_death(calls.append)(0) is None and calls == [0]

    def broken(index: int) -> None:
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        _startup_failure_on_death(broken)(0)
