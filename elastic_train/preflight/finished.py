"""Has this run already finished what the config asks? Then running it again changes nothing.

Re-running a finished run used to start Ray, resume the last checkpoint, train no step, and
overwrite summary.json with the figures of that empty session (tokens_per_s 0.0, goodput 0.0,
restarts 1, wall_s 8.9, where the run had 0.606 goodput and 52 s). A run is finished for this
config when its summary.json says "finished" and its latest complete checkpoint has reached
`train.max_steps` or `train.epochs` (the loop's own end condition): the driver then says so and
how to go on, before Ray starts and without writing a file.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow.fs as pafs

from elastic_train.config import Config
from elastic_train.observe.runfolder import run_uri, split_uri
from elastic_train.training.checkpoint import complete_checkpoints


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):  # absent, unreadable or corrupt: not a finished run
        return None


def latest_train_state(fs: pafs.FileSystem, folder: str) -> tuple[str, dict] | None:
    """(name, train_state) of the newest complete checkpoint in `folder`; None without one."""
    for name in complete_checkpoints(fs, folder):
        state = _read_json(fs, f"{folder}/{name}/state.json")
        if isinstance(state, dict) and isinstance(state.get("train_state"), dict):
            return name, state["train_state"]
        return None
    return None


def finished_run(cfg: Config) -> dict[str, Any] | None:
    """The run's summary.json if the run has finished what `cfg` asks (see the module
    docstring), with `checkpoint`: the name of the checkpoint it ended at; else None."""
    fs, folder, _ = split_uri(run_uri(cfg))
    summary = _read_json(fs, f"{folder}/summary.json")
    if not isinstance(summary, dict) or summary.get("status") != "finished":
        return None
    latest = latest_train_state(fs, folder)
    if latest is None:
        return None
    name, state = latest
    step, epoch = state.get("step", 0), state.get("epoch", 0)
    steps = summary.get("steps")
    if (summary.get("ended_by") == "train.epochs" and isinstance(steps, int) and step >= steps
            and isinstance(summary.get("epochs_completed"), int)):
        # a checkpoint of the epoch's last step, written before the loop found the epoch over
        # (a periodic one on that step): the run that wrote summary.json ended there
        epoch = max(epoch, summary["epochs_completed"])
    if step < cfg.train.max_steps and epoch < cfg.train.epochs:
        return None
    return {**summary, "checkpoint": name, "checkpoint_step": step, "checkpoint_epoch": epoch}


def finished_message(cfg: Config, summary: dict[str, Any]) -> str:
    """One line: the run is finished, and the setting that trains it on."""
    step, epoch = summary["checkpoint_step"], summary["checkpoint_epoch"]
    if epoch >= cfg.train.epochs:
        limit, more = f"train.epochs={cfg.train.epochs}", f"train.epochs={cfg.train.epochs + 1}"
    else:
        limit, more = (f"train.max_steps={cfg.train.max_steps}",
                       f"train.max_steps={cfg.train.max_steps * 2}")
    return (f"run {cfg.run.name} already finished at step {step} ({limit} reached; checkpoint "
            f"{summary['checkpoint']}); nothing was changed. To train on from there, run it again "
            f"with a larger limit, e.g. {more}")
