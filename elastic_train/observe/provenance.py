"""What ran: library versions, the code's git revision, and the data set's and tokenizer's identity.

Recorded in the run folder (`provenance.json`), in `summary.json` and in every checkpoint's
`state.json` (the versions there are those of the rank-0 worker that wrote it, which may run
another image than the driver). A resume compares the latest checkpoint's record with the present:
other data or another tokenizer is refused (the rows and token ids a checkpoint's data position
and embedding mean would change; `data.on_change=keep_position` overrides it, as for the data
identity), other library versions or another git revision only warn.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from elastic_train.data.dataset import STATS_FILE, DatasetInfo

LIBRARIES = ("elastic_train", "torch", "ray", "pyarrow", "numpy", "transformers", "tokenizers",
             "safetensors", "bitsandbytes")


def versions() -> dict[str, str | None]:
    """Python, the libraries a run depends on (None: not installed), CUDA and NCCL of this torch."""
    import torch

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["cuda"] = torch.version.cuda
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None
    except (AttributeError, RuntimeError):
        out["nccl"] = None
    return out


def git_revision(path: Path = Path(__file__).parent) -> dict[str, Any] | None:
    """The git commit of the checkout holding `path`, and whether it has uncommitted changes;
    None when the code is not a git checkout (an installed wheel) or git is missing."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def _footer(fs: pafs.FileSystem, path: str) -> bytes:
    """A Parquet file's footer (schema, row groups, column chunk sizes, offsets and statistics):
    a fingerprint of its content read in two small reads, whatever the file's size."""
    with fs.open_input_file(path) as f:
        size = f.size()
        f.seek(size - 8)
        length = int.from_bytes(f.read(4), "little")
        f.seek(size - 8 - length)
        return f.read(length) + size.to_bytes(8, "little")


def data_hash(info: DatasetInfo) -> str:
    """A hash of a data set's manifest: every shard's name and footer, and `_prepare.json`."""
    digest = hashlib.sha256()
    for path in info.files:
        digest.update(path.rsplit("/", 1)[-1].encode() + b"\0" + _footer(info.filesystem, path))
    stats = f"{info.path.rstrip('/')}/{STATS_FILE}"
    if info.filesystem.get_file_info(stats).type == pafs.FileType.File:
        with info.filesystem.open_input_stream(stats) as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def tokenizer_hash(info: DatasetInfo) -> str | None:
    """A hash of the tokenizer files the data set records ("bytes" for byte tokens; None when it
    records none)."""
    if info.tokenizer_kind == "bytes":
        return "bytes"
    if not info.tokenizer_path:
        return None
    digest = hashlib.sha256()
    selector = pafs.FileSelector(info.tokenizer_path, recursive=True)
    for entry in sorted(info.filesystem.get_file_info(selector), key=lambda e: e.path):
        if entry.type == pafs.FileType.File:
            with info.filesystem.open_input_stream(entry.path) as f:
                digest.update(entry.path.rsplit("/", 1)[-1].encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def tokenizer_description(info: DatasetInfo) -> str | None:
    """The data set's tokenizer in words, as `_prepare.json` records it (None: it records none,
    or bytes, which the hash "bytes" says)."""
    if info.tokenizer_kind in (None, "bytes"):
        return None
    where = f", {info.tokenizer_path}" if info.tokenizer_path else ""
    return f"{info.tokenizer_kind}, {info.vocab_size} tokens{where}"


def driver_record(info: DatasetInfo, eval_info: DatasetInfo | None = None) -> dict[str, Any]:
    """What the driver knows: its versions, the git revision, the data and tokenizer hashes (and
    the tokenizer in words, for a message that names it)."""
    record = {"versions": versions(), "git": git_revision(), "data_hash": data_hash(info),
              "tokenizer_hash": tokenizer_hash(info), "tokenizer": tokenizer_description(info)}
    if eval_info is not None:
        record["eval_data_hash"] = data_hash(eval_info)
    return record


def changes(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refusing, warning): what differs between a checkpoint's record and the present, named.
    Tokenizer and data changes refuse (the tokenizer first: it is the cause when both changed);
    versions and git revision warn. A field one side lacks (an older checkpoint) is not compared."""
    refusing, warning = [], []
    for key, label in (("tokenizer_hash", "the tokenizer"),
                       ("data_hash", "the data set's content (manifest hash)")):
        if saved.get(key) and current.get(key) and saved[key] != current[key]:
            refusing.append(f"{label} was {saved[key]}{_in_words(saved, key)}, now "
                            f"{current[key]}{_in_words(current, key)}")
    old, new = saved.get("versions") or {}, current.get("versions") or {}
    for name in sorted(set(old) & set(new)):
        if old[name] != new[name]:
            warning.append(f"{name} {old[name]} -> {new[name]}")
    old_git, new_git = saved.get("git"), current.get("git")
    if old_git and new_git and old_git.get("commit") != new_git.get("commit"):
        warning.append(f"git revision {old_git['commit'][:12]} -> {new_git['commit'][:12]}")
    return refusing, warning


def _in_words(record: dict[str, Any], key: str) -> str:
    """" (hf, 400 tokens, /data/tokenizer)" for the tokenizer, when the record says it."""
    words = record.get("tokenizer") if key == "tokenizer_hash" else None
    return f" ({words})" if isinstance(words, str) and words else ""
