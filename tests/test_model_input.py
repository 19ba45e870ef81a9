"""Bad model input: one clear `error:` line naming the culprit, before Ray starts (no Ray here)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from elastic_train.cli import main

pytestmark = pytest.mark.unit

USER_MODELS = str(Path(__file__).parent / "user_models")
SMALL = ["data.max_seq_len=128", "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096",
         "log.progress=none", "eval.fraction=0", "checkpoint.keep_best=false"]


@pytest.fixture
def user_models_on_path(monkeypatch):
    monkeypatch.syspath_prepend(USER_MODELS)
    yield
    for name in [m for m in sys.modules if m == "tiny_gru"]:
        del sys.modules[name]


@pytest.mark.parametrize("override, message", [
    ("model.name=no_such_module:build", "cannot import module 'no_such_module'"),
    ("model.name=tiny_gru:nothing", "module 'tiny_gru' has no attribute 'nothing'"),
    ("model.name=tiny_gru:broken", "tiny_gru:broken.*raised RuntimeError: this factory is broken"),
    ("model.name=tiny_gru:not_a_module", "tiny_gru:not_a_module returned dict, not a torch.nn.Module"),
    ("model.name=tiny_gru:build model.vocab_size=100",
     r"embedding has 100 rows but data set .* uses token id \d+; set model.vocab_size .* to at least"),
    ("model.name=tiny_gru:build model.kwargs.vocab_size=100",
     "model.kwargs.vocab_size: the factory gets vocab_size from model.vocab_size"),
    ("model.name=hf", "model.path: model.name=hf needs"),
    ("model.name=gpt model.gradient_checkpointing=true model.n_head=0", "model.n_head must be >= 1"),
])
def test_bad_model_input_is_one_clear_error(user_models_on_path, small_dataset, tmp_path, capsys,
                                            override, message):
    argv = ["train", *SMALL, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
            *override.split(" ")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err[0]
    assert not any(tmp_path.iterdir())  # nothing written: refused before Ray started


def test_hf_folder_without_config_json(small_dataset, tmp_path, capsys):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    argv = ["train", *SMALL, f"data.path={small_dataset}", f"run.storage_path={tmp_path / 'runs'}",
            "model.name=hf", f"model.path={empty}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: model.path: '{empty}' holds no config.json (a folder of a transformers " \
                  "model is expected)"


def test_hf_model_with_too_few_positions(small_dataset, tmp_path, capsys):
    from transformers import LlamaConfig

    folder = tmp_path / "llama"
    LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64).save_pretrained(folder)
    argv = ["train", *SMALL, f"data.path={small_dataset}", f"run.storage_path={tmp_path / 'runs'}",
            "model.name=hf", f"model.path={folder}"]
    assert main(argv) == 2
    assert "data.max_seq_len (128) is longer than the model's max_position_embeddings (64)" in \
        capsys.readouterr().err
