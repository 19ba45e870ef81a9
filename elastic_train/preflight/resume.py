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
    CUT_KEYS,
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
    newest = _newest_checkpoint(cfg)
    if newest is None:
        return None
    fs, folder, name, state = newest
    mismatch = signature_mismatch(state, ours)
    if mismatch:
        raise ConfigError(f"run {cfg.run.name}: its latest checkpoint {name} {mismatch}; use "
                          f"another run.name, or the model config it was trained with")
    optim = state["config"].get("optim")
    saved_optimizer = optim.get("name") if isinstance(optim, dict) else None
    if isinstance(saved_optimizer, str) and saved_optimizer != cfg.optim.name:
        raise ConfigError(
            f"optim.name: run {cfg.run.name}'s latest checkpoint {name} holds the state of "
            f"{saved_optimizer} (its moments), which {cfg.optim.name} cannot take: resume with "
            f"optim.name={saved_optimizer}, or start another run.name")
    train = state["config"].get("train")
    saved_loss = train.get("loss_fn") if isinstance(train, dict) else None
    if saved_loss and not cfg.train.loss_fn:
        raise ConfigError(
            f"train.loss_fn: run {cfg.run.name}'s latest checkpoint {name} was trained with a "
            f"loss of its own ({saved_loss}), and this resume would go on with the default loss: "
            f"pass it again, train(cfg, loss_fn={saved_loss.rsplit('.', 1)[-1]}), or start "
            "another run.name")
    if info is not None:
        _check_same_data(cfg, info, state, fs, folder, name)
    _check_same_base(cfg, fs, f"{folder}/{name}", name)
    for note in (lr_change_note(cfg, state), eval_change_note(cfg, state)):
        if note:
            logger.warning(note)
    return state


EVAL_SET_KEYS = ("path", "fraction", "max_batches")  # what the evaluation loss is measured on


def eval_change_note(cfg: Config, state: dict[str, Any]) -> str | None:
    """One line when the resume evaluates on another set than the checkpoint's run did (another
    eval.path, eval.fraction or eval.max_batches) and the run has a best so far: its loss was
    measured on the other set, and the best checkpoint and summary.json's best_* compare the
    two as they are."""
    saved = state.get("config", {}).get("eval")
    best = state.get("train_state", {}).get("best_eval_loss")
    if not isinstance(saved, dict) or best is None:
        return None
    changed = [f"eval.{key} {saved.get(key)!r} -> {getattr(cfg.eval, key)!r}"
               for key in EVAL_SET_KEYS if key in saved and saved[key] != getattr(cfg.eval, key)]
    if not changed:
        return None
    step = state["train_state"].get("best_step")
    return (f"run {cfg.run.name}: resuming with another evaluation set ({', '.join(changed)}): the "
            f"best so far (eval loss {best:.4g} at step {step}) was measured on the other one, and "
            "the best checkpoint and summary.json's best_* compare losses of both; to compare like "
            "with like, resume with the checkpoint's eval settings")


def _newest_checkpoint(cfg: Config) -> tuple[pafs.FileSystem, str, str, dict[str, Any]] | None:
    """(filesystem, run folder, name, state.json) of the run folder's newest complete
    checkpoint, or None; a state.json that is not one is a ConfigError naming it."""
    fs, folder, _ = split_uri(run_uri(cfg))
    for name in complete_checkpoints(fs, folder):
        directory = f"{folder}/{name}"
        state = _read_json(fs, f"{directory}/state.json", "checkpoint file")
        if not (isinstance(state, dict) and isinstance(state.get("config"), dict)
                and isinstance(state.get("model_signature"), dict)):
            raise ConfigError(f"checkpoint file '{directory}/state.json' is corrupt: not the state "
                              "of a checkpoint")
        return fs, folder, name, state
    return None


def keep_batch_sizes(cfg: Config) -> None:
    """A resume keeps the batch sizes its run had where the config leaves them to the data:
    derived afresh (inputs.fill_batch_tokens) they depend on scaling.max_workers and the
    device, so resuming on more workers or on GPUs would cut the data into other steps and the
    checkpoint's data position would be refused (or mean other samples). Set explicitly, they
    are the user's, and a change of the cut is refused naming the key (check_resumable)."""
    d = cfg.data
    if d.micro_batch_tokens is not None and d.global_batch_tokens is not None:
        return
    newest = _newest_checkpoint(cfg)
    saved = newest[3]["config"].get("data") if newest is not None else None
    if not isinstance(saved, dict):
        return
    kept = [key for key in ("micro_batch_tokens", "global_batch_tokens")
            if getattr(d, key) is None and isinstance(saved.get(key), int) and saved[key] > 0]
    for key in kept:
        setattr(d, key, saved[key])
    if d.micro_batch_tokens and d.global_batch_tokens:
        partitions = d.global_batch_tokens // d.micro_batch_tokens
        if kept and partitions < cfg.scaling.max_workers:
            raise ConfigError(
                f"scaling.max_workers: run {cfg.run.name} cuts each step into {partitions} "
                f"micro-batches (data.global_batch_tokens {d.global_batch_tokens} / "
                f"data.micro_batch_tokens {d.micro_batch_tokens}, as its checkpoint {newest[2]} "
                f"has them), so it trains on at most {partitions} workers, not "
                f"{cfg.scaling.max_workers}: resume with scaling.max_workers={partitions} or "
                "fewer, or start another run.name")


def lr_change_note(cfg: Config, state: dict[str, Any]) -> str | None:
    """One line when the resume changes the learning-rate schedule at the resume step (another
    train.max_steps or train.epochs moves the cosine's end, optim.schedule_steps; other optim.lr,
    warmup_steps or min_lr_ratio move it too): the LR that step had under the checkpoint's
    config, and the one it gets now. The schedule is the current config's: a larger
    train.max_steps stretches the cosine, so the LR of the resume step goes back up
    (docs/fault_tolerance.md)."""
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
    old_end = old_optim.schedule_steps or old_max
    new_end = cfg.optim.schedule_steps or cfg.train.max_steps
    why = "the optim settings changed"
    if old_end != new_end:  # a checkpoint from before optim.schedule_steps ended it at max_steps
        why = f"the schedule's end moves from step {old_end} to {new_end}"
        moved = [f"{key} {a} -> {b}" for key, a, b in (
            ("train.max_steps", old_max, cfg.train.max_steps),
            ("train.epochs", saved.get("train", {}).get("epochs"), cfg.train.epochs))
            if a is not None and a != b]
        why += f" ({', '.join(moved)})" if moved else ""
        why += f"; optim.schedule_steps={old_end} keeps the checkpoint's"
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
    if identity is not None and identity[0] in CUT_KEYS and cfg.data.on_change != "keep_position":
        step = state.get("train_state", {}).get("step", "?")
        raise ConfigError(
            f"run {cfg.run.name}: its latest checkpoint {name} (step {step}) holds a data position "
            f"in the data as cut into steps then, and {identity[1]}: cut otherwise, the rest of "
            "the epoch would train some samples twice and others never. Set it back to resume, "
            "or use another run.name (data.on_change=keep_position resumes anyway)")
    saved = state.get("provenance") if isinstance(state.get("provenance"), dict) else {}
    if identity is not None:  # it says more than the manifest hash that changes with it
        saved = {k: v for k, v in saved.items() if k != "data_hash"}
    refusing, warning = (provenance.changes(saved, provenance.driver_record(info)) if saved
                         else ([], []))
    refusing += [identity[1]] if identity is not None else []
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
                     folder: str) -> tuple[str, str] | None:
    """What differs in the data identity (checks.data_identity) since the checkpoint: (key,
    what), or None. The checkpoint's own config says the seed and the cut; the run folder's
    dataset.json, where there is one, says the rest."""
    current = data_identity(cfg, info)
    data = state["config"].get("data")
    data = data if isinstance(data, dict) else {}
    saved = {"seed": data["seed"]} if isinstance(data.get("seed"), int) else {}
    if data.get("global_batch_tokens") and data.get("micro_batch_tokens"):
        saved["partitions"] = data["global_batch_tokens"] // data["micro_batch_tokens"]
        saved["micro_batch_tokens"] = data["micro_batch_tokens"]
    saved.update({k: data[k] for k in ("shuffle_window", "bucketing") if k in data})
    path = data.get("path")
    if isinstance(path, str) and ("://" in path or os.path.isabs(path)):
        # (a relative one depended on that run's working folder)
        saved["path"] = path.rstrip("/") if "://" in path else os.path.normpath(path)
    identity_path = f"{folder}/{IDENTITY_FILE}"
    if fs.get_file_info(identity_path).type == pafs.FileType.File:
        recorded = _read_json(fs, identity_path, "run file")
        saved.update(recorded if isinstance(recorded, dict) else {})
    return identity_change(saved, current)
