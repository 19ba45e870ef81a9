"""Checkpoints: everything needed to continue exactly, written so that only complete ones count.

The weights and optimizer state are the same on every rank, so each of W ranks copies and writes
1/W of them, in parallel (`shard_owners`: whole tensors, balanced by bytes): `model.shardNNN.pt`
and `optimizer.shardNNN.pt`, then its manifest, `manifest.shardNNN.json`, naming its files and
sizes (and a stateful communication hook's state of that rank, `comm_hook.shardNNN.pt`: PowerSGD's
error feedback, see commhooks.py). Rank 0 also writes `extra.pt` (grad scaler, RNG states) and
`state.json` (counters, data position, world size, resolved config, model signature, provenance),
and its manifest is `manifest.json`, which names the number of shards. A folder is complete when
every shard's manifest is there with every file it names at its size; an incomplete one is never
loaded. Ray Train registers a checkpoint only after every rank's files are uploaded and every rank
has reported, so a crash mid-write leaves the previous checkpoint as the latest. A checkpoint loads
at any world size (the shards are merged). Format 1 (one `model.pt`, `optimizer.pt`) still loads.
A `train.sharding=fsdp` run writes the same files, each holding its rank's rows of every tensor
(sharding.py writes them, shardfiles.py reads them): it loads here, whole, as well.

The training loop blocks only for `snapshot` (an in-memory copy of this rank's share on the CPU);
`write_checkpoint` runs in Ray's background upload thread.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from elastic_train.config import redact
from elastic_train.training.shardfiles import ShardedFiles, read_sharded, sharding_of

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 2: model and optimizer state in shards, one per rank; 1 (one file) still read
BEST_POINTER = "best_checkpoint.json"  # names the run's best checkpoint folder (keep_best)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the mismatch."""


def _to_cpu(obj: Any, copy: bool = True) -> Any:
    """A CPU copy of a nest of tensors. A GPU tensor goes to pinned (page-locked) host memory with
    an asynchronous copy: the copies of a whole snapshot overlap and run at full PCIe speed;
    `snapshot` waits for them before the snapshot is handed to the writer. `copy=False` takes a
    CPU tensor as it is (a save written before training goes on needs no copy of it)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:
            host = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=True)
            return host.copy_(obj.detach(), non_blocking=True)
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v, copy) for v in obj)
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


def shard_owners(model: torch.nn.Module, shards: int) -> dict[str, int]:
    """Which rank writes each tensor of the model's state dict: the largest first, each to the rank
    with the fewest bytes so far (ties by name), so the ranks' shares differ by at most one tensor.
    A function of the model alone: every rank computes the same split."""
    sizes = sorted(((t.numel() * t.element_size(), name) for name, t in model.state_dict().items()),
                   key=lambda x: (-x[0], x[1]))
    load, owners = [0] * shards, {}
    for size, name in sizes:
        rank = min(range(shards), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += size
    return owners


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """The optimizer's state index of each parameter -> its name in the model's state dict."""
    by_id = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {i: by_id.get(id(p), f"#{i}") for i, p in enumerate(params)}


def snapshot(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    train_state: dict[str, Any],
    config: dict[str, Any],
    world_size: int,
    provenance: dict[str, Any] | None = None,
    shard: int = 0,
    shards: int = 1,
    comm_hook: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An in-memory CPU copy of this rank's share of a checkpoint (the only part that blocks).

    The weights and optimizer state are replicated on every rank, so each rank copies and writes
    1/`shards` of them (`shard_owners`), in parallel; shard 0 also holds the optimizer's param
    groups, the grad scaler, the RNG states and `state.json` (counters, data position, world
    size, config, model signature and `provenance`: what wrote it). `comm_hook`: this rank's state
    of a stateful communication hook, {"kind", "world_size", "state"}, already on the CPU."""
    owners = shard_owners(model, shards)
    names = _parameter_names(model, optimizer)
    optim = optimizer.state_dict()
    part = {"state": {i: v for i, v in optim["state"].items() if owners.get(names[i], 0) == shard}}
    if shard == 0:
        part["param_groups"] = optim["param_groups"]
    snap = {
        "shard": shard,
        "shards": shards,
        "model": _to_cpu({k: v for k, v in model.state_dict().items() if owners[k] == shard}),
        "optimizer": _to_cpu(part),
        "comm_hook": comm_hook,
    }
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the asynchronous copies to pinned memory have landed
    if shard == 0:
        snap["extra"] = {"scaler": scaler.state_dict() if scaler is not None else None,
                         "rng": _to_cpu(rng_state())}
        snap["state"] = {
            "format_version": FORMAT_VERSION,
            "train_state": dict(train_state),
            "world_size": world_size,
            "shards": shards,
            "config": config,
            "model_signature": model_signature(model),
            "provenance": provenance or {},
        }
    return snap


def _shard_manifest(shard: int) -> str:
    return f"manifest.shard{shard:03d}.json"


STAGING_PREFIX = "elastic-train-ckpt-"


def staging_folder() -> str:
    """A new local folder for one checkpoint's files before Ray copies them to the run's storage
    (the caller deletes it after the copy: Ray 2.60 deletes the local copy of an ASYNC upload
    only, and each run left its final checkpoint's, one model-and-optimizer copy per rank, in the
    temporary folder, and a killed writer its half-written one). Named by this process's pid and
    host (`elastic-train-ckpt-<pid>.<host>.*`); folders of this host's processes no longer alive
    (killed mid-write or mid-copy) are deleted first, so a node's disk keeps no checkpoint copies
    of dead workers. The host in the name keeps containers that share a temporary folder, each
    with pids of its own, out of each other's folders."""
    import glob
    import socket

    import psutil

    tmp, host = Path(tempfile.gettempdir()), socket.gethostname()
    for path in tmp.glob(f"{STAGING_PREFIX}*.{glob.escape(host)}.*"):
        pid, _, rest = path.name[len(STAGING_PREFIX):].partition(".")
        if pid.isdigit() and rest.startswith(f"{host}.") and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}.{host}.", dir=tmp)


def write_checkpoint(snap: dict[str, Any], directory: str | Path, crash_midway: bool = False) -> None:
    """Write one rank's share of a checkpoint into `directory`, its manifest last: every rank's
    files go into the same folder (Ray uploads each rank's into the checkpoint's folder). Shard 0
    writes `manifest.json` (naming the number of shards), the others `manifest.shardNNN.json`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shard = snap.get("shard", 0)
    files = {}
    for name in ("model", "optimizer", "extra", "comm_hook"):
        if snap.get(name) is None:  # comm_hook: only a stateful hook has one
            continue
        path = directory / (f"{name}.pt" if name == "extra" else f"{name}.shard{shard:03d}.pt")
        torch.save(snap[name], path)
        files[path.name] = path.stat().st_size
        if crash_midway:  # test hook: the process dies with the checkpoint half written
            os._exit(1)
    if "state" in snap:
        # its config without the secrets of its URIs: a checkpoint is read by whoever reads the store
        (directory / "state.json").write_text(json.dumps(redact.shown_tree(snap["state"])))
        files["state.json"] = (directory / "state.json").stat().st_size
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    name = _shard_manifest(shard)
    if shard == 0:
        manifest["shards"], name = snap.get("shards", 1), MANIFEST
    tmp = directory / (name + ".tmp")
    tmp.write_text(json.dumps(manifest))
    os.replace(tmp, directory / name)


def _check_files(directory: Path, manifest_name: str) -> dict[str, Any]:
    path = directory / manifest_name
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete: no {manifest_name}")
    try:
        manifest = json.loads(path.read_text())
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"checkpoint {directory}: {manifest_name} is corrupt") from None
    for name, size in files.items():
        file = directory / name
        if not file.is_file() or file.stat().st_size != size:
            raise CheckpointError(f"checkpoint {directory} is incomplete: {name} missing or truncated")
    return manifest


def verify_checkpoint(directory: str | Path) -> None:
    """Raise CheckpointError unless every shard's manifest is there, with every file it names at
    its size (a checkpoint of format 1 has one manifest)."""
    directory = Path(directory)
    manifest = _check_files(directory, MANIFEST)
    for shard in range(1, manifest.get("shards", 1)):
        _check_files(directory, _shard_manifest(shard))


def is_complete(directory: str | Path) -> bool:
    try:
        verify_checkpoint(directory)
    except (CheckpointError, OSError):
        return False
    return True


def read_shards(directory: str | Path, name: str) -> dict[str, Any]:
    """The whole state dict of `name` ("model" or "optimizer"), merged from every shard of a
    complete checkpoint, on the CPU."""
    directory = Path(directory)
    if sharding_of(json.loads((directory / "state.json").read_text())) == "fsdp":
        return read_sharded(directory, name)  # rows of each tensor in each shard (shardfiles.py)
    load = dict(map_location="cpu", weights_only=True)
    shards = json.loads((directory / MANIFEST).read_text()).get("shards")
    if shards is None:  # format 1: one file
        return torch.load(directory / f"{name}.pt", **load)
    parts = [torch.load(directory / f"{name}.shard{r:03d}.pt", **load) for r in range(shards)]
    if name == "model":
        return {k: v for part in parts for k, v in part.items()}
    return {"state": {i: v for part in parts for i, v in part["state"].items()},
            "param_groups": parts[0]["param_groups"]}


def load_model_weights(directory: str | Path, model: torch.nn.Module) -> None:
    """The weights of a complete checkpoint into `model` (unsharded, any dtype): an fsdp one a
    tensor at a time (`ShardedFiles.copy_into`: no second copy of the model), others whole."""
    state = json.loads((Path(directory) / "state.json").read_text())
    if sharding_of(state) == "fsdp":
        ShardedFiles(directory, "model", state).copy_into(model)
    else:
        model.load_state_dict(read_shards(directory, "model"))


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
    load_model_weights(directory, model)  # copy_ casts fsdp's float64 master to the model's dtype
    optim = read_shards(directory, "optimizer")
    if sharding_of(state) == "fsdp":  # keyed by parameter name: the optimizer's own indices
        names = _parameter_names(model, optimizer)
        optim = {"state": {i: optim["state"][n] for i, n in names.items() if n in optim["state"]},
                 "param_groups": optim["param_groups"]}
    optimizer.load_state_dict(optim)
    extra = torch.load(directory / "extra.pt", map_location="cpu", weights_only=True)
    if scaler is not None and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if restore_rng:
        set_rng_state(extra["rng"])
    return state["train_state"]


def write_best(snap: dict[str, Any], fs: pafs.FileSystem, run_path: str, step: int,
               eval_loss: float) -> str:
    """Keep `snap` as the run's best checkpoint (`checkpoint.keep_best`), beside Ray's newest N.

    The folder `best_checkpoint_<step>` is written whole (manifest last), then `best_checkpoint.json`
    is replaced to name it, then the previous best is deleted: a crash at any point leaves a
    pointer to a complete folder (or none yet). Ray's own retention never sees these folders, so
    it cannot delete the best when it is older than the newest `checkpoint.keep`. A step
    trained again after a restart never writes into the folder the pointer names
    (`best_folder`)."""
    name = best_folder(fs, run_path, step, eval_loss)
    if name is None:
        return read_best_pointer(fs, run_path)["checkpoint"]
    write_best_files(snap, fs, run_path, name, clean=True)
    return commit_best(fs, run_path, name, step, eval_loss)


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint of `step` in the run folder (Ray's and in place alike)."""
    return f"checkpoint_{step:09d}"


def _best_name(step: int) -> str:
    return f"best_checkpoint_{step:09d}"


def best_folder(fs: pafs.FileSystem, run_path: str, step: int, eval_loss: float) -> str | None:
    """The folder the best checkpoint of `step` goes to: `best_checkpoint_<step>`, unless the
    pointer names that step's folder already. After a restart the steps since the restored
    checkpoint are trained again, and their evaluations are bests again: when the pointer's
    folder is whole and of the same evaluation loss to the bit (the step trained again as
    before, as the exact reduction does) it is kept as it is (None); otherwise the new one goes
    to `best_checkpoint_<step>.<n+1>`, so that the folder the pointer names is never removed
    or half rewritten (a crash then would leave the pointer naming a broken folder). Every rank
    reads the same pointer, so under fsdp all choose the same folder."""
    name, pointer = _best_name(step), read_best_pointer(fs, run_path)
    if pointer is None or pointer["checkpoint"].partition(".")[0] != name:
        return name
    whole = fs.get_file_info(f"{run_path}/{pointer['checkpoint']}/{MANIFEST}").type == pafs.FileType.File
    if whole and pointer.get("eval_loss") == eval_loss:
        return None
    suffix = pointer["checkpoint"].partition(".")[2]
    return f"{name}.{int(suffix) + 1 if suffix.isdigit() else 1}"


def write_best_files(snap: dict[str, Any], fs: pafs.FileSystem, run_path: str, name: str,
                     clean: bool) -> None:
    """Write one rank's share `snap` into the best checkpoint folder `name`; `clean` first
    removes what a crashed earlier attempt left there (only when one rank writes the folder)."""
    target = f"{run_path}/{name}"
    if isinstance(fs, pafs.LocalFileSystem):
        if clean:
            shutil.rmtree(target, ignore_errors=True)  # a crashed earlier attempt's half
        write_checkpoint(snap, target)
    else:
        with tempfile.TemporaryDirectory(prefix="elastic-train-best-") as local:
            write_checkpoint(snap, local)
            fs.create_dir(target, recursive=True)
            pafs.copy_files(local, target, destination_filesystem=fs)


def commit_best(fs: pafs.FileSystem, run_path: str, name: str, step: int, eval_loss: float) -> str:
    """Point `best_checkpoint.json` at the (complete) best folder `name`, of `step`, then delete
    the previous best. Returns the folder's name."""
    previous = read_best_pointer(fs, run_path)
    pointer = json.dumps({"checkpoint": name, "step": step, "eval_loss": eval_loss})
    with fs.open_output_stream(f"{run_path}/{BEST_POINTER}.tmp") as f:
        f.write(pointer.encode())
    fs.move(f"{run_path}/{BEST_POINTER}.tmp", f"{run_path}/{BEST_POINTER}")
    if previous and previous["checkpoint"] != name:
        try:
            fs.delete_dir(f"{run_path}/{previous['checkpoint']}")
        except OSError:
            pass  # already gone: nothing else refers to it
    return name


def complete_checkpoints(fs: pafs.FileSystem, folder: str) -> list[str]:
    """Names of the run folder's complete checkpoints (their manifest written), newest first;
    [] when the folder does not exist. An incomplete one is never loaded."""
    if fs.get_file_info(folder).type != pafs.FileType.Directory:
        return []
    names = sorted((f.base_name for f in fs.get_file_info(pafs.FileSelector(folder))
                    if f.type == pafs.FileType.Directory and f.base_name.startswith("checkpoint_")),
                   reverse=True)
    return [n for n in names if fs.get_file_info(f"{folder}/{n}/{MANIFEST}").type == pafs.FileType.File]


def read_best_pointer(fs: pafs.FileSystem, run_path: str) -> dict[str, Any] | None:
    """The run's `best_checkpoint.json` ({checkpoint, step, eval_loss}), or None."""
    try:
        with fs.open_input_stream(f"{run_path}/{BEST_POINTER}") as f:
            pointer = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return pointer if isinstance(pointer, dict) and isinstance(pointer.get("checkpoint"), str) else None


class BestCheckpointWriter:
    """Writes best checkpoints in a background thread (one at a time; the newest waits for the
    one before), so that the loop is blocked only for the snapshot."""

    def __init__(self, fs: pafs.FileSystem, run_path: str) -> None:
        self.fs, self.run_path = fs, run_path
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def adopt(self, state: Any) -> None:
        """A resumed state takes the best that `best_checkpoint.json` names when it is newer than
        the state's last evaluation and no later than its step: an evaluation after the
        checkpoint was written (the run's final one, on the step of its last periodic
        checkpoint, which the final save did not write again). Else a later, worse evaluation
        would count as an improvement, move the pointer to it and delete the true best."""
        pointer = read_best_pointer(self.fs, self.run_path)
        if pointer is None or not isinstance(pointer.get("step"), int) or not isinstance(
                pointer.get("eval_loss"), int | float):
            return
        if (state.eval_step < pointer["step"] <= state.step
                and (state.best_eval_loss is None or pointer["eval_loss"] < state.best_eval_loss)):
            state.best_eval_loss, state.best_step = float(pointer["eval_loss"]), pointer["step"]

    def submit(self, snap: dict[str, Any], step: int, eval_loss: float) -> None:
        self.wait()

        def write() -> None:
            try:
                write_best(snap, self.fs, self.run_path, step, eval_loss)
            except BaseException as exc:  # noqa: BLE001 - raised again by wait(), in the loop
                self._error = exc

        self._thread = threading.Thread(target=write, daemon=True)
        self._thread.start()

    def write_shard(self, snap: dict[str, Any], step: int, eval_loss: float,
                    barrier: Callable[[], None]) -> None:
        """`train.sharding=fsdp`: every rank holds a part of the model, so every rank writes its
        own rows (`sharding.sharded_snapshot`) into the one best folder, now, in the loop's
        thread; after `barrier` (a collective: every rank's files are written), rank 0 points
        `best_checkpoint.json` at it. The folder is not cleaned first (the ranks write into it
        at once): a crashed attempt's files there are overwritten or, beyond the new manifest's
        shards, ignored, and nothing reads the folder before the pointer names it."""
        self.wait()
        name = best_folder(self.fs, self.run_path, step, eval_loss)
        if name is None:  # the same on every rank
            return
        write_best_files(snap, self.fs, self.run_path, name, clean=False)
        barrier()
        if snap["shard"] == 0:
            commit_best(self.fs, self.run_path, name, step, eval_loss)

    def wait(self) -> None:
        """Until the write in flight ends; raises what it raised (a full disk, say)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def load_comm_hook_state(directory: str | Path, kind: str, world_rank: int,
                         world_size: int) -> dict[str, Any] | None:
    """This rank's state of communication hook `kind`, saved at the same world size (each rank
    wrote its own in its shard); None when the checkpoint has none that fits (another hook,
    another world size)."""
    path = Path(directory) / f"comm_hook.shard{world_rank:03d}.pt"
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if saved["kind"] != kind or saved["world_size"] != world_size:
        return None
    return saved["state"]
