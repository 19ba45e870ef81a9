"""The configuration reference, generated from schema.py: every key, its type, default, value in the
embedded run (configs/default.yaml) and comment.

    python -m elastic_train.config.reference > docs/configuration.md

The comments in schema.py are the only text: a comment on the field's line, or the block of
comment lines right above it. tests/test_docs.py fails when docs/configuration.md is out of date.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import yaml

from elastic_train.config.schema import Config

SCHEMA = Path(__file__).with_name("schema.py")
HEADER = """# Configuration reference

Every key of a run's config, by section: its type, its default, its value in the embedded run and
what it means. Set a key in a YAML file (`--config FILE.yaml`) or on the command line
(`section.key=value`: a YAML scalar or flow mapping, quoted for the shell where it holds a space,
`scaling.resources_per_worker='{slot: 1}'`; a text key's value stays as typed, `run.name=2024`).
An unknown key is an error that names it.

- **default**: the field's own default, what a key gets that your `--config` file (or the command
  line) does not set: a config file is complete in itself, read alone, not over the embedded run.
  `null` and `auto` are settled when the run starts, from the device (`config/devices.py`: e.g.
  `train.precision` fp32 on CPU workers, bf16 on GPU ones) or the data set (as each key's meaning
  says).
- **embedded run**: the value `elastic_train/configs/default.yaml` sets, the run `elastic-train
  train` makes without `--config`; empty where that file leaves the key to its default.

Generated from the comments in `elastic_train/config/schema.py` by
`python -m elastic_train.config.reference`: edit those, not this page.
"""


def field_comments(source: str) -> dict[str, dict[str, str]]:
    """{class name: {field: comment}} from the comments of schema.py's dataclasses."""
    lines = source.splitlines()
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = out[node.name] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above, row = [], stmt.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            line = lines[stmt.end_lineno - 1]
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            fields[stmt.target.id] = " ".join(part for part in (" ".join(above), trailing) if part)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or "(as the key above)"


def _value(value) -> str:
    return "`null`" if value is None else f"`{value}`"


def render(embedded: dict | None = None) -> str:
    """The reference page as Markdown; `embedded` is the embedded run's config tree, as read
    from its YAML file (default: elastic_train/configs/default.yaml)."""
    comments = field_comments(SCHEMA.read_text())
    if embedded is None:
        from elastic_train.config.load import DEFAULT_CONFIG_PATH

        embedded = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()) or {}
    from elastic_train.config.load import _build

    typed = _build(Config, embedded, "")  # its values as the schema reads them (3.0e-3 -> 0.003)
    parts = [HEADER]
    for f in dataclasses.fields(Config):
        parts.append(f"\n## `{f.name}`\n\n| key | type | default | embedded run | meaning |\n"
                     "|---|---|---|---|---|")
        parts.extend(_rows(f.name, f.default_factory(), getattr(typed, f.name),
                           embedded.get(f.name) or {}, comments))
    return "\n".join(parts) + "\n"


def _rows(prefix: str, default, typed, given: dict, comments: dict[str, dict[str, str]]) -> list[str]:
    """The table rows of a section's keys; a nested section's (model.lora) by their dotted names.
    `default`: the section as the schema builds it; `typed`: as the embedded run's file does;
    `given`: the keys that file sets."""
    rows = []
    for f in dataclasses.fields(default):
        inner = getattr(default, f.name)
        if dataclasses.is_dataclass(inner):
            rows.extend(_rows(f"{prefix}.{f.name}", inner, getattr(typed, f.name),
                              given.get(f.name) or {}, comments))
            continue
        kind = str(f.type).replace("|", "or")
        embedded = _value(getattr(typed, f.name)) if f.name in given else ""
        rows.append(f"| `{prefix}.{f.name}` | {kind} | {_value(inner)} | {embedded} "
                    f"| {_cell(comments[type(default).__name__].get(f.name, ''))} |")
    return rows


if __name__ == "__main__":
    print(render(), end="")
