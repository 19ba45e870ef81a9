"""Checks of a run's inputs that need no cluster: sample ids, storage, GPU, data identity,
the reduction.

Each raises ConfigError (or ValueError for a data set) with one line naming the key or file.

Sample identity. A sample is the `id` of its row: users bring their own ids (`prepare` writes
0..N-1), `data.record_ids` logs them, and exactly-once means each id trained once per epoch.
So ids must be unique, non-null integers >= 0; `check_sample_ids` reads the `id` column only
(column projection, about a million at a time) and checks that before Ray starts. The first
pass keeps per batch only its (min, max) and whether it is strictly increasing: batches that
each increase and whose ranges do not overlap (what `prepare` writes) are unique without holding
the ids. Otherwise a second pass sorts all ids (8 bytes a row, twice) to find a repeated one.
Measured on a synthetic 10-million-row int64 shard on the shared 2-core machine: ids in
increasing ranges 0.85 s in row groups of a million rows, 2.0 s in row groups of 128 (decoding
78,000 row groups); shuffled unique ids 2.4 s (two passes, a sort of 80 MB); one repeated id
3.9 s (a third pass finds its rows). Memory: 8 MiB a batch, plus 16 bytes a row when sorting.

Data identity. A checkpoint's data position (epoch, step in epoch) means something only for the
data set, seed and cut into steps (partition count, micro-batch tokens, shuffle window,
bucketing) it was saved with; `data_identity` states them (with the shard names and row counts)
and `identity_change` says what differs, so that a resumed run on other data, or on the same
data cut otherwise, is refused by name instead of silently reading a position of something else
(within an epoch's first shuffle window a position cut otherwise still checks out on the
workers: samples would be trained twice and others never).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from elastic_train.config import (
    Config,
    ConfigError,
    batch_tokens,
    check_compression,
    choose_grad_reduce,
    num_partitions,
)
from elastic_train.data.dataset import DatasetInfo
from elastic_train.observe.runfolder import STORE_TIMEOUT_S, call_within

STORAGE_PROBE_TIMEOUT_S = STORE_TIMEOUT_S
ID_BATCH_ROWS = 1 << 20  # ids read at a time (8 MiB), across row groups
IDENTITY_FILE = "dataset.json"  # in the run folder: the data identity of the latest fit


@dataclass
class _Group:
    """One batch of ids, summarised by the first pass."""

    file: str
    first_row: int  # row number of its first row in `file`
    low: int
    high: int
    increasing: bool


def _id_values(ids: pa.Array, file: str, first_row: int) -> np.ndarray:
    """A batch of ids as int64; ValueError at the first null or negative one."""
    if ids.null_count:
        row = first_row + int(np.flatnonzero(pc.is_null(ids).to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"dataset file '{file}' row {row}: sample id is null; every row needs "
                         "a unique integer id >= 0")
    try:
        values = pc.cast(ids, pa.int64()).to_numpy()
    except pa.ArrowInvalid as exc:
        raise ValueError(f"dataset file '{file}': an id does not fit int64 ({exc})") from None
    negative = np.flatnonzero(values < 0)
    if negative.size:
        at = int(negative[0])
        raise ValueError(f"dataset file '{file}' row {first_row + at}: sample id {values[at]} is "
                         "negative; ids must be unique integers >= 0")
    return values


def _each_group(info: DatasetInfo):
    """(file, first row, ids) of every batch of every shard, ids checked for nulls and sign."""
    for file in info.files:
        try:
            with info.filesystem.open_input_file(file) as handle:
                parquet = pq.ParquetFile(handle)
                kind = parquet.schema_arrow.field("id").type
                if not pa.types.is_integer(kind):
                    raise ValueError(f"dataset file '{file}': column 'id' must be integers, "
                                     f"not {kind}")
                row = 0
                for batch in parquet.iter_batches(batch_size=ID_BATCH_ROWS, columns=["id"]):
                    values = _id_values(batch.column(0), file, row)
                    yield file, row, values
                    row += len(values)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"dataset file '{file}' cannot be read: {exc}") from None


def check_sample_ids(info: DatasetInfo) -> None:
    """Every row's `id` is a non-null integer >= 0, unique over the data set (see the module
    docstring for how and at what cost); ValueError naming the file, row and id otherwise."""
    groups = []
    for file, row, values in _each_group(info):
        if len(values):
            increasing = bool(np.all(values[1:] > values[:-1]))
            groups.append(_Group(file, row, int(values.min()), int(values.max()), increasing))
    groups.sort(key=lambda g: g.low)
    disjoint = all(a.high < b.low for a, b in zip(groups, groups[1:], strict=False))
    if disjoint and all(g.increasing for g in groups):
        return
    ids = np.sort(np.concatenate([values for _, _, values in _each_group(info)]))
    repeated = np.flatnonzero(ids[1:] == ids[:-1])
    if repeated.size:
        _raise_repeated(info, int(ids[repeated[0]]))


def _raise_repeated(info: DatasetInfo, sample_id: int) -> None:
    """The error for an id found twice, naming the two rows that hold it."""
    places = []
    for file, row, values in _each_group(info):
        for at in np.flatnonzero(values == sample_id)[:2]:
            places.append(f"'{file}' row {row + int(at)}")
        if len(places) >= 2:
            break
    raise ValueError(f"dataset: sample id {sample_id} appears more than once ({' and '.join(places)}); "
                     "ids must be unique, as exactly-once training counts samples by id")


def _probe_local(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"run.storage_path: '{path}' exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"run.storage_path: cannot create '{path}': {exc.strerror or exc}") from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".elastic-train-probe-", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(f"run.storage_path: '{path}' is not writable: {exc.strerror or exc}") from None


def _probe_uri(uri: str) -> None:
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (pa.ArrowException, ValueError, OSError) as exc:  # OSError: a bucket's region unknown
        detail = " ".join(str(exc).split())
        raise ConfigError(f"run.storage_path: '{uri}' cannot be opened: {detail}") from None
    probe = f"{path.rstrip('/')}/.elastic-train-probe-{uuid.uuid4().hex}"
    try:
        fs.create_dir(path, recursive=True)
        with fs.open_output_stream(probe) as f:
            f.write(b"probe")
        fs.delete_file(probe)
    except (pa.ArrowException, OSError) as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"run.storage_path: cannot write to '{uri}': {detail}") from None


def check_compile_cache(cfg: Config) -> None:
    """train.compile_cache_dir, when set, can be a folder here: it is one, or the nearest part
    of its path that exists is a folder this process may write in (the workers make it on their
    nodes; nothing is created here). ConfigError naming the key otherwise."""
    if not (cfg.train.compile and cfg.train.compile_cache_dir):
        return
    path = os.path.abspath(os.path.expanduser(cfg.train.compile_cache_dir))
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"train.compile_cache_dir: '{path}' is a folder this user cannot "
                              "write in")
        return
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"train.compile_cache_dir: '{parent}' is a file, so '{path}' cannot be "
                          "a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"train.compile_cache_dir: '{path}' cannot be made: '{parent}' is not "
                          "writable by this user")


def check_storage(cfg: Config, timeout_s: float = STORAGE_PROBE_TIMEOUT_S) -> None:
    """run.storage_path can hold the run: a local folder is created (if absent) and must take a
    file; a URI must take a small file written and deleted within `timeout_s`. The run folder,
    if it exists, must be a folder. ConfigError naming run.storage_path otherwise."""
    storage = cfg.run.storage_path
    if "://" not in storage:
        path = os.path.abspath(os.path.expanduser(storage))
        _probe_local(path)
        run = os.path.join(path, cfg.run.name)
        if os.path.exists(run) and not os.path.isdir(run):
            raise ConfigError(f"run.name: the run folder '{run}' exists and is not a folder")
        return
    answered, _ = call_within(lambda: _probe_uri(storage), timeout_s)
    if not answered:
        raise ConfigError(f"run.storage_path: '{storage}' did not answer a test write within "
                          f"{timeout_s:g} s; is it reachable from here?")


def check_reduce(cfg: Config, checkpoint_state: dict[str, Any] | None) -> None:
    """The reduction the workers will choose (`choose_grad_reduce`, with the choice saved in the
    latest checkpoint's state.json) can honour `train.grad_compression`: with `auto` on CPU
    workers it resolves to exact, which refuses compression, here before any worker starts."""
    train_state = (checkpoint_state or {}).get("train_state")
    saved = train_state.get("grad_reduce") if isinstance(train_state, dict) else None
    check_compression(cfg.train, choose_grad_reduce(cfg.train, cfg.scaling.use_gpu, saved))


def check_gpu(cfg: Config) -> None:
    """scaling.use_gpu=true on a local cluster needs a CUDA device here (a remote cluster's GPUs
    are looked at after joining it: see api.init_ray)."""
    if not cfg.scaling.use_gpu or cfg.run.address or os.environ.get("RAY_ADDRESS"):
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("scaling.use_gpu=true, but this machine has no CUDA GPU and the run "
                          "would start a local Ray cluster; set scaling.use_gpu=false, or "
                          "run.address (RAY_ADDRESS) to a cluster with GPUs")


def data_identity(cfg: Config, info: DatasetInfo) -> dict[str, Any]:
    """What a checkpoint's data position depends on: data set, seed, the share of its row
    groups held out for evaluation (None where the held-out documents are apart, prepared
    with --eval-fraction: eval.fraction then changes nothing of what is trained on), shards,
    and how each partition's stream is cut into micro-batches (`CUT_KEYS`: partitions,
    micro-batch tokens, shuffle window, bucketing)."""
    shards = []
    for file in info.files:
        with info.filesystem.open_input_file(file) as handle:
            shards.append([file.rsplit("/", 1)[-1], pq.ParquetFile(handle).metadata.num_rows])
    d = cfg.data
    return {"path": _shown_path(info), "seed": d.seed, "partitions": num_partitions(cfg),
            "micro_batch_tokens": batch_tokens(cfg)[0], "shuffle_window": d.shuffle_window,
            "bucketing": d.bucketing,
            "held_out": None if info.eval_split is not None else cfg.eval.fraction,
            "shards": shards}


# The identity's keys that say how the data is cut into steps, not which data it is.
CUT_KEYS = ("micro_batch_tokens", "partitions", "shuffle_window", "bucketing")


def _shown_path(info: DatasetInfo) -> str:
    if isinstance(info.filesystem, pafs.LocalFileSystem):
        return info.path
    return f"{info.filesystem.type_name}://{info.path}"


def identity_change(saved: dict[str, Any], current: dict[str, Any]) -> tuple[str, str] | None:
    """What differs between a saved data identity (any subset of the keys) and the current one:
    (the key, what), or None."""
    labels = {"path": "data.path", "seed": "data.seed",
              "micro_batch_tokens": "data.micro_batch_tokens",
              "partitions": "partition count (data.global_batch_tokens / data.micro_batch_tokens)",
              "shuffle_window": "data.shuffle_window", "bucketing": "data.bucketing",
              "held_out": "eval.fraction (the share of data.path's row groups held out from "
                          "training)"}
    for key, label in labels.items():
        if key in saved and current.get(key) is not None and saved[key] is not None \
                and saved[key] != current[key]:
            return key, f"{label} was {saved[key]!r}, now {current[key]!r}"
    if "shards" in saved and [list(s) for s in saved["shards"]] != current["shards"]:
        old = {name: rows for name, rows in saved["shards"]}
        new = dict(current["shards"])
        diff = sorted(set(old.items()) ^ set(new.items()))
        name = diff[0][0]
        return "shards", (f"the data set's shards changed: {name} had {old.get(name, 'no')} "
                          f"rows, now {new.get(name, 'no')} ({len(old)} shards then, {len(new)} now)")
    return None
