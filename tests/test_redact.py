"""Secrets in URIs (config/redact.py): a store's keys or a server's password given in a URI are
masked wherever the run writes or shows them, and filled back in from the URI a later command
is given. The run on an S3 store with its keys in the URI (test_repeated_faults) checks that no
file on the store, in the export or on the console holds the secret."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

from elastic_train import load_config
from elastic_train.config import redact
from elastic_train.export import load_run_config
from elastic_train.observe.runfolder import RunFolder
from elastic_train.training.checkpoint import read_state, snapshot, write_checkpoint

pytestmark = pytest.mark.unit

STORE = "s3://AKIA7:Sekr3t%2Fx@bucket/{}?region=us-east-1&endpoint_override=10.0.0.5:9000&scheme=http"


@pytest.mark.parametrize("given, masked", [
    (STORE.format("runs"),
     "s3://AKIA7:***@bucket/runs?region=us-east-1&endpoint_override=10.0.0.5:9000&scheme=http"),
    ("postgresql://mlflow:pa:ss@db.internal:5432/runs", "postgresql://mlflow:***@db.internal:5432/runs"),
    ("error: dataset path 's3://k:s1@b/x' bad; see http://u:s2@host:5000/api",
     "error: dataset path 's3://k:***@b/x' bad; see http://u:***@host:5000/api"),
])
def test_a_uri_secret_is_masked_and_its_key_stays(given, masked):
    assert redact.shown(given) == masked


@pytest.mark.parametrize("text", [
    "s3://bucket/runs?endpoint_override=host:9000", "http://host:5000/x", "gs://b/a@b:c",
    "user@example.com: a:b@c", "/local/runs/a:b@c", "s3://onlyuser@bucket/x", None,
])
def test_what_holds_no_secret_is_left_as_it_is(text):
    assert redact.shown(text) == text


def test_a_masked_secret_is_filled_from_a_given_uri_with_the_same_key_else_dropped():
    saved = redact.shown(STORE.format("data"))
    assert redact.with_keys(saved, [STORE.format("runs/r")]) == STORE.format("data")
    other = "s3://OTHER:zz@bucket/runs/r"
    assert redact.with_keys(saved, [other]) == \
        "s3://bucket/data?region=us-east-1&endpoint_override=10.0.0.5:9000&scheme=http"
    assert redact.with_keys(STORE.format("data"), [other]) == STORE.format("data")
    assert redact.with_keys(None, [other]) is None


def test_the_package_loggers_mask_what_they_log(caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        logging.getLogger("elastic_train").warning("run folder %s is in use", STORE.format("runs"))
        logging.getLogger("elastic_train.prepare").warning(f"wrote {STORE.format('data')}")
    assert len(caplog.records) == 2 and "Sekr3t" not in caplog.text
    assert "s3://AKIA7:***@bucket/runs?" in caplog.text and "s3://AKIA7:***@bucket/data?" in caplog.text


def test_the_run_folder_and_a_checkpoint_hold_the_config_masked_and_export_fills_it_back(tmp_path):
    cfg = load_config(None, [f"data.path={STORE.format('data/corpus')}",
                             f"run.storage_path={STORE.format('runs')}", "run.name=r"])
    folder = RunFolder(str(tmp_path / "r"))
    folder.write("config.yaml", cfg.to_yaml())
    folder.append("events.jsonl", [f'{{"error": "cannot read {cfg.data.path}"}}'])
    folder.stage("provenance.json", f'{{"data": "{cfg.data.path}"}}')
    folder.accept()
    for name in ("config.yaml", "events.jsonl", "provenance.json"):
        text = (tmp_path / "r" / name).read_text()
        assert "Sekr3t" not in text and "AKIA7:***@bucket" in text, name
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["data"]["path"] == redact.shown(cfg.data.path)

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    write_checkpoint(snapshot(model, optimizer, None, {"step": 1}, cfg.to_dict(), 1),
                     tmp_path / "r" / "checkpoint_000001")
    state = read_state(tmp_path / "r" / "checkpoint_000001")
    assert state["config"]["data"]["path"] == redact.shown(cfg.data.path)
    assert "Sekr3t" not in (tmp_path / "r" / "checkpoint_000001" / "state.json").read_text()

    # export and sample, given the run folder with its keys, open the data set with them
    back = load_run_config(tmp_path / "r", keys_from=STORE.format("runs/r"))
    assert (back.data.path, back.run.storage_path) == (cfg.data.path, cfg.run.storage_path)
    assert load_run_config(tmp_path / "r").data.path == \
        "s3://bucket/data/corpus?region=us-east-1&endpoint_override=10.0.0.5:9000&scheme=http"
