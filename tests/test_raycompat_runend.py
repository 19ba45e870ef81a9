"""The Ray 2.60 internals that failures.py, runwatch.py, capacity.py and console.py reach into:
each test names the seam, and fails by that name if a later Ray moves it."""

from __future__ import annotations

import inspect

import pytest

pytestmark = pytest.mark.unit


def test_seam_the_controller_takes_a_failure_policy_and_hands_the_driver_its_handle():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    fit = inspect.getsource(DataParallelTrainer.fit)
    run = inspect.getsource(DataParallelTrainer._initialize_and_run_controller)
    assert "failure_policy=create_failure_policy(" in fit
    assert "self._register_sigint_handler(controller)" in run


def test_seam_the_failure_policy_and_the_errors_it_sees():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision
    from ray.train.v2.api.exceptions import WorkerGroupError

    assert {"RETRY", "RAISE"} <= {d.name for d in FailureDecision}
    assert "make_decision" in vars(DefaultFailurePolicy)
    error = WorkerGroupError("[Rank 0 Error Snippet]:\nboom", {0: ValueError("boom")})
    assert error._error_message.startswith("[Rank 0 Error Snippet]") and error.worker_failures
    assert UserExceptionWithTraceback(ValueError("x"), "tb")._base_exc.args == ("x",)


def test_seam_the_autoscaler_cluster_config_tells_a_cluster_that_can_grow():
    from ray._private.state import state

    assert callable(state.get_max_resources_from_cluster_config)


def test_seam_the_train_runs_request_at_the_autoscaling_coordinator():
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        _AutoscalingCoordinatorActor,
    )
    from ray.train.v2._internal.execution.scaling_policy import scaling_policy

    assert 'f"train-{train_run_context.run_id}"' in inspect.getsource(scaling_policy)
    assert "requester_id" in inspect.signature(_AutoscalingCoordinatorActor.cancel_request).parameters
    assert "_ongoing_reqs" in inspect.getsource(_AutoscalingCoordinatorActor.__init__)


def test_seam_errors_published_to_the_driver_are_printed_by_print_to_stdstream():
    import ray._private.worker as ray_worker

    assert "print_to_stdstream(" in inspect.getsource(ray_worker.listen_error_messages)
    assert list(inspect.signature(ray_worker.print_to_stdstream).parameters) == ["data",
                                                                                  "ignore_prefix"]
