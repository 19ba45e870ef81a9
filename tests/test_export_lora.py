"""What an hf or LoRA export carries and what loading one checks (a code review's findings): the
KV cache on and the base's generation config in an hf export, the base's hash in an adapter
export (checked when it loads), the base an adapter export names when it is gone or a URI, and
--merge on a source without adapters refused before its model loads. Run folders are made
without Ray, as in test_export_folder.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_export_folder import bpe_data, mock_store, run_folder, sampled, tiny_gpt, upload

from elastic_train.cli import main

pytestmark = pytest.mark.unit
pytest.importorskip("peft")
__all__ = ["bpe_data"]  # a fixture, used by name

HASH_FILE = "lora_base_sha256.json"  # export.BASE_HASH_FILE, spelt out: the file's name is the API
LORA = ["model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]"]


@pytest.fixture
def base(tmp_path, monkeypatch) -> Path:
    """A tiny Llama saved with its weights and a generation_config.json of its own (this test's
    copy: tests change its weights); base hashes cached in this test's folder."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("ELASTIC_TRAIN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "base"
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=True)).save_pretrained(folder)
    GenerationConfig(eos_token_id=[2, 7], temperature=0.6, top_p=0.9,
                     do_sample=True).save_pretrained(folder)
    return folder


def hf_run(tmp_path: Path, data: str, base: Path, *overrides: str) -> Path:
    return run_folder(tmp_path / "runs", "r", f"data.path={data}", "model.name=hf",
                      f"model.path={base}", *overrides)


def errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("kind", ["full", "lora-merged"])
def test_an_hf_export_generates_with_the_kv_cache_and_the_bases_generation_config(
        kind, tmp_path, bpe_data, base):
    """Training turns use_cache off (hf.load_hf_config) and builds the model from its config, so
    the export carried use_cache false in config.json and generation_config.json, and a
    generation config derived from config.json in place of the base's own."""
    from transformers import AutoConfig, GenerationConfig

    run = hf_run(tmp_path, bpe_data, base, *(LORA if kind == "lora-merged" else []))
    out = tmp_path / "export"
    assert main(["export", str(run), "--output", str(out),
                 *(["--merge"] if kind == "lora-merged" else [])]) == 0
    assert AutoConfig.from_pretrained(out).use_cache is True
    assert json.loads((out / "config.json").read_text()).get("use_cache", True) is True
    generation = GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [2, 7] and generation.do_sample is True
    assert (generation.temperature, generation.top_p) == (0.6, 0.9)
    assert generation.use_cache is True


def test_an_adapter_export_records_its_base_and_refuses_another(tmp_path, capsys, bpe_data, base):
    """The export holds the hash the run recorded of its base; sampling or re-exporting it onto
    other weights at base_model_name_or_path is refused in the run folder's words; an older
    export (no hash file) loads as before."""
    from safetensors.torch import load_file, save_file

    from elastic_train.training.basehash import folder_hash
    from elastic_train.training.checkpoint import read_shards

    run = hf_run(tmp_path, bpe_data, base, *LORA)
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--output", str(out)]) == 0
    recorded = json.loads((out / HASH_FILE).read_text())
    saved = read_shards(run / "checkpoint_000000001", "model")["lora_base_sha256"]
    assert recorded["lora_base_sha256"] == bytes(saved.tolist()).hex() == folder_hash(base).hex()
    assert recorded["base_model_name_or_path"] == str(base)
    capsys.readouterr()
    before = sampled(capsys, out)
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"][0] += 1  # other weights at the same path
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    for command in (["sample", str(out), "--prompt", "def "],
                    ["export", str(out), "--output", str(tmp_path / "again"), "--merge"]):
        assert main(command) == 2
        (line,) = errors(capsys)
        assert line.startswith(f"error: export '{out}': its LoRA adapters were trained on another "
                               f"base model (base sha256 {recorded['lora_base_sha256'][:16]}..."), line
    assert main(["sample", str(run), "--prompt", "def "]) == 2  # the run folder: the same words
    assert "LoRA adapters were trained on another base model (base sha256" in errors(capsys)[0]
    (out / HASH_FILE).unlink()  # an export written before the file existed: not checked
    assert sampled(capsys, out).startswith("def ") and before.startswith("def ")


@pytest.mark.parametrize("where", ["gone", "uri"])
def test_an_adapter_exports_base_that_is_gone_or_a_uri_is_named_as_such(
        where, tmp_path, capsys, bpe_data, base):
    """Not 'has no weights (the run built it from its config and seed)', which was untrue."""
    run = hf_run(tmp_path, bpe_data, base, *LORA)
    out = tmp_path / "adapters"
    assert main(["export", str(run), "--output", str(out)]) == 0
    named = {"gone": str(tmp_path / "moved"), "uri": "s3://bucket/base"}[where]
    settings = json.loads((out / "adapter_config.json").read_text())
    settings["base_model_name_or_path"] = named
    (out / "adapter_config.json").write_text(json.dumps(settings))
    capsys.readouterr()
    assert main(["sample", str(out), "--prompt", "x"]) == 2
    (line,) = errors(capsys)
    assert line.startswith(f"error: export '{out}' holds LoRA adapters of the base '{named}', "
                           + {"gone": "a folder that is not found",
                              "uri": "a URI, which cannot be loaded here"}[where]), line
    assert "no weights" not in line


@pytest.mark.parametrize("source", ["run", "remote-run", "hf-export", "own-export"])
def test_merge_of_a_source_without_adapters_is_refused_before_its_model_loads(
        source, tmp_path, capsys, monkeypatch, bpe_data, base):
    """--merge on a run of model.lora.r=0, or on an export folder of a whole model: one line true
    of that source (an export folder was told 'model.lora.r is 0'), before any model loads (it
    was refused after the whole model had loaded), and no output folder left."""
    from elastic_train import export
    from elastic_train.observe import runfolder

    hf = source == "hf-export"
    run = (hf_run(tmp_path, bpe_data, base) if hf
           else run_folder(tmp_path / "runs", "r", *tiny_gpt(bpe_data)))
    shown = str(run)
    if source.endswith("export"):
        assert main(["export", str(run), "--output", str(tmp_path / "whole")]) == 0
        shown = str(tmp_path / "whole")
    if source == "remote-run":
        store = mock_store(monkeypatch, runfolder)
        upload(store, run, "runs/r")
        shown = "mock:///runs/r"

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before --merge was checked")

    monkeypatch.setattr(export, "_load_trained", refuse)
    capsys.readouterr()
    assert main(["export", shown, "--output", str(tmp_path / "merged"), "--merge"]) == 2
    (line,) = errors(capsys)
    expected = {"run": f"--merge: run '{shown}' trained no LoRA adapters (model.lora.r is 0)",
                "hf-export": f"--merge: export folder '{shown}' holds a whole transformers model",
                "own-export": f"--merge: export folder '{shown}' holds a whole model "
                              "(model.safetensors)"}
    assert line.startswith(f"error: {expected.get(source, expected['run'])}"), line
    assert not (tmp_path / "merged").exists()


def test_merge_of_an_adapter_export_writes_the_merged_model(tmp_path, capsys, bpe_data, base):
    """An adapter export holds adapters: --merge on it is accepted (it was refused, 'model.lora.r
    is 0') and writes the model the run folder's --merge writes."""
    from safetensors.torch import load_file

    run = hf_run(tmp_path, bpe_data, base, *LORA)
    assert main(["export", str(run), "--output", str(tmp_path / "adapters")]) == 0
    assert main(["export", str(tmp_path / "adapters"), "--output", str(tmp_path / "m1"),
                 "--merge"]) == 0
    assert main(["export", str(run), "--output", str(tmp_path / "m2"), "--merge"]) == 0
    one, two = (load_file(tmp_path / name / "model.safetensors") for name in ("m1", "m2"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
