"""Loading a config: YAML with strict keys and dotted `key=value` overrides.

`load_config(path, overrides)` reads the YAML file (or the embedded default), applies the
overrides, checks every key and type, validates cross-field constraints (validate.py) and returns
a `Config`. Any problem raises `ConfigError` with one message that names the culprit.
"""

from __future__ import annotations

import dataclasses
import datetime
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
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{_quote_hint(tp, value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        for k, v in value.items():
            if v is None and isinstance(k, str) and ":" in k:  # {tcp_gpu:1} is {"tcp_gpu:1": None}
                name, _, rest = k.partition(":")
                raise ConfigError(f"{key}: YAML reads {{{k}}} as the key '{k}' with no value: a "
                                  f"flow mapping needs a space after the colon, {{{name}: {rest}}}")
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
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}{_quote_hint(tp, value)}")


def _quote_hint(tp: Any, value: Any) -> str:
    """For a text key given a value YAML read as another type (2024, 2024-05-01, yes, 1:30):
    how to keep it as text. A file's value, mostly: an override of a text key stays as typed."""
    texts = tp is str or str in typing.get_args(tp)
    if not texts or not isinstance(value, (bool, int, float, datetime.date)):
        return ""
    kind = {bool: "a boolean", int: "an integer", float: "a number"}.get(type(value), "a date")
    return f" (YAML reads this unquoted value as {kind}: put it in quotes, \"...\", to keep it as text)"


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
    """`a.b=value` -> ("a.b", value); the value is read as a YAML scalar or flow mapping, except
    for a text key (str, or str | None), whose value is the text as typed (see `_text_value`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}': expected dotted.key=value")
    tp = _schema_type(key.strip())
    if tp is str or (tp is not None and set(typing.get_args(tp)) == {str, type(None)}):
        return key.strip(), _text_value(raw, nullable=tp is not str)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        detail = " ".join(str(exc).split())
        raise ConfigError(f"override '{text}': value is not valid YAML ({detail})") from None
    return key.strip(), value


def _schema_type(dotted: str) -> Any:
    """The annotation of a dotted key's field; None for a key the schema does not have."""
    tp: Any = Config
    for part in dotted.split("."):
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return tp


# YAML's spellings of null: what a `str | None` key's override reads as None
NULLS = ("", "~", "null", "Null", "NULL")


def _text_value(raw: str, nullable: bool) -> str | None:
    """A text key's override value: the text as typed, so that `run.name=2024`, `=2024-05-01`,
    `=yes` or `=1:30` stay text (YAML would read an int, a date, True, 90); a quoted text
    (`run.name="'a b'"`) loses its quotes as YAML's would. For a `str | None` key YAML's null
    (null, ~, nothing) is still None: `data.path=null` goes back to the embedded corpus."""
    if nullable and raw.strip() in NULLS:
        return None
    quoted = raw.strip()
    if len(quoted) >= 2 and quoted[0] == quoted[-1] and quoted[0] in "'\"":
        try:
            value = yaml.safe_load(quoted)
        except yaml.YAMLError:
            value = None
        if isinstance(value, str):
            return value
    return raw


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
