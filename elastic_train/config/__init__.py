"""The run configuration: a tree of dataclasses (schema), loaded from YAML with strict keys and
dotted overrides (load), checked across fields (validate).

Pure: imports neither torch nor Ray, and nothing else of elastic_train. Every other wing reads
its settings from here; `from elastic_train.config import Config, load_config` is the way in.
"""

from elastic_train.config.load import (
    DEFAULT_CONFIG_PATH,
    config_changes,
    config_from_dict,
    load_config,
    parse_override,
)
from elastic_train.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    FaultConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScalingConfig,
    TrainConfig,
)
from elastic_train.config.validate import (
    GPT_KWARGS,
    GRAD_COMPRESSIONS,
    NODE_KINDS,
    ReduceChoice,
    batch_tokens,
    check_compression,
    check_run_name,
    choose_grad_reduce,
    eval_enabled,
    fault_schedule,
    gpt_config,
    num_partitions,
    validate,
)

__all__ = [
    "DEFAULT_CONFIG_PATH", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
    "FaultConfig", "GPT_KWARGS", "GRAD_COMPRESSIONS", "LogConfig", "NODE_KINDS", "ModelConfig", "OptimConfig",
    "ReduceChoice", "RunConfig", "ScalingConfig", "TrainConfig", "batch_tokens", "check_compression",
    "check_run_name", "choose_grad_reduce", "config_from_dict", "config_changes", "eval_enabled",
    "fault_schedule", "gpt_config", "load_config", "num_partitions", "parse_override", "validate",
]
