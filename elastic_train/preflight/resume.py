"""May this run resume its latest checkpoint? Same model signature, same data identity, same data
content and tokenizer; refused before Ray starts, the run folder left as it was."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from elastic_train.config import Config, ConfigError
from elastic_train.data.dataset import DatasetInfo
from elastic_train.observe import provenance
from elastic_train.observe.runfolder import run_uri, split_uri
from elastic_train.preflight.checks import (
    IDENTITY_FILE,
    data_identity,
    identity_change,
)
from elastic_train.training.checkpoint import complete_checkpoints, signature_mismatch

logger = logging.getLogger("elastic_train")


def check_resumable(cfg: Config, ours: dict[str, list[int]],
                    info: DatasetInfo | None = None) -> dict[str, Any] | None:
    """If the run folder holds checkpoints, the newest complete one must fit the configured model
    (signature `ours`) and, given `info`, have been trained on the same data identity (path, seed,
    partition count, shards; see checks.py) unless data.on_change=keep_position: refused here,
    before Ray starts, with the run folder left as it was. (The worker checks the checkpoint Ray
    hands it again, in case one appears meanwhile.) Returns that checkpoint's state.json (None
    without one)."""
    fs, folder, _ = split_uri(run_uri(cfg))
    for name in complete_checkpoints(fs, folder):
        directory = f"{folder}/{name}"
        state = _read_json(fs, f"{directory}/state.json", "checkpoint file")
        if not (isinstance(state, dict) and isinstance(state.get("config"), dict)
                and isinstance(state.get("model_signature"), dict)):
            raise ConfigError(f"checkpoint file '{directory}/state.json' is corrupt: not the state "
                              "of a checkpoint")
        mismatch = signature_mismatch(state, ours)
        if mismatch:
            raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} {mismatch}; use "
                              f"another run.name, or the model config it was trained with")
        if info is not None:
            _check_same_data(cfg, info, state, fs, folder, name)
        _check_same_base(cfg, fs, directory, name)
        note = lr_change_note(cfg, state)
        if note:
            logger.warning(note)
        return state
    return None


def lr_change_note(cfg: Config, state: dict[str, Any]) -> str | None:
    """One line when the resume changes the learning-rate schedule at the resume step (another
    train.max_steps moves the cosine's end; other optim.lr, warmup_steps or min_lr_ratio move
    it too): the LR that step had under the checkpoint's config, and the one it gets now. The
    schedule is the current config's (the horizon is not kept): a larger train.max_steps
    stretches the cosine, so the LR of the resume step goes back up (docs/fault_tolerance.md)."""
    from dataclasses import fields

    from elastic_train.config import OptimConfig
    from elastic_train.training.optim import lr_at

    saved = state.get("config", {})
    step = int(state.get("train_state", {}).get("step", 0))
    known = {f.name for f in fields(OptimConfig)}
    try:
        old_optim = OptimConfig(**{k: v for k, v in saved.get("optim", {}).items() if k in known})
        old_max = int(saved.get("train", {})["max_steps"])
    except (KeyError, TypeError, ValueError):
        return None
    before, after = lr_at(step, old_optim, old_max), lr_at(step, cfg.optim, cfg.train.max_steps)
    if abs(before - after) <= 1e-12 * max(abs(before), 1.0):
        return None
    why = (f"train.max_steps {old_max} -> {cfg.train.max_steps} moves the schedule's end"
           if old_max != cfg.train.max_steps else "the optim settings changed")
    return (f"run {cfg.run.name}: resuming at step {step}, the learning rate goes from "
            f"{before:.3g} to {after:.3g} ({why}; the schedule follows the current config)")


def _check_same_base(cfg: Config, fs: pafs.FileSystem, directory: str, name: str) -> None:
    """A LoRA run's adapters resume only on the base they were trained on (lora.py): for a base
    loaded from the weights in model.path, its hash (basehash.py, cached per node, so the
    workers do not hash it again) against the one the checkpoint holds, here before Ray starts
    (the workers check again, and for a base built from its seed they alone can)."""
    if not (cfg.model.lora.r > 0 and cfg.model.name == "hf" and cfg.model.path
            and isinstance(fs, pafs.LocalFileSystem) and "://" not in cfg.model.path):
        return
    from elastic_train.training.basehash import folder_hash
    from elastic_train.training.checkpoint import read_shards
    from elastic_train.training.lora import BASE_KEY

    ours = folder_hash(Path(cfg.model.path).expanduser())
    saved = read_shards(directory, "model").get(BASE_KEY)
    if ours is None or saved is None or bytes(saved.tolist()) == ours:
        return
    raise ConfigError(
        f"model.path: run {cfg.run.name}'s checkpoint {name} holds LoRA adapters trained on "
        f"another base model (base sha256 {bytes(saved.tolist()).hex()[:16]}..., "
        f"'{cfg.model.path}' has {ours.hex()[:16]}...): resume on the base model.path it was "
        "trained on, or use another run.name")


def _check_same_data(cfg: Config, info: DatasetInfo, state: dict, fs: pafs.FileSystem,
                     folder: str, name: str) -> None:
    """The checkpoint's data position means the same rows and token ids now: the same tokenizer
    and data (provenance) and data identity, else refused (unless data.on_change=keep_position)
    naming what changed, the tokenizer first: re-preparing with another tokenizer also changes
    every shard's row count, and the row count is not the news. Other library versions or code
    only warn, naming them."""
    identity = _identity_change(cfg, info, state, fs, folder)
    saved = state.get("provenance") if isinstance(state.get("provenance"), dict) else {}
    if identity is not None:  # it says more than the manifest hash that changes with it
        saved = {k: v for k, v in saved.items() if k != "data_hash"}
    refusing, warning = (provenance.changes(saved, provenance.driver_record(info)) if saved
                         else ([], []))
    refusing += [identity] if identity is not None else []
    if refusing and cfg.data.on_change != "keep_position":
        raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} was trained on other data: "
                          f"{'; '.join(refusing)}; its data position would mean other rows. Use "
                          "another run.name, the data it was trained on, or "
                          "data.on_change=keep_position to resume anyway")
    if refusing:
        logger.warning("run %s: resuming checkpoint %s at its data position although %s "
                       "(data.on_change=keep_position)", cfg.run.name, name, "; ".join(refusing))
    if warning:
        logger.warning("run %s: resuming checkpoint %s, written with %s", cfg.run.name, name,
                       "; ".join(warning))


def _read_json(fs: pafs.FileSystem, path: str, what: str):
    """A JSON file's content, or a ConfigError naming the file."""
    try:
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:  # json.JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{what} '{path}' is corrupt or unreadable: {exc}") from None


def _identity_change(cfg: Config, info: DatasetInfo, state: dict, fs: pafs.FileSystem,
                     folder: str) -> str | None:
    """What differs in the data identity (path, seed, partitions, shards) since the checkpoint."""
    current = data_identity(cfg, info)
    data = state["config"].get("data")
    data = data if isinstance(data, dict) else {}
    saved = {"seed": data["seed"]} if isinstance(data.get("seed"), int) else {}
    if data.get("global_batch_tokens") and data.get("micro_batch_tokens"):
        saved["partitions"] = data["global_batch_tokens"] // data["micro_batch_tokens"]
    path = data.get("path")
    if isinstance(path, str) and ("://" in path or os.path.isabs(path)):
        # (a relative one depended on that run's working folder)
        saved["path"] = path.rstrip("/") if "://" in path else os.path.normpath(path)
    identity_path = f"{folder}/{IDENTITY_FILE}"
    if fs.get_file_info(identity_path).type == pafs.FileType.File:
        recorded = _read_json(fs, identity_path, "run file")
        saved.update(recorded if isinstance(recorded, dict) else {})
    return identity_change(saved, current)
