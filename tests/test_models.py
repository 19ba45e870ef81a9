"""The user's model, tokenizer, text and loss, end to end on Ray: a tiny Hugging Face Llama through
the CLI (crash and resume, export, sample), a module of the user's named by import path, and an
inline model with its own loss over an extra data column through the Python API. Each Ray run is
held to the bit against the same config trained in one process without Ray (`localenv.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from localenv import train_locally

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.config import config_from_dict
from elastic_train.data.batches import make_batch
from elastic_train.data.prepare import prepare
from elastic_train.export import load_trained
from elastic_train.training.checkpoint import read_shards
from elastic_train.training.losses import (
    causal_lm_loss,
)

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
USER_MODELS = Path(__file__).parent / "user_models"
SMALL = ["data.max_seq_len=128", "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096",
         "log.progress=none", "scaling.health_check_interval_s=0.1", "checkpoint.every_steps=4",
         "eval.fraction=0", "checkpoint.keep_best=false"]


@pytest.fixture(scope="module")
def bpe_dataset(bpe_tokenizer, tmp_path_factory) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("bpe-data") / "data"
    prepare([stdlib / n for n in ("textwrap.py", "shlex.py", "fnmatch.py", "glob.py")], out,
            max_seq_len=128, tokenizer=bpe_tokenizer, rows_per_shard=300, rows_per_block=16)
    return str(out)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    """A config.json only: the model is initialised from it (no weights, no download)."""
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=True).save_pretrained(folder)
    return str(folder)


def cli(*args: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(env_extra or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([str(BIN / "elastic-train"), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def run_config(run_dir: Path):
    return config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    names = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
    return read_shards(names[-1], "model")


def assert_equal_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t), (name, float((got[name] - t).abs().max()))


def test_hf_llama_survives_a_crash_exports_and_samples(bpe_dataset, llama_folder, tmp_path):
    """Also: model.path relative to the driver's folder is resolved there, so the workers
    (elsewhere) find it, and the run's config.yaml holds the absolute path."""
    out = cli("train", "model.name=hf", f"model.path={Path(llama_folder).name}",
              f"data.path={bpe_dataset}", f"run.storage_path={tmp_path}", "run.name=llama", *SMALL,
              "fault.crash_at_step=5", "fault.crash_rank=1", "scaling.max_failures=2",
              cwd=Path(llama_folder).parent)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "llama"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["restarts"] == 1
    assert summary["world_sizes"] == [2, 2]
    cfg = run_config(run_dir)
    assert cfg.model.path == llama_folder
    assert cfg.data.pad_id == 1  # the tokenizer's <pad>, recorded by prepare
    # The crashed 2-worker run ends with the weights of one uninterrupted process.
    reference = train_locally(cfg)
    assert summary["steps"] == len(reference.steps) > 6  # the whole epoch
    assert_equal_weights(final_weights(run_dir), reference.final["model"])

    exported = tmp_path / "export"
    out = cli("export", str(run_dir), "--output", str(exported))
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = tokenizer("def split(self, text):\n    return text")["input_ids"]
    batch = make_batch(torch.tensor([ids]), torch.tensor([len(ids)]))
    trained = load_trained(run_dir)
    with torch.no_grad():
        assert torch.equal(causal_lm_loss(model.eval(), batch)[0],
                           causal_lm_loss(trained.model, batch)[0])

    out = cli("sample", str(run_dir), "--prompt", "def ", "--max-new-tokens", "12")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("def ") and len(out.stdout.strip()) > len("def")


def test_a_user_module_by_import_path_trains_through_the_cli(small_dataset, tmp_path):
    out = cli("train", "model.name=tiny_gru:build", "model.kwargs={hidden: 24}",
              f"data.path={small_dataset}", f"run.storage_path={tmp_path}", "run.name=gru",
              "train.max_steps=6", *SMALL, env_extra={"PYTHONPATH": str(USER_MODELS)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run_dir = tmp_path / "gru"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 6
    weights = final_weights(run_dir)
    assert weights["embed.weight"].shape == (256, 24)  # vocab from the (byte) data set
    exported = tmp_path / "export"
    out = cli("export", str(run_dir), "--output", str(exported),
              env_extra={"PYTHONPATH": str(USER_MODELS)})
    assert out.returncode == 0, out.stderr[-2000:]
    from safetensors.torch import load_file

    assert_equal_weights(load_file(exported / "model.safetensors"), weights)
    assert (exported / "config.yaml").is_file()


class Bigram(torch.nn.Module):
    """Defined in the driver (here: the test module); shipped to the workers by value."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, tokens):
        return self.table(tokens)


def make_bigram(vocab_size: int, max_seq_len: int) -> torch.nn.Module:
    return Bigram(vocab_size)


def labelled_loss(model, batch):
    """Next-token loss over the rows whose `label` column is 1 only: a loss that counts its own
    targets (fewer than the data's), over a column beyond id/tokens/length."""
    logits = model(batch["tokens"])[:, :-1].float()
    targets = batch["labels"][:, 1:].masked_fill(batch["label"][:, None] == 0, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())


@pytest.fixture(scope="module")
def labelled_dataset(small_dataset, tmp_path_factory) -> str:
    """The small data set with a `label` column (1 for rows of odd length)."""
    out = tmp_path_factory.mktemp("labelled")
    for shard in sorted(Path(small_dataset).glob("*.parquet")):
        table = pq.read_table(shard)
        label = pa.compute.bit_wise_and(table.column("length"), 1).cast(pa.int64())
        pq.write_table(table.append_column("label", label), out / shard.name, row_group_size=32)
    return str(out)


def test_an_inline_model_and_loss_through_the_python_api(ray_cluster, labelled_dataset, tmp_path):
    cfg = load_config(None, [*SMALL, f"data.path={labelled_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=inline", "train.max_steps=6"])
    result = train(cfg, model_fn=make_bigram, loss_fn=labelled_loss)
    assert result.summary["status"] == "finished" and result.summary["world_sizes"] == [2]
    reference = train_locally(run_config(Path(result.run_dir)), make_bigram, labelled_loss,
                              extra_columns=("label",))
    assert_equal_weights(final_weights(Path(result.run_dir)), reference.final["model"])
    losses = [json.loads(x)["loss"] for x in (Path(result.run_dir) / "metrics.jsonl").open()]
    assert losses == pytest.approx([r["loss"] for r in reference.steps], rel=1e-12)
    # The run says which model it trained, and the command line, which cannot rebuild it, says so.
    assert run_config(Path(result.run_dir)).model.inline_fn == f"{__name__}.make_bigram"
    from elastic_train.cli import main

    assert main(["export", result.run_dir, "--output", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()
    assert load_trained(result.run_dir, model_fn=make_bigram).model.table.weight.shape[0] == 256


def test_a_bad_row_stops_the_run_once_naming_it(ray_cluster, small_dataset, tmp_path):
    """A row whose length column lies is found while streaming (its file, row group and id); the
    run fails with that reason instead of restarting into the same error."""
    from elastic_train.api import TrainingFailed

    bad = tmp_path / "bad-data"
    bad.mkdir()
    for shard in sorted(Path(small_dataset).glob("*.parquet")):
        table = pq.read_table(shard)
        lengths = table.column("length").to_numpy().copy()
        if shard.name.endswith("00001.parquet"):
            lengths[5] += 1
        pq.write_table(table.set_column(2, "length", pa.array(lengths)), bad / shard.name,
                       row_group_size=32)
    bad_id = pq.read_table(bad / "part-00001.parquet").column("id")[5].as_py()
    cfg = load_config(None, [*SMALL, f"data.path={bad}", f"run.storage_path={tmp_path}",
                             "run.name=bad", "scaling.max_failures=3"])
    with pytest.raises(TrainingFailed, match=rf"part-00001.parquet', row group 0, row 5 \(id {bad_id}\): "
                                             "its length column says"):
        train(cfg)
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["restarts"] <= 1
