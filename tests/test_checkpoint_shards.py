"""Checkpoints written in shards, one per rank: balanced, complete only with every shard, loadable
at any world size, and the old one-file format still read."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from elastic_train.config import ModelConfig, OptimConfig
from elastic_train.training.checkpoint import (
    MANIFEST,
    is_complete,
    load_checkpoint,
    read_shards,
    shard_owners,
    snapshot,
    staging_folder,
    write_checkpoint,
)
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer
from elastic_train.training.step import TrainState

pytestmark = pytest.mark.unit
MODEL = ModelConfig(n_layer=2, d_model=64, n_head=2, vocab_size=256)


def trained(seed: int = 0):
    """A model and AdamW after one step (so the optimizer has state)."""
    torch.manual_seed(seed)
    model = build_model(MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    loss = model(torch.randint(0, 256, (2, 16))).float().pow(2).mean()
    loss.backward()
    optimizer.step()
    return model, optimizer


def test_shards_are_balanced_by_bytes_and_the_same_on_every_rank():
    model, _ = trained()
    sizes = {k: t.numel() * t.element_size() for k, t in model.state_dict().items()}
    for shards in (1, 2, 3, 8):
        owners = shard_owners(model, shards)
        assert set(owners) == set(sizes) and set(owners.values()) <= set(range(shards))
        load = [sum(sizes[k] for k, r in owners.items() if r == s) for s in range(shards)]
        assert max(load) - min(load) <= max(sizes.values())
        assert owners == shard_owners(trained(seed=1)[0], shards)  # names and shapes only


@pytest.mark.parametrize("shards", [1, 3])
def test_every_rank_writes_its_share_and_a_checkpoint_loads_whole_at_any_size(tmp_path, shards):
    model, optimizer = trained()
    state = asdict(TrainState(step=7))
    folder = tmp_path / "ckpt"
    snaps = [snapshot(model, optimizer, None, state, {}, shards, shard=r, shards=shards)
             for r in range(shards)]
    for snap in reversed(snaps):  # rank 0 need not be last, nor first
        assert not is_complete(folder) or snap["shard"] == 0
        write_checkpoint(snap, folder)
    assert is_complete(folder)
    assert json.loads((folder / MANIFEST).read_text())["shards"] == shards
    # Each rank copied only its tensors: together they are the whole state, once.
    keys = [set(s["model"]) for s in snaps]
    assert set().union(*keys) == set(model.state_dict()) and sum(map(len, keys)) == len(model.state_dict())
    fresh, fresh_opt = trained(seed=1)
    assert load_checkpoint(folder, fresh, fresh_opt)["step"] == 7
    for name, t in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    want, got = optimizer.state_dict(), fresh_opt.state_dict()
    assert want["param_groups"] == got["param_groups"] and set(want["state"]) == set(got["state"])
    for i, s in want["state"].items():
        assert all(torch.equal(s[k], got["state"][i][k]) for k in s), i
    assert read_shards(folder, "model").keys() == model.state_dict().keys()


def test_a_checkpoint_missing_one_shard_is_incomplete(tmp_path):
    model, optimizer = trained()
    folder = tmp_path / "ckpt"
    for r in (0, 2):  # rank 1 died before its manifest
        write_checkpoint(snapshot(model, optimizer, None, {}, {}, 3, shard=r, shards=3), folder)
    assert not is_complete(folder)
    write_checkpoint(snapshot(model, optimizer, None, {}, {}, 3, shard=1, shards=3), folder)
    assert is_complete(folder)
    (folder / "optimizer.shard001.pt").write_bytes(b"cut")
    assert not is_complete(folder)


def test_the_one_file_format_still_loads(tmp_path):
    model, optimizer = trained()
    snap = snapshot(model, optimizer, None, asdict(TrainState(step=3)), {}, 1)
    folder = tmp_path / "v1"
    folder.mkdir()
    files = {}
    for name in ("model", "optimizer", "extra"):
        torch.save(snap[name], folder / f"{name}.pt")
        files[f"{name}.pt"] = (folder / f"{name}.pt").stat().st_size
    (folder / "state.json").write_text(json.dumps({**snap["state"], "format_version": 1}))
    files["state.json"] = (folder / "state.json").stat().st_size
    (folder / MANIFEST).write_text(json.dumps({"format_version": 1, "files": files}))
    fresh, fresh_opt = trained(seed=1)
    assert is_complete(folder) and load_checkpoint(folder, fresh, fresh_opt)["step"] == 3
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_a_new_staging_folder_deletes_those_of_dead_processes_only(monkeypatch, tmp_path):
    """Each checkpoint's local copy lives in a folder named by its writer's pid and host until
    Ray has copied it (then the worker deletes it); a worker killed mid-write leaves its folder,
    and the next one made on the node deletes it. A live process's folder is kept, and so is one
    of another host (a container sharing the folder, its pids its own)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    killed = tmp_path / f"elastic-train-ckpt-{dead}.{host}.x1"
    killed.mkdir()
    (killed / "model.shard000.pt").write_bytes(b"half written")
    kept = [tmp_path / f"elastic-train-ckpt-{os.getppid()}.{host}.x2",  # alive
            tmp_path / f"elastic-train-ckpt-{dead}.other-{host}.x3",  # another host's
            tmp_path / "elastic-train-ckpt-noPid"]
    for folder in kept:
        folder.mkdir()
    made = Path(staging_folder())
    assert made.parent == tmp_path and made.name.startswith(f"elastic-train-ckpt-{os.getpid()}.{host}.")
    assert not killed.exists()
    assert all(folder.is_dir() for folder in kept)
