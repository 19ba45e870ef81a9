"""What the driver settles in the config before it checks anything, so that the workers and the
resolved config.yaml see the same thing the checks saw: absolute paths, the name of the Python
API's inline model, the embedded GPT's `model.kwargs` as the fields they set."""

from __future__ import annotations

import os

from elastic_train.config import Config, ConfigError, gpt_config
from elastic_train.training.model import ModelFn

PATH_KEYS = (("data", "path"), ("eval", "path"), ("model", "path"), ("run", "storage_path"),
             ("train", "compile_cache_dir"))


def resolve_config(cfg: Config, model_fn: ModelFn | None = None) -> None:
    """`resolve_paths`, `record_model_fn`, and a GPT's kwargs folded into its fields."""
    resolve_paths(cfg)
    record_model_fn(cfg, model_fn)
    if cfg.model.name == "gpt" and model_fn is None:
        cfg.model = gpt_config(cfg.model)  # model.kwargs={n_layer: 4} said as model.n_layer: 4


def resolve_paths(cfg: Config) -> None:
    """Every local path key made absolute (and `~` expanded) here, on the driver: workers run in
    other folders (a relative model.path once passed these checks, then failed on every worker,
    4 attempts and 50 s later), and config.yaml then says which folder was meant. URIs stay."""
    for section, key in PATH_KEYS:
        holder = getattr(cfg, section)
        value = getattr(holder, key)
        if value and "://" not in value:
            setattr(holder, key, os.path.abspath(os.path.expanduser(value)))


def record_model_fn(cfg: Config, model_fn: ModelFn | None) -> None:
    """`model.inline_fn` names the Python API's model_fn (module.qualname), so the run folder says
    which model it trained (model.name alone would say gpt, and export would build a GPT); a
    config that names one cannot run without it (the command line, or the API without model_fn,
    would quietly train model.name instead)."""
    if model_fn is not None:
        module = getattr(model_fn, "__module__", None) or "?"
        cfg.model.inline_fn = f"{module}.{getattr(model_fn, '__qualname__', repr(model_fn))}"
    elif cfg.model.inline_fn:
        raise ConfigError(f"model.inline_fn: this config is that of a run of an inline model "
                          f"({cfg.model.inline_fn}), which only the Python API can build: "
                          f"train(cfg, model_fn={cfg.model.inline_fn.rsplit('.', 1)[-1]}); or "
                          "set model.inline_fn=null to train model.name instead")
