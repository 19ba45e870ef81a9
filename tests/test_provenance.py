"""Provenance: what a run and each checkpoint record of what ran, and what a resume does when
the data, the tokenizer, the libraries or the code changed."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY

from elastic_train.config import ConfigError, load_config
from elastic_train.data.dataset import inspect_dataset
from elastic_train.observe import provenance
from elastic_train.preflight.inputs import check_inputs
from elastic_train.training.checkpoint import snapshot, write_checkpoint
from elastic_train.training.model import build_model

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def test_versions_and_the_git_revision_of_this_checkout():
    record = provenance.versions()
    assert record["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    import ray

    assert record["ray"] == ray.__version__ and record["python"].count(".") == 2
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert provenance.git_revision(REPO / "elastic_train")["commit"] == head
    assert provenance.git_revision(Path("/")) is None  # not a checkout


def test_the_data_hash_follows_the_content_and_the_tokenizer_hash_the_tokenizer(small_dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(small_dataset, copy)
    info, same = inspect_dataset(small_dataset), inspect_dataset(str(copy))
    assert provenance.data_hash(info) == provenance.data_hash(same)
    assert provenance.tokenizer_hash(info) == "bytes"
    # The same rows count and schema, one token changed: another hash.
    shard = sorted(copy.glob("*.parquet"))[0]
    table = pq.read_table(shard)
    tokens = table.column("tokens").to_pylist()
    tokens[0][0] = (tokens[0][0] + 1) % 256
    meta = pq.ParquetFile(shard).metadata
    pq.write_table(table.set_column(table.schema.get_field_index("tokens"), "tokens",
                                    [tokens]).cast(table.schema), shard,
                   row_group_size=meta.row_group(0).num_rows)
    assert provenance.data_hash(inspect_dataset(str(copy))) != provenance.data_hash(info)


def _run_with_checkpoint(data: str, storage: Path, record: dict, *extra: str):
    """A run folder whose one checkpoint records `record` as its provenance; its config."""
    cfg = load_config(None, [*TINY, f"data.path={data}", f"run.storage_path={storage}",
                             "run.name=r", *extra])
    check_inputs(cfg)
    model = build_model(cfg.model, cfg.data.max_seq_len)
    snap = snapshot(model, torch.optim.AdamW(model.parameters()), None,
                    {"step": 2, "epoch": 0, "step_in_epoch": 2}, cfg.to_dict(), 2, record)
    write_checkpoint(snap, storage / "r" / "checkpoint_000000002")
    return cfg


def test_a_resume_warns_on_other_libraries_and_refuses_other_data(small_dataset, tmp_path, caplog):
    current = provenance.driver_record(inspect_dataset(small_dataset))
    upgraded = {**current, "versions": {**current["versions"], "torch": "1.0.0"},
                "git": {"commit": "0" * 40, "dirty": False}}
    cfg = _run_with_checkpoint(small_dataset, tmp_path / "a", upgraded)
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        check_inputs(cfg)
    assert f"torch 1.0.0 -> {current['versions']['torch']}" in caplog.text
    assert "git revision 000000000000 -> " in caplog.text

    other_data = {**current, "data_hash": "0123456789abcdef"}
    cfg = _run_with_checkpoint(small_dataset, tmp_path / "b", other_data)
    with pytest.raises(ConfigError, match=r"trained on other data: the data set's content "
                                          r"\(manifest hash\) was 0123456789abcdef"):
        check_inputs(cfg)
    caplog.clear()
    cfg = _run_with_checkpoint(small_dataset, tmp_path / "b", other_data, "data.on_change=keep_position")
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        check_inputs(cfg)  # the override: a warning, naming the change
    assert "manifest hash" in caplog.text

    other_tokenizer = {**current, "tokenizer_hash": "feedfacefeedface"}
    cfg = _run_with_checkpoint(small_dataset, tmp_path / "c", other_tokenizer)
    with pytest.raises(ConfigError, match="the tokenizer was feedfacefeedface, now bytes"):
        check_inputs(cfg)
    assert json.loads((tmp_path / "c" / "r" / "checkpoint_000000002" / "state.json").read_text())[
        "provenance"]["tokenizer_hash"] == "feedfacefeedface"  # nothing was overwritten
