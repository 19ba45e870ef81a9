"""Where a run's folder is: `<run.storage_path>/<run.name>`, local or any pyarrow.fs URI."""

from __future__ import annotations

import os

import pyarrow.fs as pafs

from elastic_train.config import Config, check_run_name


def run_uri(cfg: Config) -> str:
    """`<run.storage_path>/<run.name>`, absolute for a local folder."""
    check_run_name(cfg.run.name)  # the run folder lies inside storage_path, whatever built cfg
    storage = cfg.run.storage_path
    if "://" not in storage:
        storage = os.path.abspath(os.path.expanduser(storage))
    return storage.rstrip("/") + "/" + cfg.run.name


def split_uri(path: str) -> tuple[pafs.FileSystem, str, bool]:
    """(filesystem, path in it, is_local) for a local folder or a pyarrow.fs URI."""
    if "://" in path:
        fs, fs_path = pafs.FileSystem.from_uri(path)
        return fs, fs_path, isinstance(fs, pafs.LocalFileSystem)
    return pafs.LocalFileSystem(), os.path.abspath(path), True
