"""Tracking targets that cannot work, found before the run starts: `log.mlflow` and `log.wandb`.

Why an error and not the tracker's warning: a backend that fails while the run trains is dropped
with one warning so that a server that goes down never stops training (observe/tracking.py). But
these three are visible on the driver before any worker starts, and a user who asked for tracking
and got an untracked run learns it only after the run: an MLflow file store whose path runs into a
plain file, a database store (sqlite://, postgresql://, ...) with `mlflow-skinny` alone (no
SQLAlchemy and Alembic, which its SQL store needs), and W&B online (no `WANDB_MODE=offline` or
`disabled`) with no API key (`WANDB_API_KEY`, or the `~/.netrc` entry `wandb login` writes).
A server that does not answer is not checked here: it may come up, and the run goes on without it.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from urllib.parse import urlparse

from elastic_train.config import Config, ConfigError

SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
WANDB_OFFLINE_MODES = ("offline", "disabled", "dryrun")


def _under_a_file(path: str) -> str | None:
    """The nearest existing part of `path` when it is not a folder (None: it is one, or the
    path can be made)."""
    part = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(part):
        parent = os.path.dirname(part)
        if parent == part:
            return None
        part = parent
    return None if os.path.isdir(part) else part


def check_mlflow(uri: str) -> None:
    """ConfigError naming log.mlflow for a store that cannot work (module docstring)."""
    scheme = urlparse(uri).scheme.split("+")[0]
    if scheme in SQL_SCHEMES:
        missing = [name for name in ("sqlalchemy", "alembic") if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(
                f"log.mlflow: a {scheme} store needs the full mlflow package (its SQL store uses "
                f"{' and '.join(missing)}, which is not installed: mlflow-skinny lacks it): "
                "pip install mlflow, or use a file store or a tracking server")
        if scheme == "sqlite":
            database = uri.split(":///", 1)[-1] if ":///" in uri else ""
            blocked = _under_a_file(os.path.dirname(database) or ".") if database else None
            if blocked:
                raise ConfigError(f"log.mlflow: the sqlite database '{database}' cannot be made: "
                                  f"'{blocked}' is a file, not a folder")
        return
    if scheme in ("", "file"):
        path = urlparse(uri).path if scheme == "file" else uri
        blocked = _under_a_file(path)
        if blocked:
            raise ConfigError(f"log.mlflow: the file store '{path}' cannot be made: '{blocked}' is "
                              "a file, not a folder")


def _wandb_key_present() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc for W&B's host (WANDB_BASE_URL's)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        found = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(found and found[2])


def check_wandb(project: str) -> None:
    """ConfigError naming log.wandb for W&B online without an API key."""
    if os.environ.get("WANDB_MODE", "online").lower() in WANDB_OFFLINE_MODES:
        return
    if not _wandb_key_present():
        raise ConfigError(
            f"log.wandb={project}: W&B is online (WANDB_MODE is not offline) but has no API key "
            "(no WANDB_API_KEY, no ~/.netrc entry): run `wandb login`, set WANDB_API_KEY, or "
            "set WANDB_MODE=offline to log to the run folder and `wandb sync` later")


def check_tracking(cfg: Config) -> None:
    """Every tracking target the config names can work (module docstring), else ConfigError."""
    if cfg.log.mlflow:
        check_mlflow(cfg.log.mlflow)
    if cfg.log.wandb:
        check_wandb(cfg.log.wandb)
