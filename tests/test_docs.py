"""The documentation that is generated from the code is up to date."""

import dataclasses
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
    page = render(cfg)
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
