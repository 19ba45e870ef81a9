"""The configuration reference, generated from schema.py: every key, its type, default and comment.

    python -m elastic_train.config.reference > docs/configuration.md

The comments in schema.py are the only text: a comment on the field's line, or the block of
comment lines right above it. tests/test_docs.py fails when docs/configuration.md is out of date.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from elastic_train.config.schema import Config

SCHEMA = Path(__file__).with_name("schema.py")
HEADER = """# Configuration reference

Every key of a run's config, by section: its type, its default (from `elastic_train/configs/default.yaml`
where that file sets it, else the field's own default) and what it means. Set a key in a YAML file
(`--config FILE.yaml`) or on the command line (`section.key=value`, read as a YAML scalar or flow
mapping). An unknown key is an error that names it. Generated from the comments in
`elastic_train/config/schema.py` by `python -m elastic_train.config.reference`: edit those, not this page.
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


def _default(value) -> str:
    return "`null`" if value is None else f"`{value}`"


def render(defaults: Config | None = None) -> str:
    """The reference page as Markdown; `defaults` gives the values (the embedded default config)."""
    comments = field_comments(SCHEMA.read_text())
    if defaults is None:
        from elastic_train.config.load import load_config

        defaults = load_config(None)
    hints_of = {f.name: f for f in dataclasses.fields(Config)}
    parts = [HEADER]
    for section in hints_of:
        value = getattr(defaults, section)
        parts.append(f"\n## `{section}`\n\n| key | type | default | meaning |\n|---|---|---|---|")
        parts.extend(_rows(section, value, comments))
    return "\n".join(parts) + "\n"


def _rows(prefix: str, value, comments: dict[str, dict[str, str]]) -> list[str]:
    """The table rows of a section's keys; a nested section's (model.lora) by their dotted names."""
    rows = []
    for f in dataclasses.fields(value):
        inner = getattr(value, f.name)
        if dataclasses.is_dataclass(inner):
            rows.extend(_rows(f"{prefix}.{f.name}", inner, comments))
            continue
        kind = str(f.type).replace("|", "or")
        rows.append(f"| `{prefix}.{f.name}` | {kind} | {_default(inner)} "
                    f"| {_cell(comments[type(value).__name__].get(f.name, ''))} |")
    return rows


if __name__ == "__main__":
    print(render(), end="")
