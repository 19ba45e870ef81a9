"""The identity of a LoRA run's frozen base: a SHA-256 its checkpoints carry, so that adapters are
never resumed, loaded or exported onto another base (lora.py).

Two sources, two definitions:
- a base loaded from a folder of weights (`model.name=hf` with safetensors or .bin files): the
  hash of the weights as stored there, before any cast or quantisation (the same for an fp32,
  a bf16 and a 4-bit QLoRA load of the same folder). Each safetensors tensor is hashed from the
  memory-mapped file without a copy: its name, dtype, shape and bytes, sorted by name (so neither
  the files' split nor their metadata matters); a .bin file by its bytes. The tensors are hashed
  on a few threads (hashlib releases the GIL) and their digests hashed in name order.
- a base built from its seed (no weights in the folder, the embedded GPT, a user's module): the
  hash of its state dict as built (names, dtypes, shapes, bytes), computed in place.

Cost (docs/finetuning.md, "What the base hash costs"): a 7B base is 14 GB of bf16 to read and
hash at every start of every worker. A folder's hash is therefore cached per node, keyed by the
weight files' paths, sizes, inodes and modification and change times (ctime: no `touch` can set
it), in `$ELASTIC_TRAIN_CACHE/base_hashes/` (default ~/.cache/elastic_train), under a file lock:
the first process of a node hashes, the node's other ranks and every later start read the
result. A file rewritten in place gets a new ctime, so a new key, so a new hash.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

HASH_THREADS = 4  # tensors hashed at once (hashlib frees the GIL for large buffers)


def state_dict_hash(model: nn.Module) -> bytes:
    """SHA-256 of a model's state dict: every tensor's name, dtype, shape and bytes, in order
    (32 zero bytes for a model on the meta device: it has no values)."""
    digest = hashlib.sha256()
    state = model.state_dict()
    if any(t.is_meta for t in state.values()):  # the driver's shape-only model
        return bytes(32)
    for name, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            digest.update(t.view(torch.uint8).reshape(-1).numpy())  # the buffer itself, no copy
    return digest.digest()


def weight_files(folder: Path) -> list[Path]:
    """The files `from_pretrained` reads weights from: the safetensors (one, or those of its
    index), else the .bin ones; [] when the folder holds none."""
    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (folder / index).is_file():
            names = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
            return [folder / name for name in names]
        if (folder / single).is_file():
            return [folder / single]
    return []


def _safetensors_entries(path: Path) -> list[tuple[str, str, list[int], Path, int, int]]:
    """(name, dtype, shape, file, start, end) of each tensor of a safetensors file: an 8-byte
    header length, a JSON header, then the tensors' bytes at its data_offsets."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    base = 8 + length
    return [(name, meta["dtype"], meta["shape"], path, base + meta["data_offsets"][0],
             base + meta["data_offsets"][1])
            for name, meta in header.items() if name != "__metadata__"]


def _hash_range(path: Path, start: int, end: int) -> bytes:
    """SHA-256 of bytes [start, end) of a file, read 8 MiB at a time into one buffer: plain
    reads, not a mapping, whose touched pages would count in this process's resident memory
    (the whole file's size on every rank that hashes it)."""
    digest = hashlib.sha256()
    buffer = bytearray(min(1 << 23, max(end - start, 0)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        offset = start
        while offset < end:
            got = f.readinto(view[:min(len(buffer), end - offset)])
            if not got:
                raise OSError(f"{path}: ends at byte {offset}, before {end}")
            digest.update(view[:got])
            offset += got
    view.release()
    return digest.digest()


def files_hash(files: list[Path], threads: int = HASH_THREADS) -> bytes:
    """SHA-256 of the weights stored in `files` (module docstring), computed now."""
    entries: list[tuple[str, str, list[int], Path, int, int]] = []
    for path in files:
        if path.suffix == ".safetensors":
            entries += _safetensors_entries(path)
        else:  # a pickle: its bytes
            entries.append((path.name, "file", [], path, 0, path.stat().st_size))
    entries.sort(key=lambda e: e[0])
    with ThreadPoolExecutor(max(1, threads)) as pool:
        digests = list(pool.map(lambda e: _hash_range(e[3], e[4], e[5]), entries))
    total = hashlib.sha256()
    for (name, dtype, shape, *_), digest in zip(entries, digests, strict=True):
        total.update(f"{name}|{dtype}|{tuple(shape)}|".encode() + digest)
    return total.digest()


def _cache_dir() -> Path:
    root = os.environ.get("ELASTIC_TRAIN_CACHE") or Path.home() / ".cache" / "elastic_train"
    return Path(root).expanduser() / "base_hashes"


def _cache_key(files: list[Path]) -> str:
    stats = []
    for path in files:
        st = path.stat()
        stats.append([str(path.resolve()), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:32]


def folder_hash(folder: Path) -> bytes | None:
    """The hash of the weights in `folder` (None: it holds none), from this node's cache when
    the files are unchanged, else computed (by one process of the node at a time) and cached."""
    files = weight_files(folder)
    if not files:
        return None
    cache = _cache_dir()
    entry = cache / _cache_key(files)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(f"{entry}.lock", "w")  # noqa: SIM115 - held until the hash is cached
    except OSError:  # no writable cache: hash every time
        return files_hash(files)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return bytes.fromhex(entry.read_text().strip())
        except (OSError, ValueError):
            pass
        digest = files_hash(files)
        scratch = entry.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(digest.hex())
        os.replace(scratch, entry)
        return digest
