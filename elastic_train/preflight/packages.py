"""The optional packages a config needs, looked up before Ray starts.

Without this, a missing package surfaced on the cluster: `fault.recovery=in_place` without torchft
killed the lighthouse actor in its constructor, and Ray Train retried the worker-group start 78
times in 10 minutes; `model.name=hf` without transformers failed on the workers after the cluster
had started. Here each is one ConfigError naming the setting, the package and how to install it.

Found by `importlib.util.find_spec`, not imported: the lookup costs microseconds, where importing
transformers or torchft takes seconds. (A package that is present but broken still fails where it
is imported, with its own error.)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from elastic_train.config import Config, ConfigError


@dataclass(frozen=True)
class Need:
    """A package that a setting needs, and the install that brings it."""

    setting: str  # the setting, as the user wrote it: "fault.recovery=in_place"
    module: str  # the import name looked up
    install: str  # the command that installs it


def needed_packages(cfg: Config) -> list[Need]:
    """The optional packages this config needs (core dependencies are left out when pip installs
    them with the package anyway, unless a user may have left them out: bitsandbytes)."""
    needs = []
    if cfg.fault.recovery == "in_place":
        needs.append(Need("fault.recovery=in_place", "torchft", "pip install -e '.[ft]'"))
    if cfg.model.name == "hf":
        needs.append(Need("model.name=hf", "transformers", "pip install -e '.[hf]'"))
    if cfg.model.lora.r > 0:
        needs.append(Need("model.lora.r", "peft", "pip install -e '.[lora]'"))
    if cfg.optim.name == "adamw8bit":
        needs.append(Need("optim.name=adamw8bit", "bitsandbytes", "pip install bitsandbytes"))
    if cfg.log.tensorboard:
        needs.append(Need("log.tensorboard=true", "tensorboard", "pip install tensorboard"))
    if cfg.log.mlflow:
        needs.append(Need("log.mlflow", "mlflow", "pip install -e '.[track]'"))
    if cfg.log.wandb:
        needs.append(Need("log.wandb", "wandb", "pip install -e '.[track]'"))
    return needs


def is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, a module with no spec
        return False


def check_packages(cfg: Config) -> None:
    """ConfigError for the first package the config needs that is not installed here."""
    for need in needed_packages(cfg):
        if not is_installed(need.module):
            raise ConfigError(f"{need.setting} needs the package '{need.module}', which is not "
                              f"installed; install it with `{need.install}`")
