"""What the driver settles in the config before it checks anything, so that the workers and the
resolved config.yaml see the same thing the checks saw: absolute paths, the name of the Python
API's inline model and loss, the embedded GPT's `model.kwargs` as the fields they set."""

from __future__ import annotations

import os

from elastic_train.config import Config, ConfigError, gpt_config
from elastic_train.training.losses import LossFn
from elastic_train.training.model import ModelFn

# set by Ray's job supervisor in a job's driver (ray._private.runtime_env.constants)
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
PATH_KEYS = (("data", "path"), ("eval", "path"), ("model", "path"), ("run", "storage_path"),
             ("train", "compile_cache_dir"))


def resolve_config(cfg: Config, model_fn: ModelFn | None = None,
                   loss_fn: LossFn | None = None) -> None:
    """`resolve_paths`, `record_model_fn`, `record_loss_fn`, and a GPT's kwargs folded into its
    fields."""
    resolve_paths(cfg)
    record_model_fn(cfg, model_fn)
    record_loss_fn(cfg, loss_fn)
    if cfg.model.name == "gpt" and model_fn is None:
        cfg.model = gpt_config(cfg.model)  # model.kwargs={n_layer: 4} said as model.n_layer: 4


def resolve_paths(cfg: Config) -> None:
    """Every local path key made absolute (and `~` expanded) here, on the driver: workers run in
    other folders (a relative model.path once passed these checks, then failed on every worker,
    4 attempts and 50 s later), and config.yaml then says which folder was meant. URIs stay."""
    storage = cfg.run.storage_path
    if (RAY_JOB_ENV in os.environ and "://" not in storage
            and not os.path.isabs(os.path.expanduser(storage))):
        raise ConfigError(
            f"run.storage_path: '{storage}' is relative, and this driver runs as a Ray job, in a "
            f"working directory ({os.getcwd()}) that Ray deletes with the session and names "
            "after its content: the run folder would be lost, and a job submitted again would "
            "not resume it. Give an absolute path or a URI (jobs/configs/default.yaml: "
            "~/elastic_train_runs)")
    for section, key in PATH_KEYS:
        holder = getattr(cfg, section)
        value = getattr(holder, key)
        if value and "://" not in value:
            setattr(holder, key, os.path.abspath(os.path.expanduser(value)))


def qualified_name(fn: object) -> str:
    """module.qualname of a function the Python API was given (what config.yaml records)."""
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}"


def record_loss_fn(cfg: Config, loss_fn: LossFn | None) -> None:
    """`train.loss_fn` names the Python API's loss_fn, as `record_model_fn` the model: a config
    that names one cannot train without it (the command line, or the API without loss_fn, would
    quietly train with next-token cross entropy, and compare its eval losses with the run's)."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise ConfigError(f"loss_fn: {loss_fn!r} is not callable: pass a function "
                              "loss_fn(model, batch) -> (loss_sum, num_targets)")
        cfg.train.loss_fn = qualified_name(loss_fn)
    elif cfg.train.loss_fn:
        raise ConfigError(f"train.loss_fn: this config is that of a run with a loss of its own "
                          f"({cfg.train.loss_fn}), which only the Python API can give: "
                          f"train(cfg, loss_fn={cfg.train.loss_fn.rsplit('.', 1)[-1]}); or set "
                          "train.loss_fn=null to train with the default loss")


def record_model_fn(cfg: Config, model_fn: ModelFn | None) -> None:
    """`model.inline_fn` names the Python API's model_fn (module.qualname), so the run folder says
    which model it trained (model.name alone would say gpt, and export would build a GPT); a
    config that names one cannot run without it (the command line, or the API without model_fn,
    would quietly train model.name instead)."""
    if model_fn is not None:
        cfg.model.inline_fn = qualified_name(model_fn)
    elif cfg.model.inline_fn:
        raise ConfigError(f"model.inline_fn: this config is that of a run of an inline model "
                          f"({cfg.model.inline_fn}), which only the Python API can build: "
                          f"train(cfg, model_fn={cfg.model.inline_fn.rsplit('.', 1)[-1]}); or "
                          "set model.inline_fn=null to train model.name instead")
