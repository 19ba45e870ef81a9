"""What a new user gets wrong on day one, refused by name before Ray starts, and paths, models and
exports that behave (issue 28): a model folder's tokenizer against the data's, a model that is not
a causal decoder, relative paths, the hf vocabulary hint, a resume after re-preparing with another
tokenizer, the changed-config warning's keys, an inline model_fn's run, the GPT's kwargs, and
the modes of exported files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY

from elastic_train.cli import main
from elastic_train.config import ConfigError, config_changes, load_config
from elastic_train.data.prepare import prepare
from elastic_train.preflight.inputs import check_inputs

pytestmark = pytest.mark.unit

STDLIB = Path(sysconfig.get_paths()["stdlib"])
HF = ["model.name=hf", "data.max_seq_len=128", "data.micro_batch_tokens=1024",
      "data.global_batch_tokens=4096", "log.progress=none", "eval.fraction=0",
      "checkpoint.keep_best=false"]


def train_bpe(path: Path, sources: tuple[str, ...], vocab_size: int = 400) -> str:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens trained on stdlib modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(STDLIB / s) for s in sources], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return str(path)


def llama_folder(folder: Path, vocab_size: int = 400, tokenizer: str | None = None) -> Path:
    """A tiny Llama config.json (no weights), with a transformers copy of `tokenizer` beside it."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=True).save_pretrained(folder)
    if tokenizer is not None:
        from elastic_train.data.tokenizer import load_tokenizer

        load_tokenizer(tokenizer).save_for_transformers(folder)  # the files a hub model carries
    return folder


@pytest.fixture(scope="module")
def two_tokenizers(tmp_path_factory) -> tuple[str, str]:
    """Two BPE tokenizers of the same size (400), trained on different text: other vocabularies."""
    root = tmp_path_factory.mktemp("tok")
    return (train_bpe(root / "a" / "tokenizer.json", ("textwrap.py", "shlex.py")),
            train_bpe(root / "b" / "tokenizer.json", ("glob.py", "fnmatch.py", "heapq.py")))


def prepared(out: Path, tokenizer: str | None) -> str:
    prepare([STDLIB / n for n in ("textwrap.py", "shlex.py", "bisect.py")], out, max_seq_len=128,
            tokenizer=tokenizer, rows_per_shard=200, rows_per_block=16)
    return str(out)


@pytest.fixture(scope="module")
def data_a(two_tokenizers, tmp_path_factory) -> str:
    return prepared(tmp_path_factory.mktemp("da") / "data", two_tokenizers[0])


@pytest.fixture(scope="module")
def data_b(two_tokenizers, tmp_path_factory) -> str:
    return prepared(tmp_path_factory.mktemp("db") / "data", two_tokenizers[1])


def hf_config(model: Path | str, data: str, storage: Path | str, *extra: str):
    return load_config(None, [*HF, f"model.path={model}", f"data.path={data}",
                              f"run.storage_path={storage}", *extra])


# ---- the model folder's tokenizer against the data's ----

def test_a_model_folder_with_another_tokenizer_is_refused_naming_both(two_tokenizers, data_a,
                                                                      data_b, tmp_path):
    model = llama_folder(tmp_path / "model", tokenizer=two_tokenizers[0])
    check_inputs(hf_config(model, data_a, tmp_path))  # its own tokenizer: passes
    with pytest.raises(ConfigError) as refused:
        check_inputs(hf_config(model, data_b, tmp_path))
    message = str(refused.value)
    assert message.startswith(f"model.path: the tokenizer in '{model}' (hf, 400 tokens")
    assert f"data set '{data_b}' was prepared with ('{data_b}/tokenizer': hf, 400 tokens" in message
    assert "token(s) have other ids (e.g. " in message and "model.tokenizer_check=false" in message
    cfg = hf_config(model, data_b, tmp_path, "model.tokenizer_check=false")
    check_inputs(cfg)  # the user means it
    assert cfg.model.tokenizer_check is False


def test_a_tokenizer_that_extends_the_datas_agrees_and_byte_data_does_not(two_tokenizers, data_a,
                                                                          good_bytes, tmp_path):
    from tokenizers import Tokenizer

    extended = Tokenizer.from_file(two_tokenizers[0])
    extended.add_special_tokens(["<|im_start|>", "<|im_end|>"])  # ids 400, 401
    (tmp_path / "ext").mkdir()
    extended.save(str(tmp_path / "ext" / "tokenizer.json"))
    model = llama_folder(tmp_path / "model", vocab_size=402, tokenizer=str(tmp_path / "ext"))
    check_inputs(hf_config(model, data_a, tmp_path))
    with pytest.raises(ConfigError, match=r"the data set holds UTF-8 bytes \(prepared without "
                                          r"--tokenizer\)"):
        check_inputs(hf_config(model, good_bytes, tmp_path))
    check_inputs(hf_config(llama_folder(tmp_path / "bare"), data_a, tmp_path))  # no tokenizer


@pytest.fixture(scope="module")
def good_bytes(tmp_path_factory) -> str:
    return prepared(tmp_path_factory.mktemp("bytes") / "data", None)


# ---- not a causal decoder ----

def test_a_bert_folder_is_refused_by_name(data_a, tmp_path):
    from transformers import BertConfig

    BertConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=128,
               architectures=["BertForMaskedLM"]).save_pretrained(tmp_path / "bert")
    with pytest.raises(ConfigError, match=rf"model.path: '{tmp_path / 'bert'}' is a bert model "
                                          r"\(BertForMaskedLM\), not a causal language model"):
        check_inputs(hf_config(tmp_path / "bert", data_a, tmp_path))
    BertConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=128).save_pretrained(tmp_path / "enc")
    with pytest.raises(ConfigError, match="a bidirectional encoder, not a causal language model"):
        check_inputs(hf_config(tmp_path / "enc", data_a, tmp_path))
    BertConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, max_position_embeddings=128,
               is_decoder=True).save_pretrained(tmp_path / "dec")
    check_inputs(hf_config(tmp_path / "dec", data_a, tmp_path))  # a BERT made a decoder: causal


# ---- paths ----

def test_relative_paths_are_resolved_on_the_driver(data_a, tmp_path, monkeypatch):
    llama_folder(tmp_path / "models" / "tiny")
    shutil.copytree(data_a, tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    cfg = hf_config("models/tiny", "data", Path("runs"))
    check_inputs(cfg)
    assert (cfg.model.path, cfg.data.path) == (str(tmp_path / "models/tiny"), str(tmp_path / "data"))
    assert cfg.run.storage_path == str(tmp_path / "runs")
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = hf_config("~/models/tiny", "~/data", "s3://bucket/runs")
    cfg.train.compile_cache_dir = "compile_cache"
    from elastic_train.preflight.resolve import resolve_paths

    resolve_paths(cfg)
    assert cfg.model.path == str(tmp_path / "models/tiny") and cfg.data.path == str(tmp_path / "data")
    assert cfg.train.compile_cache_dir == str(tmp_path / "compile_cache")
    assert cfg.run.storage_path == "s3://bucket/runs"  # a URI stays as it is


# ---- the hf vocabulary hint ----

def test_an_hf_model_too_small_for_the_data_says_what_helps(data_a, tmp_path):
    model = llama_folder(tmp_path / "small", vocab_size=300)
    with pytest.raises(ConfigError) as refused:
        check_inputs(hf_config(model, data_a, tmp_path))
    message = str(refused.value)
    assert message.startswith(f"model.path: the model in '{model}' embeds 300 token ids")
    assert "use a model whose vocabulary covers the data's tokenizer" in message
    assert "model.vocab_size" not in message  # it changes nothing for hf


@pytest.mark.parametrize("lora", [False, True])
def test_an_hf_model_too_small_for_the_data_is_refused_with_lora_too(data_a, tmp_path, lora):
    """LoRA wraps the transformers model (peft): the vocabulary and position checks look through
    it to the base. Before, a LoRA run of a model embedding too few ids or positions passed
    the driver (its position table was taken for the vocabulary; it has no config) and failed
    on every worker with an IndexError that named no key."""
    from transformers import LlamaConfig

    small = tmp_path / "small"
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=True).save_pretrained(small)
    short = tmp_path / "short"
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                tie_word_embeddings=True).save_pretrained(short)
    adapters = ["model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]"] if lora else []
    with pytest.raises(ConfigError, match="embeds 300 token ids"):
        check_inputs(hf_config(small, data_a, tmp_path, *adapters))
    with pytest.raises(ConfigError, match=r"longer than the model's max_position_embeddings \(32\)"):
        check_inputs(hf_config(short, data_a, tmp_path, *adapters))


# ---- a resume after re-preparing with another tokenizer ----

def _checkpointed_run(cfg, record: dict, model_fn=None) -> None:
    from elastic_train.preflight.checks import IDENTITY_FILE, data_identity
    from elastic_train.training.checkpoint import snapshot, write_checkpoint
    from elastic_train.training.model import build_model

    info = check_inputs(cfg, model_fn)
    model = build_model(cfg.model, cfg.data.max_seq_len, model_fn)
    snap = snapshot(model, torch.optim.AdamW(model.parameters()), None,
                    {"step": 2, "epoch": 0, "step_in_epoch": 2}, cfg.to_dict(), 2, record)
    run = Path(cfg.run.storage_path) / cfg.run.name
    write_checkpoint(snap, run / "checkpoint_000000002")
    (run / IDENTITY_FILE).write_text(json.dumps(data_identity(cfg, info)))


def test_a_resume_on_data_of_another_tokenizer_names_the_tokenizer_first(two_tokenizers, tmp_path):
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.observe import provenance

    data = prepared(tmp_path / "data", two_tokenizers[0])
    base = [*TINY, f"data.path={data}", f"run.storage_path={tmp_path / 'runs'}", "run.name=r",
            "model.vocab_size=400"]
    cfg = load_config(None, base)
    _checkpointed_run(cfg, provenance.driver_record(inspect_dataset(data)))
    shutil.rmtree(data)
    prepared(tmp_path / "data", two_tokenizers[1])  # the same path, another tokenizer
    with pytest.raises(ConfigError) as refused:
        check_inputs(load_config(None, base))
    message = str(refused.value)
    assert "trained on other data: the tokenizer was " in message
    assert f"(hf, 400 tokens, {data}/tokenizer)" in message
    assert message.index("the tokenizer was") < message.index("rows")


# ---- the changed-config warning ----

def test_the_changed_config_warning_names_the_keys():
    from elastic_train.cluster.driver import _changed_keys

    old = load_config(None, [])
    new = load_config(None, ["data.seed=3", "optim.lr=0.01", "model.kwargs={n_layer: 3}"])
    assert config_changes(old.to_dict(), old.to_dict()) is None
    said = _changed_keys(old.to_yaml(), new)
    assert said == "data.seed 0 -> 3, model.kwargs {} -> {'n_layer': 3}, optim.lr 0.003 -> 0.01"
    more = load_config(None, ["data.seed=3", "optim.lr=0.01", "train.seed=1", "run.name=x",
                              "train.max_steps=7", "log.tensorboard=true"])
    assert _changed_keys(old.to_yaml(), more).endswith(" and 2 more")


# ---- an inline model_fn's run ----

def make_bigram(vocab_size: int, max_seq_len: int) -> torch.nn.Module:
    return torch.nn.Embedding(vocab_size, vocab_size)


def test_an_inline_model_is_recorded_and_export_and_sample_say_to_use_the_api(good_bytes, tmp_path,
                                                                              capsys):
    from elastic_train.export import export

    cfg = load_config(None, [*TINY, f"data.path={good_bytes}", f"run.storage_path={tmp_path}",
                             "run.name=inline"])
    check_inputs(cfg, model_fn=make_bigram)
    assert cfg.model.inline_fn == f"{__name__}.make_bigram" and cfg.model.name == "gpt"
    run = tmp_path / "inline"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    for argv in (["export", str(run), "--output", str(tmp_path / "out")],
                 ["sample", str(run), "--prompt", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: run '{run}' trained an inline model "
                                                       f"({__name__}.make_bigram")
        assert "use the Python API" in err
    with pytest.raises(ConfigError, match=r"model.inline_fn: .*train\(cfg, model_fn=make_bigram\)"):
        check_inputs(load_config(None, [*TINY, f"data.path={good_bytes}",
                                        f"model.inline_fn={cfg.model.inline_fn}"]))
    # with its model_fn, the Python API exports it
    _checkpointed_run(cfg, {}, make_bigram)
    check_inputs(cfg, model_fn=make_bigram)  # the run's own config resumes with it
    out = export(run, tmp_path / "exported", model_fn=make_bigram)
    assert (out / "model.safetensors").is_file()


# ---- the GPT's kwargs ----

def test_gpt_kwargs_set_its_fields_and_unknown_ones_are_refused(good_bytes, tmp_path):
    from elastic_train.training.model import build_model

    cfg = load_config(None, [*TINY, f"data.path={good_bytes}", f"run.storage_path={tmp_path}",
                             "model.kwargs={n_layer: 3, d_model: 48}"])
    check_inputs(cfg)
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.kwargs) == (3, 48, {})
    model = build_model(cfg.model, cfg.data.max_seq_len)
    assert len(model.blocks) == 3 and model.wte.weight.shape[1] == 48
    with pytest.raises(ConfigError, match=r"model.kwargs: hidden, layers not known to "
                                          r"model.name=gpt \(the embedded GPT takes n_layer, "):
        load_config(None, ["model.kwargs={hidden: 24, layers: 2}"])
    with pytest.raises(ConfigError, match="model.d_model \\(30\\) is not divisible"):
        load_config(None, ["model.kwargs={d_model: 30}", "model.n_head=4"])
    with pytest.raises(ConfigError, match="model.kwargs.n_layer: expected int, got '2'"):
        load_config(None, ["model.kwargs={n_layer: '2'}"])


# ---- export file modes ----

@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_exported_files_have_the_modes_of_the_umask(good_bytes, tmp_path, umask):
    from elastic_train.export import export

    cfg = load_config(None, [*TINY, f"data.path={good_bytes}", f"run.storage_path={tmp_path}",
                             "run.name=g"])
    _checkpointed_run(cfg, {})
    (tmp_path / "g" / "config.yaml").write_text(cfg.to_yaml())
    old = os.umask(umask)
    try:
        out = export(tmp_path / "g", tmp_path / "exported")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"model.safetensors", "config.yaml"}
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask}
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["name"] == "gpt"
