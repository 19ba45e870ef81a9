"""elastic_train: elastic, fault-tolerant data-parallel training for PyTorch on Ray.

    from elastic_train import load_config, train
    result = train(load_config(None, ["train.max_steps=100"]))
"""

from elastic_train.config import Config, ConfigError, load_config, redact

# what this package logs shows no secret of a URI (the driver's console, the workers' forwarded
# output, ray.log)
redact.mask_logs("elastic_train", "elastic_train.prepare", "elastic_train.preflight.runlock")

__all__ = ["Config", "ConfigError", "TrainResult", "TrainingFailed", "load_config", "train"]


def __getattr__(name: str):
    # Ray and torch load only when training is asked for: config errors stay fast.
    if name in ("train", "TrainResult", "TrainingFailed"):
        from elastic_train import api

        return getattr(api, name)
    raise AttributeError(name)
