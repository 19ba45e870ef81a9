"""The documentation that is generated from the code is up to date."""

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from elastic_train.config import load_config
from elastic_train.config.reference import render

pytestmark = pytest.mark.unit

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_the_configuration_reference_is_generated_from_the_schema():
    page = (DOCS / "configuration.md").read_text()
    assert page == render(), ("docs/configuration.md is out of date: run "
                              "`python -m elastic_train.config.reference > docs/configuration.md`")


def test_the_reference_names_every_key_with_its_own_comment():
    cfg = load_config(None)
    page = render()
    for section in dataclasses.fields(cfg):
        value = getattr(cfg, section.name)
        for f in dataclasses.fields(value):
            inner = getattr(value, f.name)
            names = ([f"{f.name}.{g.name}" for g in dataclasses.fields(inner)]
                     if dataclasses.is_dataclass(inner) else [f.name])  # model.lora.r
            for name in names:
                assert f"| `{section.name}.{name}` |" in page, f"{section.name}.{name} missing"
    row = next(line for line in page.splitlines() if line.startswith("| `train.grad_reduce` |"))
    assert "same to the bit at any world size" in row  # the comment block above the field


def test_the_reference_tells_the_schema_default_from_the_embedded_runs_value():
    """A `--config` file is read alone: a key it leaves out gets the schema's default, which the
    "default" column shows (null and auto as such, not the value they settle to on a CPU);
    default.yaml's value is a column of its own, empty where that file sets none."""
    rows = {line.split(" | ")[0].strip("|` "): line.split(" | ")[1:-1]
            for line in render().splitlines() if line.startswith("| `")}
    assert rows["train.max_steps"][1:] == ["`300`", "`120`"]
    assert rows["eval.fraction"][1:] == ["`0.0`", "`0.03`"]
    assert rows["checkpoint.keep_best"][1:] == ["`False`", "`True`"]
    assert rows["train.precision"][1:] == ["`auto`", "`auto`"]
    assert rows["scaling.cpus_per_worker"][1:] == ["`null`", ""]
    assert rows["data.pad_multiple"][1:] == ["`null`", ""]


# ---- the commands and keys the pages show, as a user would copy them -------------------------

ROOT = DOCS.parent
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
SUBCOMMANDS = ("train", "prepare", "export", "sample", "report")
TRAIN_SCRIPTS = ("jobs/train.py", "examples/driver.py")  # they take `elastic-train train`'s arguments
PLACEHOLDERS = {"section.key"}  # configuration.md's "section.key=value" tells the form, names no key


def fenced_blocks(text: str) -> list[str]:
    """The contents of the page's ``` blocks, each line continued with a backslash joined."""
    blocks = re.findall(r"^\s*```[^\n]*\n(.*?)^\s*```", text, flags=re.M | re.S)
    return [re.sub(r"\\\n\s*", " ", block) for block in blocks]


def shell_words(line: str) -> list[str]:
    """A shell line's words, comments dropped, `&&`, `;` and `|` words of their own."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    return list(lexer)


def documented_commands() -> list[tuple[str, list[str]]]:
    """(page, argv of `elastic-train`) for every elastic-train, jobs/train.py or driver.py
    command in the pages' code blocks (a yaml entrypoint's too); a Python script's arguments
    get `train` in front."""
    found = []
    for page in PAGES:
        for block in fenced_blocks(page.read_text()):
            for line in block.splitlines():
                try:
                    words = shell_words(line)
                except ValueError:  # not a shell line (an unclosed quote in Python or YAML)
                    continue
                for i, word in enumerate(words):
                    rest = words[i + 1:]
                    end = next((j for j, w in enumerate(rest) if w in ("&&", ";", "|", "||")), len(rest))
                    if word == "elastic-train" or word.endswith("/elastic-train"):
                        found.append((page.name, rest[:end]))
                    elif word in ("python", "python3") and rest and rest[0] in TRAIN_SCRIPTS:
                        found.append((page.name, ["train", *rest[1:end]]))
    return found


def is_synopsis(argv: list[str]) -> bool:
    """A usage line (`INPUT... --output DIR [--seed 0]`), not a command to run."""
    return any(w.startswith("[") or w.endswith("...") or (w.isupper() and len(w) > 1) for w in argv)


def test_the_pages_show_commands():  # the extraction below finds what it checks
    commands = documented_commands()
    pages = {page for page, _ in commands}
    assert {"README.md", "finetuning.md", "operations.md", "models.md"} <= pages, pages
    assert len(commands) >= 30, commands


@pytest.mark.parametrize("page,argv", documented_commands(),
                         ids=lambda v: v if isinstance(v, str) else re.sub(r"[\[\]]", "", " ".join(v))[:60])
def test_every_documented_command_parses_and_its_config_loads(page, argv, monkeypatch):
    """Every command a page shows runs as written as far as its arguments go: the subcommand and
    each flag exist, and a train command's --config and overrides load and validate (a renamed
    key or a value the checks refuse fails here, not for the user who copied it)."""
    from elastic_train.cli import build_parser, parse_args

    assert argv and argv[0] in SUBCOMMANDS, f"{page}: '{' '.join(argv)}' names no subcommand"
    parser = build_parser()
    if is_synopsis(argv):  # a usage line: its flags must exist
        sub = parser._subparsers._group_actions[0].choices[argv[0]]
        known = {s for action in sub._actions for s in action.option_strings}
        flags = {m for w in argv for m in re.findall(r"--[a-z][a-z-]*", w)}
        assert flags <= known, f"{page}: '{' '.join(argv)}' names {sorted(flags - known)}"
        return
    try:
        args = parse_args(argv)
    except SystemExit:
        pytest.fail(f"{page}: `elastic-train {' '.join(argv)}` is refused by the command line")
    if argv[0] == "train":
        monkeypatch.chdir(ROOT)  # the pages' paths are the repository's (jobs/configs/...)
        load_config(args.config, args.overrides)


def config_keys() -> set[str]:
    """Every dotted key of the schema, and the mappings a user fills (`model.kwargs.hidden`)."""
    keys = set()

    def walk(value, prefix):
        for f in dataclasses.fields(value):
            inner = getattr(value, f.name)
            if dataclasses.is_dataclass(inner):
                walk(inner, f"{prefix}{f.name}.")
            else:
                keys.add(f"{prefix}{f.name}")

    walk(load_config(None), "")
    return keys


def test_every_key_the_pages_name_exists():
    """`key=value` in a page's text names a key of the schema (a renamed key's old name fails)."""
    keys, mappings = config_keys(), ("model.kwargs.", "scaling.resources_per_worker.")
    named = []
    for page in PAGES:
        for span in re.findall(r"`([a-z_]+\.[a-z_.]+=[^`]*)`", page.read_text()):
            for word in shlex.split(span):
                key = word.partition("=")[0]
                if "=" in word and key not in PLACEHOLDERS:
                    named.append((page.name, key))
    assert len(named) >= 50, named
    unknown = [(page, key) for page, key in named
               if key not in keys and not key.startswith(mappings)]
    assert not unknown, f"keys the pages name that the schema does not have: {unknown}"


def test_every_flow_value_the_pages_show_survives_the_shell():
    """A `key=[a, b]` or `key={k: v}` the pages show, copied into a shell, must reach the
    command line whole: unquoted, the shell splits it at the space (`fault.schedule=[25:crash:1,`
    and `45:kill,` ...), so the value that reaches the override must be valid YAML."""
    import yaml

    shown = [(page.name, shlex.split(span)) for page in PAGES
             for span in re.findall(r"`([a-z_]+\.[a-z_.]+=[^`]*)`", page.read_text())]
    shown += documented_commands()  # already split as the shell splits them
    broken = []
    for page, words in shown:
        for word in words:
            value = word.partition("=")[2]
            if "=" in word and value[:1] in ("[", "{"):
                try:
                    yaml.safe_load(value)
                except yaml.YAMLError:
                    broken.append((page, word))
    assert len(shown) >= 80, shown
    assert not broken, f"flow values the shell splits (quote them: key='[a, b]'): {broken}"
