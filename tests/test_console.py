"""The driver's console: our progress, warnings and errors; Ray's INFO logging in the run folder's
ray.log, not on the screen (unless --verbose).

The `ray` tests run the installed `elastic-train` console script in a subprocess (it starts its own
local Ray cluster, as a user's run does) and read what it printed.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.cli import build_parser
from elastic_train.cluster.console import (
    RAY_LOG,
    RayLog,
    is_ray_chatter,
    ray_console,
    ray_train_logging,
    route_forwarded_lines,
)

BIN = Path(sys.executable).parent
USER_MODELS = Path(__file__).parent / "user_models"

# What identifies a line of Ray's INFO logging on a console: Ray's Python log format at INFO
# ("2026-11-30 22:09:30,474\tINFO worker.py:2029 -- ..."), Ray Core's C++ format at INFO
# ("[2026-11-30 22:09:47,462 I 14213 14245] ..."), or one of the INFO messages that Ray Train's
# controller and workers print bare (their console handler drops the level), as Ray 2.60 words them.
RAY_PY_INFO = re.compile(r"\bINFO [\w.-]+\.py:\d+ -- ")
RAY_CC_INFO = re.compile(r"\[\d{4}-\d\d-\d\d [\d:,.]+ I \d+ \d+\] ")
RAY_TRAIN_INFO = ("Reporting training result", "Checkpoint successfully created at",
                  "Requesting resources:", "Attempting to start training worker group",
                  "Started training worker group", "Setting up process group for",
                  "Moving model to device", "[FailurePolicy]")


def ray_info_lines(text: str) -> list[str]:
    return [line for line in text.splitlines()
            if RAY_PY_INFO.search(line) or RAY_CC_INFO.search(line)
            or any(message in line for message in RAY_TRAIN_INFO)]


# ---- pure: which forwarded lines are chatter, the log file, the restored logging (unit) ----

@pytest.mark.unit
@pytest.mark.parametrize("line, chatter", [
    ("2026-11-30 22:09:30,474\tINFO worker.py:2029 -- Started a local Ray instance.", True),
    ("2025-10-15 10:08:45,993 INFO streaming_executor.py:159 -- Starting execution of Dataset", True),
    ("[2026-11-30 22:09:47,462 I 14213 14245] core_worker.cc:100: Connected", True),
    ("Reporting training result 1: TrainingReport(checkpoint=None, metrics={'step': 12}) from rank 1",
     True),
    ("[2026-11-30 22:09:47,462 E 14213 14245] core_worker.cc:2465: Actor with class name: "
     "'PreemptionWatcher' and ID: '455b' has constructor arguments in the object store and "
     "max_restarts > 0.", True),
    ("Starting execution of Dataset dataset_0356o2X_0. Full logs are in /tmp/ray/session/logs", True),
    ("Execution plan of Dataset dataset_0356o2X_0: InputDataBuffer[Input] -> MapBatches(read)", True),
    ("✔️  Dataset dataset_0356o2X_0 execution finished in 43.29 seconds", True),
    ("2026-11-30 22:09:22,693\tWARNING authentication_token_setup.py:85 -- Token authentication", False),
    ("[2026-11-30 22:09:47,462 E 14213 14245] core_worker.cc:2465: Actor with class name: 'Other' "
     "and ID: '455b' has constructor arguments in the object store and max_restarts > 0.", False),
    ("Error in training function:", False),
    ("ValueError: this model fails in forward on purpose", False),
    ("step 10/12 epoch 0 loss 3.8463", False),
])
def test_ray_chatter_is_told_from_what_the_user_needs(line, chatter):
    assert is_ray_chatter(line) is chatter


@pytest.mark.unit
def test_ray_log_holds_lines_until_opened_then_appends(tmp_path):
    path = tmp_path / RAY_LOG
    path.write_text("an earlier run\n")
    log = RayLog()
    log.write(["before the run folder is known"])
    log.open(path)
    log.write(["after"])
    log.close()
    assert path.read_text().splitlines() == ["an earlier run", "before the run folder is known",
                                             "after"]


@pytest.mark.unit
@pytest.mark.parametrize("verbose", [False, True])
def test_ray_console_quiets_ray_loggers_on_screen_only_and_restores_them(verbose):
    import ray  # noqa: F401 (installs the handlers of the `ray` logger)

    ray_logger = logging.getLogger("ray")
    levels = [h.level for h in ray_logger.handlers]
    # The screen is what Ray's console handlers write to; which stream they hold depends on when
    # `ray` was first imported (maybe under an earlier test's capture), so they write here instead.
    screen = io.StringIO()
    consoles = [h for h in ray_logger.handlers if isinstance(h, logging.StreamHandler)
                and getattr(h, "stream", None) is not None and not isinstance(h, logging.FileHandler)]
    assert consoles, "Ray's logger has no console handler to quiet"
    streams = [h.setStream(screen) for h in consoles]
    try:
        with ray_console(verbose) as log:
            ray_logger.info("an INFO line of Ray's")
            ray_logger.warning("a WARNING of Ray's")
            held = list(log._pending)
    finally:
        for handler, stream in zip(consoles, streams, strict=True):
            handler.setStream(stream)
    on_screen = screen.getvalue()
    assert ("an INFO line of Ray's" in on_screen) is verbose
    assert "a WARNING of Ray's" in on_screen
    assert any("INFO" in line and "an INFO line of Ray's" in line for line in held)
    assert [h.level for h in ray_logger.handlers] == levels and log not in ray_logger.handlers
    assert ray_train_logging(verbose).log_level == ("INFO" if verbose else "WARNING")


def _drop_other_printers(dispatcher) -> None:
    """Remove a printer an earlier test's Ray left in the process-wide dispatcher (building a
    TorchTrainer in-process starts one): route_forwarded_lines wraps the first it finds."""
    with dispatcher._lock:
        dispatcher.handlers = [(n, h) for n, h in dispatcher.handlers if n != "ray_print_logs"]


@pytest.mark.unit
@pytest.mark.parametrize("verbose", [False, True])
def test_forwarded_lines_all_reach_ray_log_and_chatter_stays_off_screen(verbose):
    """Through Ray's own dispatcher (read from Ray 2.60): fails here if a later Ray moves it."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed: list[dict] = []
    _drop_other_printers(dispatcher)
    dispatcher.add_handler("ray_print_logs", printed.append)  # as ray.init(log_to_driver=True)
    log = RayLog()
    try:
        undo = route_forwarded_lines(log, verbose)
        # a worker's own line is shown; Ray's report of its error is not (the driver prints the
        # failing worker's traceback itself once the run fails for good: runwatch.py, api.py)
        lines = ["Reporting training result 1: TrainingReport(...) from rank 0",
                 "my model says hello", "Error in training function:"]
        dispatcher.emit({"pid": 7, "actor_name": "RayTrainWorker", "is_err": True, "lines": lines})
        undo()
        dispatcher.emit({"pid": 7, "is_err": True, "lines": ["after undo"]})
    finally:
        dispatcher.remove_handler("ray_print_logs")
    shown = [batch["lines"] for batch in printed]
    assert shown == [lines if verbose else lines[1:2], ["after undo"]]
    assert [line.split(" ", 2)[2] for line in log._pending] == [
        f"(RayTrainWorker pid=7) {line}" for line in lines]


@pytest.mark.unit
def test_train_command_takes_verbose():
    parser = build_parser()
    assert parser.parse_args(["train", "--verbose", "train.max_steps=3"]).verbose is True
    assert parser.parse_args(["train"]).verbose is False


# ---- the console of a real run (ray) ----

def _train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`elastic-train train` in a subprocess with its own local Ray; stdout and stderr captured."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([repo, str(USER_MODELS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [str(BIN / "elastic-train"), "train", "run.storage_path=" + str(tmp_path), *overrides],
        capture_output=True, text=True, timeout=500, cwd=tmp_path, env=env)


def _tiny_with_progress_lines(tiny: list[str], small_dataset: str) -> list[str]:
    overrides = [o for o in tiny if not o.startswith("log.progress=")]
    return [*overrides, "log.progress=lines", "log.print_every_steps=5", f"data.path={small_dataset}",
            "train.max_steps=12", "checkpoint.every_steps=6",
            "scaling.worker_group_start_timeout_s=300"]  # on a busy machine a slow start is no failure


# the console of a run that trains, restarts and finishes: tests/test_runend.py's crash run


@pytest.mark.ray
def test_failing_run_console_shows_the_workers_error(tmp_path, tiny, small_dataset):
    proc = _train(tmp_path, "run.name=fails", *_tiny_with_progress_lines(tiny, small_dataset),
                  "model.name=tiny_gru:fails_in_forward", "scaling.max_failures=0")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 1, console[-5000:]
    assert re.search(r"error: run failed: rank \d+( on node \S+)?: ValueError: this model fails in "
                     r"forward on purpose", proc.stderr), console[-5000:]
    # the worker's own traceback, down to the user's line that raised
    assert re.search(r'File ".*tiny_gru\.py", line \d+, in forward', console), console
    assert 'raise ValueError("this model fails in forward on purpose")' in console
    assert ray_info_lines(console) == [], console


@pytest.mark.unit
def test_libraries_notices_in_workers_reach_ray_log_only():
    """bitsandbytes' CPU kernel notice, transformers' loading bar and a FutureWarning (with its
    source line), c10d's and NCCL's notices: in ray.log, not on the screen; the worker's own
    lines around them, and a UserWarning, still shown."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    printed: list[dict] = []
    _drop_other_printers(dispatcher)
    dispatcher.add_handler("ray_print_logs", printed.append)
    log = RayLog()
    noise = [
        "Failed to load CPU gemm_4bit_forward from kernels-community: Kernel repository ... "
        "Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
        "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
        "because Hugging Face Hub is in offline mode.",
        "Loading weights: 100%|██████████| 3/3 [00:00<00:00, 1234.56it/s]",
        "/venv/lib/python3.11/site-packages/transformers/x.py:12: FutureWarning: `foo` is "
        "deprecated", "  warnings.warn(",
        "[W1204 10:00:00.000 socket.cpp:767] [c10d] The hostname of the client socket cannot be "
        "retrieved. err=-3",
        "Unable to reset NCCL flight recorder: ...",
    ]
    ours = ["my model says hello", "/m.py:3: UserWarning: check this", "  warnings.warn("]
    try:
        undo = route_forwarded_lines(log, verbose=False)
        dispatcher.emit({"pid": 7, "actor_name": "RayTrainWorker", "is_err": True,
                         "lines": [noise[0], ours[0], *noise[1:], *ours[1:]]})
        undo()
    finally:
        dispatcher.remove_handler("ray_print_logs")
    assert [line for batch in printed for line in batch["lines"]] == ours
    assert len(log._pending) == len(noise) + len(ours)


@pytest.mark.ray
def test_prepare_then_train_with_defaults_on_a_small_package(tmp_path):
    """Issue 38's first hour: `prepare` a small package's sources (the standard library's email
    package, a few dozen files) and `train data.path=...` with no other setting. It trains (the
    held-out documents and the row groups come from prepare, the batch sizes from the data),
    evaluates, counts its progress to the steps it trains, and its end line names the limit
    that ended it; summary.json and the evaluation records agree on the epoch; the console
    holds no library notice."""
    import email

    from elastic_train.cli import main

    data = tmp_path / "data" / "email"
    assert main(["prepare", str(Path(email.__file__).parent), "--output", str(data),
                 "--engine", "local"]) == 0
    proc = _train(tmp_path, "run.name=own", f"data.path={data}",
                  "scaling.worker_group_start_timeout_s=300")
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-5000:]
    run = tmp_path / "own"
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert summary["status"] == "finished" and evals and evals[-1]["step"] == summary["steps"]
    assert summary["final_eval_epoch"] == evals[-1]["epoch"] == summary["epochs_completed"]
    totals = {int(t) for t in re.findall(r"^step \d+/(\d+) ", proc.stdout, re.M)}
    assert totals == {summary["steps"]}, console[-3000:]
    limit = {"train.epochs": "(train.epochs=1 done)",
             "train.max_steps": "(train.max_steps=120 reached)"}[summary["ended_by"]]
    end = [line for line in proc.stdout.splitlines() if line.startswith("finished: ")]
    assert len(end) == 1 and end[0].startswith(f"finished: {summary['steps']} steps {limit}")
    assert f"eval {summary['final_eval_loss']:.4f} at step {summary['steps']}" in end[0]
    assert ray_info_lines(console) == [], console
    assert not re.search(r"FutureWarning|gemm_4bit|\d+%\|", console), console


@pytest.mark.unit
def test_the_command_lines_console_drops_libraries_notices_on_the_driver():
    """On the driver (imports of peft, the meta model): bitsandbytes' CPU kernel warning and a
    transformers FutureWarning stay off the console; our warnings and a UserWarning stay on."""
    import io
    import logging
    import warnings

    from elastic_train.cluster.console import LibraryNoiseFilter, quiet_library_notices

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = logging.getLogger()
    root.addHandler(handler)
    logging.captureWarnings(False)  # an earlier in-process `main` may have captured them
    try:
        quiet_library_notices()
        assert any(isinstance(f, LibraryNoiseFilter) for f in handler.filters)
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning(
            "Failed to load CPU gemm_4bit_forward from kernels-community: ...")
        logging.getLogger("elastic_train").warning("ours")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("`x` is deprecated", FutureWarning, stacklevel=1)
            warnings.warn("look at this", UserWarning, stacklevel=1)
    finally:
        root.removeHandler(handler)
        logging.captureWarnings(False)
    text = stream.getvalue()
    assert "gemm_4bit" not in text and "FutureWarning" not in text
    assert "ours" in text and "UserWarning: look at this" in text
