"""Reading a checkpoint written by `train.sharding=fsdp`, at any world size and in any mode.

Each of the W ranks of a sharded run holds rows [start, end) of dim 0 of every parameter (and of
its optimizer moments), cut as FSDP2 cuts them (`row_range`: torch.chunk's rule), and writes just
those rows into its own `model.shardNNN.pt` / `optimizer.shardNNN.pt`, in parallel. Nothing ties a
tensor to the world size that wrote it but that rule: a reader at another size, or an unsharded
one, computes which rows each file holds and takes what it needs. The files are opened with
`mmap=True`, so a rank that needs rows [a, b) of a tensor reads only the pages of those rows, and
a full copy for `export` is assembled once, without a second copy of the model in memory.

`state.json` of such a checkpoint says `"sharding": "fsdp"` and names the row-sharded tensors
(`row_sharded`); every other tensor (buffers, optimizer step counters) is whole in shard 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor (FSDP2's sharded tensor), without importing
    torch.distributed.tensor: a DTensor exists only once that module is loaded, and loading it
    (with torch.distributed.fsdp, ~0.8 s of CPU) is left to the runs that shard."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def row_range(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows [start, end) of a dim-0 length `rows` that FSDP2's Shard(0) gives `rank` of
    `world_size`: chunks of ceil(rows / world_size), the last ones short or empty."""
    chunk = -(-rows // world_size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def sharding_of(state: dict[str, Any]) -> str:
    """The `train.sharding` that wrote a checkpoint (its state.json); older ones: none."""
    return state.get("sharding", "none")


class ShardedFiles:
    """Tensors of one kind ("model" or "optimizer") of a sharded checkpoint, read by rows.

    Model files map a tensor's name to this rank's rows; optimizer files map a parameter's name
    to its state ({"exp_avg": rows, "step": whole, ...}) under "state", with "param_groups" in
    shard 0."""

    def __init__(self, directory: str | Path, kind: str, state: dict[str, Any]) -> None:
        self.directory, self.kind = Path(directory), kind
        self.shards = int(state["shards"])
        self.row_sharded = set(state.get("row_sharded", ()))
        self.shapes = state["model_signature"]
        self._files: dict[int, dict[str, Any]] = {}

    def file(self, shard: int) -> dict[str, Any]:
        if shard not in self._files:
            path = self.directory / f"{self.kind}.shard{shard:03d}.pt"
            self._files[shard] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return self._files[shard]

    def _entry(self, shard: int, name: str, key: str | None) -> torch.Tensor:
        part = self.file(shard)
        return part[name] if key is None else part["state"][name][key]

    def is_rows(self, name: str, value: Any) -> bool:
        """Whether `value` (shard 0's) is a row piece of parameter `name` (else it is whole)."""
        return (name in self.row_sharded and isinstance(value, torch.Tensor) and value.dim() > 0
                and list(value.shape[1:]) == list(self.shapes[name][1:]))

    def rows(self, name: str, start: int, end: int, key: str | None = None) -> torch.Tensor:
        """Rows [start, end) of tensor `name` (or of its optimizer state `key`), assembled from
        the shards that hold them."""
        total = self.shapes[name][0]
        pieces = []
        for shard in range(self.shards):
            a, b = row_range(total, shard, self.shards)
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                pieces.append(self._entry(shard, name, key)[lo - a:hi - a])
        if not pieces:
            return self._entry(0, name, key)[:0]
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces)

    def full(self, name: str, key: str | None = None) -> torch.Tensor:
        """The whole tensor (a row-sharded one assembled, in one new copy)."""
        value = self._entry(0, name, key)
        if key is None and name not in self.row_sharded:
            return value.clone()
        if key is not None and not self.is_rows(name, value):
            return value.clone()
        return self.rows(name, 0, self.shapes[name][0], key)

    def model_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model, whole: what an unsharded model or `export` loads."""
        return {name: self.full(name) for name in self.file(0)}

    def copy_into(self, model: torch.nn.Module) -> None:
        """Copy every tensor into `model`'s own (cast to its dtype), one tensor at a time: the
        model and one assembled tensor are all there is in memory, never a second model."""
        targets = model.state_dict()
        if set(targets) != set(self.file(0)):
            raise KeyError(f"checkpoint {self.directory}: tensors differ from the model's: "
                           f"{sorted(set(targets) ^ set(self.file(0)))[:4]}")
        with torch.no_grad():
            for name, t in targets.items():
                t.copy_(self.full(name))

    def optimizer_state(self) -> dict[str, Any]:
        """{"state": {parameter name: {key: whole tensor}}, "param_groups": [...]}."""
        part = self.file(0)
        state = {name: {key: self.full(name, key) if isinstance(v, torch.Tensor) else v
                        for key, v in entry.items()}
                 for name, entry in part["state"].items()}
        return {"state": state, "param_groups": part["param_groups"]}


def read_sharded(directory: str | Path, kind: str) -> dict[str, Any]:
    """The whole state of `kind` of an fsdp checkpoint (see `ShardedFiles`)."""
    state = json.loads((Path(directory) / "state.json").read_text())
    files = ShardedFiles(directory, kind, state)
    return files.model_state() if kind == "model" else files.optimizer_state()
