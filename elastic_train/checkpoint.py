"""Checkpoints: everything needed to continue exactly, written so that only complete ones count.

A checkpoint folder holds `model.pt`, `optimizer.pt`, `extra.pt` (grad scaler, RNG states),
`comm_hook.pt` with a stateful communication hook (every rank's PowerSGD state, see commhooks.py)
and `state.json` (counters, data position, world size, resolved config, model signature), then
`manifest.json` last, naming every file and its size. A folder without a valid manifest is
incomplete and never loaded. Ray Train registers a checkpoint only after every file is uploaded and
every rank has reported, so a crash mid-write leaves the previous checkpoint as the latest.

The training loop blocks only for `snapshot` (an in-memory copy on the CPU); `write_checkpoint`
runs in Ray's background upload thread.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the mismatch."""


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def model_signature(model: torch.nn.Module) -> dict[str, list[int]]:
    return {name: list(t.shape) for name, t in model.state_dict().items()}


def snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    train_state: dict[str, Any],
    config: dict[str, Any],
    world_size: int,
    comm_hook: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An in-memory CPU copy of everything a checkpoint holds (the only part that blocks).

    `comm_hook`: {"kind", "world_size", "ranks": [each rank's state, in rank order]}, already on
    the CPU, or None for a hook without state."""
    return {
        "model": _to_cpu(model.state_dict()),
        "comm_hook": comm_hook,
        "optimizer": _to_cpu(optimizer.state_dict()),
        "extra": {
            "scaler": scaler.state_dict() if scaler is not None else None,
            "rng": _to_cpu(rng_state()),
        },
        "state": {
            "format_version": FORMAT_VERSION,
            "train_state": dict(train_state),
            "world_size": world_size,
            "config": config,
            "model_signature": model_signature(model),
        },
    }


def write_checkpoint(snap: dict[str, Any], directory: str | Path, crash_midway: bool = False) -> None:
    """Write a snapshot into `directory`; the manifest goes last and makes it complete."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in ("model", "optimizer", "extra", "comm_hook"):
        if snap.get(name) is None:  # comm_hook: only a stateful hook has one
            continue
        path = directory / f"{name}.pt"
        torch.save(snap[name], path)
        files[path.name] = path.stat().st_size
        if crash_midway:  # test hook: the process dies with the checkpoint half written
            os._exit(1)
    (directory / "state.json").write_text(json.dumps(snap["state"]))
    files["state.json"] = (directory / "state.json").stat().st_size
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"format_version": FORMAT_VERSION, "files": files}))
    os.replace(tmp, directory / MANIFEST)


def verify_checkpoint(directory: str | Path) -> None:
    """Raise CheckpointError unless every file of the manifest is there with its size."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {MANIFEST}")
    manifest = json.loads(manifest_path.read_text())
    for name, size in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} missing or truncated")


def read_state(directory: str | Path) -> dict[str, Any]:
    """The counters, world size and config of a complete checkpoint."""
    verify_checkpoint(directory)
    return json.loads((Path(directory) / "state.json").read_text())


def check_compatible(directory: str | Path, state: dict[str, Any], model: torch.nn.Module) -> None:
    """Refuse a checkpoint written for a different model, naming the first mismatch."""
    mismatch = signature_mismatch(state, model_signature(model))
    if mismatch:
        raise CheckpointError(f"checkpoint {directory} {mismatch}")


def signature_mismatch(state: dict[str, Any], ours: dict[str, list[int]]) -> str | None:
    """Why a checkpoint's state.json does not fit a model of signature `ours`; None if it fits."""
    theirs = state["model_signature"]
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            saved = state.get("config", {}).get("model", {})
            return (f"does not fit the configured model: parameter '{name}' has shape "
                    f"{theirs.get(name)} in the checkpoint and {ours.get(name)} in the model "
                    f"(checkpoint's model config: {saved})")
    return None


def load_checkpoint(
    directory: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any = None,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore model, optimizer, scaler and RNG in place; return the saved train state."""
    directory = Path(directory)
    state = read_state(directory)
    check_compatible(directory, state, model)
    load = dict(map_location="cpu", weights_only=True)
    model.load_state_dict(torch.load(directory / "model.pt", **load))
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", **load))
    extra = torch.load(directory / "extra.pt", **load)
    if scaler is not None and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if restore_rng:
        set_rng_state(extra["rng"])
    return state["train_state"]


def load_comm_hook_state(directory: str | Path, kind: str, world_rank: int,
                         world_size: int) -> dict[str, Any] | None:
    """This rank's state of communication hook `kind`, saved at the same world size; None when
    the checkpoint has none that fits (another hook, another world size). The file holds every
    rank's state: memory-mapped, so a rank reads its own part only."""
    path = Path(directory) / "comm_hook.pt"
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if saved["kind"] != kind or saved["world_size"] != world_size:
        return None
    return saved["ranks"][world_rank]
