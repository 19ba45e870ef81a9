"""`elastic-train sample` on a folder `export` wrote (issue 38): the embedded GPT, a transformers
model, and LoRA adapters on a transformers base, each sampling as the run folder does. The run
folders are made without Ray: a checkpoint written by the checkpoint code itself."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest
import torch

from elastic_train.cli import main
from elastic_train.config import load_config
from elastic_train.data.prepare import prepare
from elastic_train.observe.provenance import driver_record
from elastic_train.preflight.inputs import check_inputs
from elastic_train.training.checkpoint import snapshot, write_checkpoint
from elastic_train.training.model import build_model

pytestmark = pytest.mark.unit


def run_folder(storage: Path, name: str, *overrides: str) -> Path:
    """A run folder with one complete checkpoint of a model as built (perturbed, so it is not
    the seed's), and its config.yaml."""
    cfg = load_config(None, [f"run.storage_path={storage}", f"run.name={name}", "eval.fraction=0",
                             "checkpoint.keep_best=false", *overrides])
    info = check_inputs(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data.max_seq_len)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    trainable = [p for p in model.parameters() if p.requires_grad]
    snap = snapshot(model, torch.optim.AdamW(trainable), None,
                    {"step": 1, "epoch": 0, "step_in_epoch": 1}, cfg.to_dict(), world_size=1,
                    provenance=driver_record(info))
    run = storage / name
    write_checkpoint(snap, run / "checkpoint_000000001")
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run


def sampled(capsys, folder: Path, *extra: str) -> str:
    assert main(["sample", str(folder), "--prompt", "def ", "--max-new-tokens", "8",
                 "--temperature", "0", *extra]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def bpe_data(bpe_tokenizer, tmp_path_factory) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("bpe") / "data"
    prepare([stdlib / "textwrap.py", stdlib / "shlex.py"], out, max_seq_len=64,
            tokenizer=bpe_tokenizer)
    return str(out)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True)).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kind", ["gpt", "hf", "lora", "lora-merged"])
def test_sample_on_an_export_folder_continues_as_the_run_folder_does(
        kind, tmp_path, capsys, bpe_data, llama):
    overrides = {"gpt": ["model.n_layer=1", "model.d_model=32", "model.n_head=2"],
                 "hf": ["model.name=hf", f"model.path={llama}"],
                 "lora": ["model.name=hf", f"model.path={llama}", "model.lora.r=4",
                          "model.lora.target_modules=[q_proj, v_proj]"]}[kind.split("-")[0]]
    run = run_folder(tmp_path / "runs", "r", f"data.path={bpe_data}", *overrides)
    args = ["--merge"] if kind == "lora-merged" else []
    assert main(["export", str(run), "--output", str(tmp_path / "export"), *args]) == 0
    capsys.readouterr()
    from_run = sampled(capsys, run)
    assert from_run.startswith("def ") and len(from_run) > len("def \n")
    assert sampled(capsys, tmp_path / "export") == from_run


# -- review fixes: remote run folders, LoRA of other models, the checkpoint named, bad outputs --
def mock_store(monkeypatch, *modules):
    """pyarrow's in-memory store standing in for s3://: `mock:///runs/r` is `runs/r` in it."""
    import pyarrow.fs as pafs

    store, _ = pafs.FileSystem.from_uri("mock:///runs")
    for module in modules:
        monkeypatch.setattr(module, "split_uri",
                            lambda uri: (store, uri.split("://", 1)[1].strip("/"), False))
    return store


def upload(store, local: Path, remote: str) -> None:
    import pyarrow.fs as pafs

    pafs.copy_files(str(local), remote, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=store)


def tiny_gpt(data: str) -> list[str]:
    return [f"data.path={data}", "model.n_layer=1", "model.d_model=32", "model.n_head=2"]


def test_export_and_sample_read_a_run_folder_on_remote_storage(tmp_path, capsys, monkeypatch,
                                                               bpe_data):
    from elastic_train import export
    from elastic_train.observe import runfolder

    store = mock_store(monkeypatch, runfolder)
    run = run_folder(tmp_path / "runs", "r", *tiny_gpt(bpe_data))
    (run / "checkpoint_000000000").mkdir()  # an older, incomplete one: never downloaded
    upload(store, run, "runs/r")
    copied, load = [], export._load_trained
    monkeypatch.setattr(export, "_load_trained",
                        lambda folder, *a: copied.append(sorted(os.listdir(folder))) or load(folder, *a))
    assert main(["export", "mock:///runs/r", "--output", str(tmp_path / "export")]) == 0
    assert copied == [["checkpoint_000000001", "config.yaml"]]
    assert "checkpoint_000000001" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "export").iterdir()) == [
        "config.yaml", "model.safetensors", "tokenizer"]
    assert sampled(capsys, "mock:///runs/r") == sampled(capsys, run)
    store.create_dir("runs/e")
    upload(store, tmp_path / "export", "runs/e")  # an export folder on remote storage samples too
    assert sampled(capsys, "mock:///runs/e") == sampled(capsys, run)

    for command in (["sample", "mock:///runs/absent", "--prompt", "x"],
                    ["export", "mock:///runs/absent", "--output", str(tmp_path / "e2")]):
        assert main(command) == 2
        assert capsys.readouterr().err == "error: run folder 'mock:///runs/absent' does not exist\n"
    assert not (tmp_path / "e2").exists()


def test_a_missing_local_run_folder_is_named_as_missing(tmp_path, capsys):
    assert main(["sample", str(tmp_path / "absent"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == f"error: run folder '{tmp_path / 'absent'}' does not exist\n"


@pytest.mark.parametrize("merge", [False, True])
def test_a_lora_run_of_a_model_not_hf_exports_merged_with_the_config_as_saved(
        merge, tmp_path, capsys, bpe_data):
    """Adapters of a model transformers cannot name as a base are loadable by nothing: such a
    run exports merged (the model.safetensors + config.yaml of any model not hf), and the
    config.yaml it writes builds the model it saved (LoRA off)."""
    import yaml
    from safetensors.torch import load_model

    from elastic_train.config import config_from_dict

    run = run_folder(tmp_path / "runs", "r", *tiny_gpt(bpe_data), "model.lora.r=4",
                     "model.lora.target_modules=[qkv, proj]")
    out = tmp_path / "export"
    assert main(["export", str(run), "--output", str(out), *(["--merge"] if merge else [])]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", "tokenizer"]
    cfg = config_from_dict(yaml.safe_load((out / "config.yaml").read_text()))
    assert cfg.model.lora.r == 0
    load_model(build_model(cfg.model, cfg.data.max_seq_len), str(out / "model.safetensors"))
    capsys.readouterr()
    assert sampled(capsys, out) == sampled(capsys, run)


def test_export_and_sample_name_the_checkpoint_and_warn_when_the_best_is_gone(
        tmp_path, capsys, bpe_data):
    import json
    import shutil

    run = run_folder(tmp_path / "runs", "r", *tiny_gpt(bpe_data))
    assert main(["sample", str(run), "--prompt", "x", "--max-new-tokens", "1"]) == 0
    assert "checkpoint_000000001 (step 1" in capsys.readouterr().err
    shutil.copytree(run / "checkpoint_000000001", run / "best_checkpoint_000000001")
    (run / "best_checkpoint.json").write_text(json.dumps(
        {"checkpoint": "best_checkpoint_000000001", "step": 1, "eval_loss": 2.5}))
    assert main(["export", str(run), "--output", str(tmp_path / "e1")]) == 0
    err = capsys.readouterr().err
    assert "best_checkpoint_000000001 (step 1" in err and "eval loss 2.5" in err
    assert "warning" not in err
    shutil.rmtree(run / "best_checkpoint_000000001")
    assert main(["sample", str(run), "--prompt", "x", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if line.startswith("warning: ")] == [
        "warning: best_checkpoint.json names best_checkpoint_000000001, which is missing or "
        "incomplete: using the newest complete checkpoint"]
    assert any("checkpoint_000000001 (step 1" in line for line in err)


@pytest.mark.parametrize("kind", ["under-a-file", "dot", "name-too-long", "existing-file", "uri"])
def test_a_bad_output_is_one_error_line_before_anything_loads(kind, tmp_path, capsys, monkeypatch):
    from elastic_train import export

    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    output = {"under-a-file": str(tmp_path / "file" / "out"), "dot": ".",
              "name-too-long": str(tmp_path / ("x" * 300) / "out"),
              "existing-file": str(tmp_path / "file"),
              "uri": "s3://bucket/x"}[kind]  # was written to a local folder ./s3:/bucket/x

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr(export, "load_trained", refuse)
    before = sorted(os.listdir(tmp_path))
    assert main(["export", str(tmp_path / "run"), "--output", output]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: output '{output}'") and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == before and os.path.islink(tmp_path / "link")
    assert os.listdir(cwd) == [] and os.listdir(tmp_path / "empty") == []


def test_an_output_that_is_a_link_to_an_empty_folder_is_written_through_it(tmp_path, capsys, bpe_data):
    run = run_folder(tmp_path / "runs", "r", *tiny_gpt(bpe_data))
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    assert main(["export", str(run), "--output", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "empty" / "model.safetensors").is_file()


def test_sample_when_the_data_set_is_gone_or_prepared_again(tmp_path, capsys, bpe_data):
    """The tokenizer is read from the run's data set. Gone (a run folder copied from s3 to a
    laptop): a byte run samples as before, from the tokenizer its checkpoint records; a BPE run
    is one error line naming the data set. Prepared again with another tokenizer: refused."""
    import shutil

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "textwrap.py"], tmp_path / "bytes", max_seq_len=64)
    run = run_folder(tmp_path / "runs", "b", *tiny_gpt(str(tmp_path / "bytes")))
    before = sampled(capsys, run)
    shutil.rmtree(tmp_path / "bytes")
    assert sampled(capsys, run) == before
    shutil.copytree(bpe_data, tmp_path / "bpe")
    run = run_folder(tmp_path / "runs", "p", *tiny_gpt(str(tmp_path / "bpe")))
    shutil.rmtree(tmp_path / "bpe")
    prepare([stdlib / "textwrap.py"], tmp_path / "bpe", max_seq_len=64)  # bytes now
    assert main(["sample", str(run), "--prompt", "x"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"error: data set '{tmp_path / 'bpe'}' now holds another tokenizer "
                          "(bytes) than the run trained with"), err
    shutil.rmtree(tmp_path / "bpe")
    assert main(["export", str(run), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: the run's tokenizer (") and f"'{tmp_path / 'bpe'}'" in err, err
    assert "does not exist" in err and not (tmp_path / "out").exists()


class Bigram(torch.nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table(tokens)


def make_bigram(vocab_size: int, max_seq_len: int) -> Bigram:
    return Bigram(vocab_size)


def test_an_exported_inline_model_loads_with_its_model_fn(tmp_path):
    """export(run, out, model_fn=f) writes an inline model; load_trained(out, model_fn=f) loads
    it back (it refused: 'load it with your model_fn' although it was given); without f, the
    refusal names the way."""
    from elastic_train.export import export, load_trained

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "textwrap.py"], tmp_path / "data", max_seq_len=64)
    cfg = load_config(None, [f"run.storage_path={tmp_path}", "run.name=r", "eval.fraction=0",
                             "checkpoint.keep_best=false", f"data.path={tmp_path / 'data'}"])
    info = check_inputs(cfg, make_bigram)
    model = make_bigram(256, 64)
    snap = snapshot(model, torch.optim.AdamW(model.parameters()), None,
                    {"step": 1, "epoch": 0, "step_in_epoch": 1}, cfg.to_dict(), world_size=1,
                    provenance=driver_record(info))
    write_checkpoint(snap, tmp_path / "r" / "checkpoint_000000001")
    (tmp_path / "r" / "config.yaml").write_text(cfg.to_yaml())
    export(tmp_path / "r", tmp_path / "out", model_fn=make_bigram)
    loaded = load_trained(tmp_path / "out", model_fn=make_bigram).model
    assert torch.equal(loaded.table.weight, model.table.weight)
    with pytest.raises(ValueError, match="load_trained\\(EXPORT, model_fn=...\\)"):
        load_trained(tmp_path / "out")
