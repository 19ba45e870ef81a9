"""Loading a config: YAML with strict keys and dotted `key=value` overrides.

`load_config(path, overrides)` reads the YAML file (or the embedded default), applies the
overrides, checks every key and type, validates cross-field constraints (validate.py) and returns
a `Config`. Any problem raises `ConfigError` with one message that names the culprit.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from elastic_train.config.devices import resolve_device_defaults
from elastic_train.config.schema import Config, ConfigError
from elastic_train.config.validate import validate

DEFAULT_CONFIG_PATH = Path(__file__).parent.parent / "configs" / "default.yaml"

def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and widen int -> float) a YAML value against a field's annotation."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return "a list"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys by their dotted name."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{dotted}' (known: {', '.join(sorted(names))})")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value if value is not None else {}, dotted)
        else:
            kwargs[key] = _coerce(value, tp, dotted)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:  # an absent or empty section
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", value); the value is read as a YAML scalar or flow mapping."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}': expected dotted.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"override '{text}': value is not valid YAML ({detail})") from None
    return key.strip(), value


def load_config(
    path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """Load a config file (None: the embedded default), apply overrides, validate."""
    source = Path(path) if path is not None else DEFAULT_CONFIG_PATH
    if not str(path if path is not None else source).strip():
        raise ConfigError("--config: an empty path")
    if source.is_dir():
        raise ConfigError(f"config file '{source}' is a folder, not a YAML file")
    if not source.is_file():
        raise ConfigError(f"config file '{source}' does not exist")
    try:
        tree = yaml.safe_load(source.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file '{source}' is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"config file '{source}' cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"config file '{source}' is not valid YAML: {detail}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{source}': top level must be a mapping")
    items = overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or [])
    for key, value in items:
        _set_dotted(tree, key, value)
    cfg = _build(Config, tree, "")
    resolve_device_defaults(cfg)
    validate(cfg)
    return cfg


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Rebuild a Config from `Config.to_dict()` output (e.g. a checkpoint's saved config)."""
    cfg = _build(Config, tree, "")
    resolve_device_defaults(cfg)
    validate(cfg)
    return cfg


# Keys whose value is a mapping of the user's: shown whole when they change.
DICT_VALUED = ("model.kwargs", "scaling.resources_per_worker")


def config_changes(old: dict[str, Any], new: dict[str, Any], limit: int = 4) -> str | None:
    """What differs between two config trees (`Config.to_dict()`, or a config.yaml read back),
    as dotted keys, "old -> new", the first `limit` of them and a count of the rest; None if
    nothing does."""
    changed: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and not prefix.endswith(DICT_VALUED):
            for key in list(a) + [k for k in b if k not in a]:
                walk(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        elif a != b:
            changed.append(f"{prefix} {a!r} -> {b!r}")

    walk(old, new, "")
    if not changed:
        return None
    more = len(changed) - limit
    return ", ".join(changed[:limit]) + (f" and {more} more" if more > 0 else "")
