"""`elastic-train sample` on a folder `export` wrote (issue 38): the embedded GPT, a transformers
model, and LoRA adapters on a transformers base, each sampling as the run folder does. The run
folders are made without Ray: a checkpoint written by the checkpoint code itself."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from elastic_train.cli import main
from elastic_train.config import load_config
from elastic_train.data.prepare import prepare
from elastic_train.preflight.inputs import check_inputs
from elastic_train.training.checkpoint import snapshot, write_checkpoint
from elastic_train.training.model import build_model

pytestmark = pytest.mark.unit


def run_folder(storage: Path, name: str, *overrides: str) -> Path:
    """A run folder with one complete checkpoint of a model as built (perturbed, so it is not
    the seed's), and its config.yaml."""
    cfg = load_config(None, [f"run.storage_path={storage}", f"run.name={name}", "eval.fraction=0",
                             "checkpoint.keep_best=false", *overrides])
    check_inputs(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data.max_seq_len)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    trainable = [p for p in model.parameters() if p.requires_grad]
    snap = snapshot(model, torch.optim.AdamW(trainable), None,
                    {"step": 1, "epoch": 0, "step_in_epoch": 1}, cfg.to_dict(), world_size=1)
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
