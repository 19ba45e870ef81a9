"""Bad input through the real command line: one `error:` line naming the culprit, exit 2, and every
file that existed before byte for byte the same after (issue 18).

The table runs `elastic_train.cli.main` in-process (every one of these errors must come before
Ray starts, and `init_ray` is replaced by a tripwire to prove it); a few cases run the installed
console script in a subprocess for its real exit status and stderr. The `ray` test trains on a
local cluster of its own while a second Ray cluster runs on the machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import TINY

from elastic_train.cli import main

BIN = Path(sys.executable).parent


# ---- the data sets and run folders the cases start from ----

def shard(path: Path, ids: list, lengths: list[int] | None = None, id_type=None) -> Path:
    """A Parquet shard with the required columns; token ids are small bytes."""
    lengths = lengths or [4] * len(ids)
    tokens = [[(i % 200) + 1 for i in range(n)] for n in lengths]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"id": pa.array(ids, id_type or pa.int64()),
                             "tokens": pa.array(tokens, pa.list_(pa.int32())),
                             "length": pa.array(lengths, pa.int32())}), path)
    return path


def dataset(root: Path, *shards_ids: list) -> str:
    """A folder of shards, one per list of ids."""
    for k, ids in enumerate(shards_ids):
        shard(root / f"part-{k:05d}.parquet", ids)
    return str(root)


@pytest.fixture(scope="module")
def good_data(tmp_path_factory) -> str:
    """A small prepared data set (bytes): prepare's shards and `_prepare.json`."""
    from elastic_train.data.prepare import prepare

    src = tmp_path_factory.mktemp("src")
    for k in range(3):
        (src / f"doc{k}.txt").write_text("\n\n".join(f"paragraph {k}.{j} " * 8 for j in range(60)))
    out = tmp_path_factory.mktemp("data") / "good"
    prepare([src], out, max_seq_len=128, rows_per_shard=16)  # a row group each, 8 at least
    return str(out)


# A real S3 client against a port nothing listens on: what a store out of reach (no network, a
# firewall) answers, in seconds, without the network
DEAD_STORE = "s3://nobucket/runs?region=us-east-1&endpoint_override=127.0.0.1:1&scheme=http"


def resumable_run(storage: Path, data: str, name: str = "r", config: tuple[str, ...] = tuple(TINY)) -> Path:
    """A run folder whose checkpoint was trained on `data` with the `config` overrides (TINY;
    as check_inputs resolves them), with the `dataset.json` a fit writes; no Ray."""
    import torch

    from elastic_train.config import load_config
    from elastic_train.preflight.checks import IDENTITY_FILE, data_identity
    from elastic_train.preflight.inputs import check_inputs
    from elastic_train.training.checkpoint import snapshot, write_checkpoint
    from elastic_train.training.model import build_model

    cfg = load_config(None, [*config, f"data.path={data}", f"run.storage_path={storage}",
                             f"run.name={name}"])
    info = check_inputs(cfg)
    model = build_model(cfg.model, cfg.data.max_seq_len)
    snap = snapshot(model, torch.optim.AdamW(model.parameters()), None,
                    {"step": 2, "epoch": 0, "step_in_epoch": 2}, cfg.to_dict(), world_size=2)
    run = storage / name
    write_checkpoint(snap, run / "checkpoint_000000002")
    (run / IDENTITY_FILE).write_text(json.dumps(data_identity(cfg, info)))
    (run / "config.yaml").write_text(cfg.to_yaml())
    return run


def report_run(folder: Path, metrics: str, **files: str) -> str:
    """A run folder for `report` with the given metrics.jsonl text and other files."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(metrics)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)
    return str(folder)


GOOD_RECORD = {"step": 1, "epoch": 0, "time": 1000.0, "attempt": 0, "world_size": 2, "loss": 5.0,
               "lr": 1e-3, "real_tokens": 100, "padded_tokens": 120, "step_time_s": 0.5,
               "data_wait_s": 0.01, "tokens_per_s": 200.0, "skipped_steps": 0}


# ---- the table ----

@dataclass
class Case:
    name: str
    build: Callable[[Path, str], list[str]]  # (tmp folder, good data set) -> argv
    culprit: str  # a part of the error line that names what is wrong


def train(*overrides: str) -> Callable[[Path, str], list[str]]:
    """`train` with the TINY config on the good data set in tmp/runs, plus `overrides`."""
    return lambda tmp, data: ["train", *TINY, f"data.path={data}", f"run.storage_path={tmp / 'runs'}",
                              "run.name=t", *overrides]


def train_with(make: Callable[[Path, str], list[str]]) -> Callable[[Path, str], list[str]]:
    """`train` with overrides that `make` derives after setting up files in tmp."""
    return lambda tmp, data: train(*make(tmp, data))(tmp, data)


def config_file(text: bytes) -> Callable[[Path, str], list[str]]:
    def build(tmp: Path, data: str) -> list[str]:
        (tmp / "c.yaml").write_bytes(text)
        return ["train", "--config", str(tmp / "c.yaml"), f"data.path={data}"]
    return build


def with_file(name: str, content: bytes, *overrides: str):
    """Write tmp/name, then train with overrides (`{f}` in them is that file's path)."""
    def make(tmp: Path, data: str) -> list[str]:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        return [o.replace("{f}", str(path)).replace("{tmp}", str(tmp)) for o in overrides]
    return train_with(make)


def data_case(make_data: Callable[[Path, str], str], *overrides: str):
    return train_with(lambda tmp, data: [f"data.path={make_data(tmp, data)}", *overrides])


def truncated(tmp: Path, data: str) -> str:
    root = tmp / "trunc"
    dataset(root, [0, 1, 2], [3, 4, 5])
    blob = (root / "part-00001.parquet").read_bytes()
    (root / "part-00001.parquet").write_bytes(blob[: len(blob) // 2])
    return str(root)


def corrupt_prepare_json(tmp: Path, data: str) -> str:
    root = tmp / "cp"
    dataset(root, [0, 1])
    (root / "_prepare.json").write_text("{not json")
    return str(root)


def string_tokens(tmp: Path, data: str) -> str:
    pq.write_table(pa.table({"id": [0, 1], "tokens": [["a", "b"], ["c"]], "length": [2, 1]}),
                   tmp / "s.parquet")
    return str(tmp / "s.parquet")


def negative_token(tmp: Path, data: str) -> str:
    pq.write_table(pa.table({"id": [0], "tokens": [[4, -2]], "length": [2]}), tmp / "n.parquet")
    return str(tmp / "n.parquet")


def big_token_ids(tmp: Path, data: str) -> str:
    """A data set of its own (no `_prepare.json`) whose largest token id is 50000."""
    tokens = [[1, 50000], *[[7]] * 7]
    pq.write_table(pa.table({"id": list(range(8)), "tokens": pa.array(tokens, pa.list_(pa.int32())),
                             "length": pa.array([len(t) for t in tokens], pa.int32())}),
                   tmp / "big.parquet", row_group_size=1)  # the 8 row groups a run needs
    return str(tmp / "big.parquet")


def with_column(tmp: Path, data: str, name: str, values, shards: int = 1) -> str:
    """The good data set's shards with column `name` added (of `values`, cycled) to the first
    `shards` of them."""
    import shutil

    out = tmp / f"col-{name}"
    shutil.copytree(data, out)
    for k, file in enumerate(sorted(out.glob("*.parquet"))):
        if k < shards:
            table = pq.read_table(file)
            column = pa.array([values[i % len(values)] for i in range(table.num_rows)])
            pq.write_table(table.append_column(name, column), file, row_group_size=8)
    return str(out)


def unfinished_prepare(tmp: Path, data: str) -> str:
    """A prepare killed while it wrote: its marker still there, no `_prepare.json` (written
    last). The same shards without either (copied out of a prepared folder: test_models) are a
    data set of their own."""
    import shutil

    from elastic_train.data.dataset import PENDING_FILE

    shutil.copytree(data, tmp / "half")
    (tmp / "half" / "_prepare.json").unlink()
    (tmp / "half" / PENDING_FILE).write_text("")
    return str(tmp / "half")


def eval_with_another_tokenizer(tmp: Path, data: str) -> list[str]:
    """data.path and eval.path prepared with two BPE tokenizers of one size (400), trained on
    different text: the same size, other ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from elastic_train.data.prepare import prepare

    text = tmp / "text.txt"
    text.write_text("\n\n".join(f"paragraph {j} of some text " * 6 for j in range(40)))
    sets = []
    for name, corpus in (("a", "textwrap.py"), ("b", "shlex.py")):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tokenizer.train([str(Path(os.__file__).parent / corpus)], trainer)
        tokenizer.save(str(tmp / f"{name}.json"))
        prepare([text], tmp / f"set_{name}", max_seq_len=128, rows_per_shard=16,
                tokenizer=tmp / f"{name}.json")
        sets.append(tmp / f"set_{name}")
    return [f"data.path={sets[0]}", f"eval.path={sets[1]}"]


def resume(*overrides: str, before: Callable[[Path], None] | None = None):
    def make(tmp: Path, data: str) -> list[str]:
        run = resumable_run(tmp / "runs", data, "t")
        if before:
            before(run)
        return list(overrides)
    return train_with(make)


def with_own_loss(run: Path) -> None:
    """The run's latest checkpoint as the Python API's train(cfg, loss_fn=my_loss) writes it."""
    path = run / "checkpoint_000000002" / "state.json"
    state = json.loads(path.read_text())
    state["config"]["train"]["loss_fn"] = "driver.my_loss"
    path.write_text(json.dumps(state))


def resume_on_a_copy(tmp: Path, data: str) -> list[str]:
    """A resumable run, resumed on a copy of its data set at another path."""
    import shutil

    resumable_run(tmp / "runs", data, "t")
    shutil.copytree(data, tmp / "copy")
    return [f"data.path={tmp / 'copy'}"]


def empty_folder(tmp: Path, data: str) -> str:
    (tmp / "e").mkdir()
    return str(tmp / "e")


def no_tokens_column(tmp: Path, data: str) -> str:
    pq.write_table(pa.table({"id": [0], "length": [1]}), tmp / "x.parquet")
    return str(tmp / "x.parquet")


def prepare_case(make: Callable[[Path], list[str]]) -> Callable[[Path, str], list[str]]:
    return lambda tmp, data: ["prepare", *make(tmp)]


def files(tmp: Path, **named: bytes) -> list[str]:
    for name, content in named.items():
        (tmp / name.replace("_", ".")).write_bytes(content)
    return [str(tmp / name.replace("_", ".")) for name in named]


def hf_folder(kind: str, tokenizer: bool = False) -> Callable[[Path, str], list[str]]:
    """`model.name=hf` on a model folder of `kind` (llama | bert: a masked-LM BERT), its
    config.json only (no weights, no download), with a word-level tokenizer.json if asked."""
    def make(tmp: Path, data: str) -> list[str]:
        from transformers import BertConfig, LlamaConfig

        sizes = dict(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=128)
        config = (BertConfig(**sizes, architectures=["BertForMaskedLM"]) if kind == "bert"
                  else LlamaConfig(**sizes, num_key_value_heads=1))
        config.save_pretrained(tmp / kind)
        if tokenizer:
            from tokenizers import Tokenizer, models

            words = {w: i for i, w in enumerate(["<unk>", "the", "a", *"bcdefgh"])}
            Tokenizer(models.WordLevel(words, unk_token="<unk>")).save(str(tmp / kind / "tokenizer.json"))
        return ["model.name=hf", f"model.path={tmp / kind}"]
    return train_with(make)


def sample_case(*flags: str) -> Callable[[Path, str], list[str]]:
    """`sample` of a run folder with a checkpoint, with `flags`."""
    return lambda tmp, data: ["sample", str(resumable_run(tmp / "runs", data, "s")), "--prompt", "x",
                              *flags]


def inline_run(tmp: Path, data: str) -> list[str]:
    """`export` of a run that trained the Python API's inline model_fn."""
    run = resumable_run(tmp / "runs", data, "i")
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("inline_fn: null", "inline_fn: driver.make_model"))
    return ["export", str(run), "--output", str(tmp / "out")]


def report_case(make: Callable[[Path], str]) -> Callable[[Path, str], list[str]]:
    return lambda tmp, data: ["report", make(tmp)]


GOOD_LINE = json.dumps(GOOD_RECORD) + "\n"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))
ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256))

CASES = [
    # config values (ranges)
    Case("run.name=..", train("run.name=.."), "run.name"),
    Case("run.name=.", train("run.name=."), "run.name"),
    Case("run.name with a slash", train("run.name=a/b"), "run.name"),
    Case("run.name empty", train("run.name=''"), "run.name"),
    Case("optim.lr=inf", train("optim.lr=inf"), "optim.lr"),
    Case("optim.lr=nan", train("optim.lr=.nan"), "optim.lr"),
    Case("optim.lr=0", train("optim.lr=0"), "optim.lr"),
    Case("optim.beta1=2", train("optim.beta1=2"), "optim.beta1"),
    Case("optim.beta2<0", train("optim.beta2=-0.1"), "optim.beta2"),
    Case("optim.weight_decay<0", train("optim.weight_decay=-1"), "optim.weight_decay"),
    Case("optim.min_lr_ratio=2", train("optim.min_lr_ratio=2"), "optim.min_lr_ratio"),
    Case("optim.warmup_steps<0", train("optim.warmup_steps=-1"), "optim.warmup_steps"),
    Case("optim.name=sgd", train("optim.name=sgd"), "optim.name"),
    Case("model.n_layer=0", train("model.n_layer=0"), "model.n_layer"),
    Case("model.n_head=0", train("model.n_head=0"), "model.n_head"),
    Case("model.d_model=0", train("model.d_model=0"), "model.d_model"),
    Case("model.d_model not divisible", train("model.d_model=33"), "model.d_model"),
    Case("model.dropout=1", train("model.dropout=1"), "model.dropout"),
    Case("model.vocab_size=0", train("model.vocab_size=0"), "model.vocab_size"),
    Case("scaling.torch_threads=0", train("scaling.torch_threads=0"), "scaling.torch_threads"),
    Case("scaling.min_workers=0", train("scaling.min_workers=0"), "scaling.min_workers"),
    Case("scaling.min>max", train("scaling.max_workers=1"), "scaling.min_workers"),
    Case("scaling.cpus_per_worker=0", train("scaling.cpus_per_worker=0"), "scaling.cpus_per_worker"),
    Case("scaling.max_failures=-2", train("scaling.max_failures=-2"), "scaling.max_failures"),
    Case("scaling.health_check_interval_s=0", train("scaling.health_check_interval_s=0"),
         "scaling.health_check_interval_s"),
    Case("scaling.worker_group_start_timeout_s<0", train("scaling.worker_group_start_timeout_s=-1"),
         "scaling.worker_group_start_timeout_s"),
    Case("scaling.resources_per_worker<0", train("scaling.resources_per_worker={slot: -1}"),
         "scaling.resources_per_worker.slot"),
    Case("scaling.resources_per_worker GPU", train("scaling.resources_per_worker={GPU: 1}"),
         "scaling.resources_per_worker.GPU"),
    Case("scaling.use_gpu without a GPU", train("scaling.use_gpu=true"), "scaling.use_gpu"),
    Case("checkpoint.every_steps<0", train("checkpoint.every_steps=-5"), "checkpoint.every_steps"),
    Case("checkpoint.keep=0", train("checkpoint.keep=0"), "checkpoint.keep"),
    Case("train.max_steps=0", train("train.max_steps=0"), "train.max_steps"),
    Case("train.epochs=0", train("train.epochs=0"), "train.epochs"),
    Case("train.grad_clip<0", train("train.grad_clip=-1"), "train.grad_clip"),
    Case("train.seed<0", train("train.seed=-1"), "train.seed"),
    Case("train.precision=fp16 on CPU", train("train.precision=fp16"), "train.precision=fp16"),
    Case("train.max_steps=abc", train("train.max_steps=abc"), "train.max_steps"),
    Case("train.grad_reduce unknown", train("train.grad_reduce=fast"), "train.grad_reduce"),
    Case("train.grad_compression unknown", train("train.grad_compression=zip"),
         "train.grad_compression"),
    Case("compression with grad_reduce=exact", train("train.grad_compression=fp16",
                                                     "train.grad_reduce=exact"),
         "train.grad_compression=fp16 needs train.grad_reduce=ddp"),
    Case("compression with deterministic", train("train.grad_compression=bf16",
                                                 "train.deterministic=true"),
         "(auto: train.deterministic=true)"),
    Case("train.powersgd_rank=0", train("train.powersgd_rank=0"), "train.powersgd_rank"),
    Case("train.powersgd_warmup_steps=1", train("train.powersgd_warmup_steps=1"),
         "train.powersgd_warmup_steps"),
    Case("train.ddp_bucket_mb=0", train("train.ddp_bucket_mb=0"), "train.ddp_bucket_mb"),
    # refused on the driver's meta model, naming the missing one and the model's own classes
    Case("model.shard_modules names no module", train(
        "train.sharding=fsdp", "model.shard_modules=[Block, Blok]"),
        "model.shard_modules: no module of class Blok in GPT (its classes: Block, "),
    Case("data.seed<0", train("data.seed=-1"), "data.seed"),
    Case("data.max_seq_len=1", train("data.max_seq_len=1"), "data.max_seq_len"),
    Case("data.micro_batch_tokens<max_seq_len", train("data.micro_batch_tokens=100"),
         "data.micro_batch_tokens"),
    Case("data.global_batch_tokens not a multiple", train("data.global_batch_tokens=5000"),
         "data.global_batch_tokens"),
    Case("data.shuffle_window=0", train("data.shuffle_window=0"), "data.shuffle_window"),
    Case("data.prefetch_steps=0", train("data.prefetch_steps=0"), "data.prefetch_steps"),
    Case("data.pad_id<0", train("data.pad_id=-1"), "data.pad_id"),
    Case("data.reader unknown", train("data.reader=arrow"), "data.reader"),
    Case("data.on_change unknown", train("data.on_change=maybe"), "data.on_change"),
    Case("fault.crash_rank beyond the workers", train("fault.crash_rank=7"), "fault.crash_rank"),
    Case("fault.crash_at_step=0", train("fault.crash_at_step=0"), "fault.crash_at_step"),
    Case("log.print_every_steps=0", train("log.print_every_steps=0"), "log.print_every_steps"),
    Case("log.progress unknown", train("log.progress=fancy"), "log.progress"),
    Case("log.peak_flops=0", train("log.peak_flops=0"), "log.peak_flops"),
    Case("run.num_cpus=0", train("run.num_cpus=0"), "run.num_cpus"),
    Case("unknown key", train("optim.lrr=1"), "optim.lrr"),
    Case("flow mapping without a space", train("scaling.resources_per_worker={tcp_gpu:1}"),
         "a flow mapping needs a space after the colon, {tcp_gpu: 1}"),
    Case("eval.path beside the embedded eval.fraction", train("eval.path=/x", "eval.fraction=0.03"),
         "add eval.fraction=0 to evaluate on eval.path alone"),
    Case("override without =", train("optim.lr"), "optim.lr"),
    # storage
    Case("storage under a file", with_file("afile", b"x", "run.storage_path={f}/runs"),
         "run.storage_path"),
    Case("storage is a file", with_file("afile", b"x", "run.storage_path={f}"), "run.storage_path"),
    Case("storage URI scheme unknown", train("run.storage_path=bogus://bucket/runs"),
         "run.storage_path"),
    Case("storage on a store that does not answer", train(f"run.storage_path={DEAD_STORE}"),
         "run.storage_path: cannot write to 's3://nobucket/runs?"),
    Case("run folder is a file", with_file("runs/t", b"x"), "run.name"),
    # config files
    Case("config not UTF-8", config_file(b"run:\n  name: \xff\xfe\n"), "c.yaml"),
    Case("config not YAML", config_file(b"run: [\n"), "c.yaml"),
    Case("config top level a list", config_file(b"- 1\n- 2\n"), "c.yaml"),
    Case("config unknown section", config_file(b"runn:\n  name: x\n"), "runn"),
    Case("config missing", lambda tmp, data: ["train", "--config", str(tmp / "nope.yaml")], "nope.yaml"),
    Case("config is a folder", lambda tmp, data: ["train", "--config", str(tmp)], "is a folder"),
    # data
    Case("data.path missing", train_with(lambda tmp, d: [f"data.path={tmp / 'nope'}"]), "nope"),
    Case("data.path holds no shards", data_case(empty_folder), "contains no .parquet files"),
    Case("truncated shard", data_case(truncated), "part-00001.parquet"),
    Case("shard without tokens", data_case(no_tokens_column), "tokens"),
    Case("tokens that are strings", data_case(string_tokens),
         "s.parquet': column 'tokens' must be a list of integer token ids, not list<element: string>"),
    Case("negative token id", data_case(negative_token), "n.parquet': column 'tokens' holds the "
         "negative token id -2"),
    Case("an extra column named as a batch key", data_case(
        lambda tmp, data: with_column(tmp, data, "labels", [0, 1], shards=99)),
         "column 'labels' has the name of a key every batch has"),
    Case("an extra column a later shard lacks", data_case(
        lambda tmp, data: with_column(tmp, data, "label", [0, 1])),
         "part-00001.parquet' has no column 'label', which"),
    Case("an extra column with nulls", data_case(
        lambda tmp, data: with_column(tmp, data, "label", [0, None, 1], shards=99)),
         "row group 0: column 'label' holds 3 null value(s)"),
    Case("token ids beyond the model's vocabulary, no _prepare.json",
         data_case(big_token_ids, "model.vocab_size=256"),
         "embedding has 256 rows but data set"),
    Case("unfinished prepare output", data_case(unfinished_prepare),
         "is an unfinished prepare output: it still holds _prepare.pending"),
    Case("eval.path is the training set", train_with(lambda tmp, d: [f"eval.path={d}"]),
         "of the training set data.path"),
    Case("eval.path tokenized with another tokenizer of the same size",
         train_with(eval_with_another_tokenizer), "was tokenized with another tokenizer (vocabulary"),
    Case("ids repeated across shards", data_case(lambda tmp, d: dataset(tmp / "rep", [0, 1, 2], [2, 3])),
         "sample id 2 appears more than once"),
    Case("negative id", data_case(lambda tmp, d: dataset(tmp / "neg", [0, 1], [2, -3])),
         "sample id -3 is negative"),
    Case("null id", data_case(lambda tmp, d: dataset(tmp / "null", [0, None, 2])),
         "row 1: sample id is null"),
    Case("float ids", data_case(lambda tmp, d: str(shard(tmp / "f" / "p.parquet", [0.0, 1.0],
                                                         id_type=pa.float64()))), "column 'id'"),
    Case("vocabulary smaller than the data's token ids", train("model.vocab_size=100"), "model"),
    Case("corrupt _prepare.json", data_case(corrupt_prepare_json), "_prepare.json"),
    Case("rows longer than data.max_seq_len", train("data.max_seq_len=64", "data.micro_batch_tokens=512",
                                                    "data.global_batch_tokens=2048"), "data.max_seq_len"),
    Case("model import path missing", train("model.name=no_such_module:build"), "no_such_module"),
    Case("hf without model.path", train("model.name=hf"), "model.path"),
    Case("the GPT's dropout for an hf model", train("model.name=hf", "model.path=/m", "model.dropout=0.1"),
         "model.dropout=0.1 with model.name=hf: it is the embedded GPT's"),
    Case("the GPT's dropout for a model of one's own",
         train("model.name=user_models.tiny_gru:build", "model.dropout=0.1"),
         "pass it to your model as model.kwargs.dropout"),
    Case("hf model that is a BERT", hf_folder("bert"),
         "is a bert model (BertForMaskedLM), not a causal language model"),
    Case("hf model with another tokenizer than the data's", hf_folder("llama", tokenizer=True),
         "the data set holds UTF-8 bytes (prepared without --tokenizer)"),
    Case("gpt kwargs it does not take", train("model.kwargs={hidden: 24}"),
         "model.kwargs: hidden not known to model.name=gpt"),
    Case("config of an inline model on the command line", train("model.inline_fn=driver.make_model"),
         "model.inline_fn"),
    Case("config of a run with a loss of its own on the command line",
         train("train.loss_fn=driver.my_loss"),
         "train.loss_fn: this config is that of a run with a loss of its own (driver.my_loss)"),
    # resume
    Case("corrupt checkpoint state.json", resume(before=lambda run: (
        run / "checkpoint_000000002" / "state.json").write_text('{"cut')), "state.json"),
    Case("resume with another data.seed", resume("data.seed=5"), "data.seed"),
    Case("resume with another data.path", train_with(resume_on_a_copy), "data.path"),
    Case("resume with another batch budget", resume("data.global_batch_tokens=2048"), "partition count"),
    # the same partitions, cut otherwise: the first window's positions would still check out
    Case("resume with other micro-batches", resume("data.micro_batch_tokens=2048",
                                                   "data.global_batch_tokens=8192"),
         "(step 2) holds a data position in the data as cut into steps then, and "
         "data.micro_batch_tokens was 1024, now 2048: cut otherwise, the rest of the epoch would "
         "train some samples twice and others never. Set it back to resume"),
    Case("resume with another shuffle window", resume("data.shuffle_window=4096"),
         "data.shuffle_window was 1024, now 4096"),
    Case("resume without bucketing", resume("data.bucketing=false"), "data.bucketing was True, now False"),
    Case("resume with other shards", resume(before=lambda run: (run / "dataset.json").write_text(
        json.dumps({**json.loads((run / "dataset.json").read_text()),
                    "shards": [["part-00000.parquet", 1]]}))), "shards changed"),
    Case("resume another model", resume("model.d_model=64"), "does not fit the configured model"),
    Case("resume of a run with a loss of its own, without it", resume(before=with_own_loss),
         "train.loss_fn: run t's latest checkpoint checkpoint_000000002 was trained with a loss "
         "of its own (driver.my_loss), and this resume would go on with the default loss"),
    Case("resume with another optimizer", resume("optim.name=adamw8bit"),
         "optim.name: run t's latest checkpoint checkpoint_000000002 holds the state of adamw "
         "(its moments), which adamw8bit cannot take: resume with optim.name=adamw"),
    # prepare
    Case("prepare empty input", prepare_case(lambda tmp: ["", "--output", str(tmp / "out")]), "input ''"),
    Case("prepare empty output", prepare_case(lambda tmp: [*files(tmp, a_txt=b"hello"), "--output", ""]),
         "--output"),
    Case("prepare only binary files", prepare_case(lambda tmp: [
        *files(tmp, lib_so=ELF, image_png=PNG), "--output", str(tmp / "out")]), "no input text found"),
    Case("prepare whitespace-only file", prepare_case(lambda tmp: [
        *files(tmp, blank_txt=b"  \n\n\t \n"), "--output", str(tmp / "out")]), "no input text found"),
    Case("prepare missing input", prepare_case(lambda tmp: [str(tmp / "nope"), "--output", str(tmp / "o")]),
         "nope"),
    Case("prepare negative seed", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello"), "--seed", "-1", "--output", str(tmp / "out")]), "--seed"),
    Case("prepare max-seq-len 0", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello"), "--max-seq-len", "0", "--output", str(tmp / "out")]),
         "--max-seq-len must be at least 1, got 0"),
    Case("prepare rows-per-block 0", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello"), "--rows-per-block", "0", "--output", str(tmp / "out")]),
         "--rows-per-block must be at least 1, got 0"),
    Case("prepare eval-fraction 0.6", prepare_case(lambda tmp: [  # eval.fraction's bound
        *files(tmp, a_txt=b"hello"), "--eval-fraction", "0.6", "--output", str(tmp / "out")]),
         "--eval-fraction must be in [0, 0.5), got 0.6"),
    Case("prepare output is a file", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello", out_bin=b"x"), "--output", str(tmp / "out.bin")]), "out.bin"),
    Case("prepare output under a file", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello", f_bin=b"x"), "--output", str(tmp / "f.bin" / "out")]), "f.bin"),
    Case("prepare output holds shards", prepare_case(lambda tmp: [
        *files(tmp, a_txt=b"hello"), "--output", str(shard(tmp / "o" / "p.parquet", [0]).parent)]),
         "already contains Parquet files"),
    Case("prepare jsonl not json", prepare_case(lambda tmp: [
        *files(tmp, a_jsonl=b'{"text": oops}\n'), "--output", str(tmp / "out")]), "a.jsonl"),
    Case("prepare null prompt", prepare_case(lambda tmp: [
        *files(tmp, a_jsonl=b'{"prompt": "Q", "response": "A"}\n{"prompt": null, "response": "B"}\n'),
        "--output", str(tmp / "out"), "--engine", "local"]), "line 2: field 'prompt' is null"),
    Case("prepare every example dropped", prepare_case(lambda tmp: [
        *files(tmp, a_jsonl=b'{"prompt": "Q", "response": ""}\n'), "--output", str(tmp / "out"),
        "--engine", "local"]), "every one of the 1 fine-tuning example(s) was dropped"),
    # compile's keys, checked on the meta model and the driver's file system
    Case("compile_modules no such class", train("train.compile=true",
                                                "train.compile_modules=[NoSuchBlock]"),
         "train.compile_modules: no module of class NoSuchBlock"),
    Case("compile_cache_dir is a file", with_file("cache", b"x", "train.compile=true",
                                                  "train.compile_cache_dir={f}"),
         "train.compile_cache_dir"),
    Case("compile_cache_dir under a file", with_file("cache", b"x", "train.compile=true",
                                                     "train.compile_cache_dir={f}/sub"),
         "train.compile_cache_dir"),
    # tracking targets that cannot work (the W&B and sqlite cases: tests of their own)
    Case("log.mlflow store under a file", with_file("f", b"x", "log.mlflow={f}/mlruns"),
         "log.mlflow: the file store"),
    Case("log.mlflow file: URI under a file", with_file("f", b"x", "log.mlflow=file://{f}/mlruns"),
         "log.mlflow: the file store"),
    # export and sample
    Case("export of an inline model's run", inline_run, "trained an inline model (driver.make_model"),
    Case("sample --max-new-tokens -1", sample_case("--max-new-tokens", "-1"), "--max-new-tokens"),
    Case("sample --max-new-tokens 0", sample_case("--max-new-tokens", "0"), "--max-new-tokens"),
    Case("sample --temperature -1", sample_case("--temperature", "-1"), "--temperature"),
    Case("sample --temperature nan", sample_case("--temperature", "nan"), "--temperature"),
    Case("sample --seed -1", sample_case("--seed", "-1"), "--seed"),
    # report
    Case("report missing folder", report_case(lambda tmp: str(tmp / "nope")), "nope"),
    Case("report of a store that does not answer", report_case(lambda tmp: DEAD_STORE),
         "run folder 's3://nobucket/runs?region=us-east-1&endpoint_override=127.0.0.1:1&scheme=http' "
         "cannot be read: When getting information for key 'runs'"),
    Case("report folder is a file", report_case(lambda tmp: files(tmp, f_txt=b"x")[0]), "f.txt"),
    Case("report empty metrics", report_case(lambda tmp: report_run(tmp / "r", "")), "metrics.jsonl"),
    Case("report only corrupt lines", report_case(lambda tmp: report_run(
        tmp / "r", '{"step": 1, "lo\n[1, 2]\n{"step": "x"}\n')), "3 corrupt or foreign lines"),
    Case("report corrupt attempts.json", report_case(lambda tmp: report_run(
        tmp / "r", GOOD_LINE, attempts_json="[{")), "attempts.json"),
    Case("report foreign attempts.json", report_case(lambda tmp: report_run(
        tmp / "r", GOOD_LINE, attempts_json='{"a": 1}')), "attempts.json"),
    Case("report corrupt summary.json", report_case(lambda tmp: report_run(
        tmp / "r", GOOD_LINE, summary_json="{\"status\": ")), "summary.json"),
]


def snapshot_files(*roots: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for root in roots for p in sorted(Path(root).rglob("*"))
            if p.is_file()}


@pytest.fixture
def no_ray(monkeypatch):
    """A tripwire: any case that gets as far as starting Ray fails loudly."""
    import elastic_train.api

    def tripwire(cfg):
        raise AssertionError("the input was accepted: Ray would start now")

    monkeypatch.setattr(elastic_train.api, "init_ray", tripwire)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


@pytest.mark.unit
def test_the_table_is_large():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_error_line_and_no_file_changes(case: Case, tmp_path, good_data, capsys,
                                                         no_ray):
    argv = case.build(tmp_path, good_data)
    before = snapshot_files(tmp_path, Path(good_data))
    code = main(argv)
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert code == 2, captured.err
    assert len(errors) == 1 and "Traceback" not in captured.err, captured.err
    assert case.culprit in errors[0], errors[0]
    assert snapshot_files(tmp_path, Path(good_data)) == before


# ---- the two harmful cases of the issue, each a test of its own ----

@pytest.mark.unit
def test_run_name_dotdot_leaves_the_users_files_alone(tmp_path, good_data, capsys, no_ray):
    """`run.name=..` once wrote the run into the parent of run.storage_path, renaming the user's
    config.yaml there; now it is refused before anything is written."""
    home = tmp_path / "project"
    (home / "runs").mkdir(parents=True)
    (home / "config.yaml").write_text("my: own config\n")
    before = snapshot_files(tmp_path)
    for name in ("..", "."):
        code = main(["train", *TINY, f"data.path={good_data}", f"run.storage_path={home / 'runs'}",
                     f"run.name={name}"])
        assert code == 2 and "run.name must be a plain folder name" in capsys.readouterr().err
    assert snapshot_files(tmp_path) == before
    assert sorted(p.name for p in home.iterdir()) == ["config.yaml", "runs"]


@pytest.mark.unit
def test_repeated_or_negative_ids_are_refused_before_training(tmp_path, capsys, no_ray):
    """Shards that repeat ids once trained to "finished" with samples trained twice; the ids are
    checked before Ray starts, naming the id and where it is."""
    repeated = dataset(tmp_path / "rep", list(range(0, 50)), list(range(40, 82)))
    negative = dataset(tmp_path / "neg", [0, 1, 2], [3, -4, 5])
    runs = tmp_path / "runs"
    code = main(["train", *TINY, f"data.path={repeated}", f"run.storage_path={runs}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "sample id 40 appears more than once" in err
    assert "part-00000.parquet' row 40" in err and "part-00001.parquet' row 0" in err
    code = main(["train", *TINY, f"data.path={negative}", f"run.storage_path={runs}"])
    err = capsys.readouterr().err
    assert code == 2 and "part-00001.parquet' row 1: sample id -4 is negative" in err, err
    assert not runs.exists()


@pytest.mark.unit
def test_prepare_skips_binary_files_with_a_count(tmp_path, capsys, caplog):
    """Binary files, named directly or found in a folder with a text suffix, are skipped with one
    warning that counts them; whitespace-only files give no rows."""
    from elastic_train.data.dataset import inspect_dataset

    (tmp_path / "in").mkdir()
    inputs = files(tmp_path / "in", a_txt=b"some text\n\nmore text\n", lib_so=ELF, image_png=PNG,
                   blank_txt=b" \n \n")
    (tmp_path / "in" / "sub").mkdir()
    (tmp_path / "in" / "sub" / "fake.txt").write_bytes(PNG)
    code = main(["prepare", *inputs, str(tmp_path / "in" / "sub"), "--output", str(tmp_path / "out"),
                 "--eval-fraction", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    stats = json.loads(captured.out)
    assert stats["skipped_binary_files"] == 3 and stats["source_files"] == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("skipped 3 binary file(s)"), warnings
    assert inspect_dataset(str(tmp_path / "out")).rows == 2


@pytest.mark.unit
def test_report_skips_corrupt_and_foreign_lines_with_a_count(tmp_path, capsys):
    folder = report_run(tmp_path / "r", GOOD_LINE + '{"step": 2, "lo\n' + '["x"]\n'
                        + json.dumps({**GOOD_RECORD, "step": 2, "time": 1001.0}) + "\n",
                        events_jsonl='{"time": 999.0, "event": "fit_start"}\nnot json\n')
    assert main(["report", folder]) == 0
    out = capsys.readouterr().out.replace("\n", "")  # rich wraps long lines
    assert f"skipped 2 corrupt or foreign line(s) of {folder}/metrics.jsonl" in out
    assert f"skipped 1 corrupt or foreign line(s) of {folder}/events.jsonl" in out


@pytest.mark.unit
def test_resume_on_other_data_with_keep_position_is_allowed(tmp_path, good_data, caplog):
    """data.on_change=keep_position: the user means it; the checks pass with a warning."""
    from elastic_train.config import load_config
    from elastic_train.preflight.inputs import check_inputs

    resumable_run(tmp_path / "runs", good_data, "t")
    cfg = load_config(None, [*TINY, f"data.path={good_data}", f"run.storage_path={tmp_path / 'runs'}",
                             "run.name=t", "data.seed=3", "data.on_change=keep_position"])
    check_inputs(cfg)
    assert any("data.seed was 0, now 3" in r.getMessage() for r in caplog.records)
    cfg.data.on_change = "refuse"
    from elastic_train.config import ConfigError

    with pytest.raises(ConfigError, match="data.seed was 0, now 3"):
        check_inputs(cfg)


@pytest.mark.unit
def test_sample_ids_in_shuffled_order_are_checked_by_sorting(tmp_path):
    """Ids that are unique but not in increasing ranges take the sorting pass, and pass."""
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.preflight.checks import check_sample_ids

    ids = np.random.default_rng(0).permutation(1000).tolist()
    check_sample_ids(inspect_dataset(dataset(tmp_path / "ok", ids[:600], ids[600:])))
    with pytest.raises(ValueError, match=f"sample id {ids[5]} appears more than once"):
        check_sample_ids(inspect_dataset(dataset(tmp_path / "bad", ids[:600], ids[600:] + [ids[5]])))


@pytest.mark.unit
def test_unreachable_storage_uri_times_out_with_one_line(monkeypatch):
    """A bucket that never answers: the probe gives up after its timeout, naming the key."""
    import threading

    from elastic_train.config import ConfigError, load_config
    from elastic_train.preflight import checks

    release = threading.Event()
    monkeypatch.setattr(checks, "_probe_uri", lambda uri: release.wait(30))
    cfg = load_config(None, ["run.storage_path=s3://bucket/runs"])
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"run.storage_path: 's3://bucket/runs' did not answer"):
        checks.check_storage(cfg, timeout_s=0.5)
    release.set()
    assert time.monotonic() - started < 5


# ---- the installed console script, in a subprocess ----

def _console(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([str(BIN / "elastic-train"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


@pytest.mark.parametrize("case", ["run.name=..", "ids repeated across shards", "prepare empty input",
                                  "report only corrupt lines"])
@pytest.mark.unit
def test_console_script_exit_status_and_stderr(case, tmp_path, good_data):
    chosen = next(c for c in CASES if c.name == case)
    argv = chosen.build(tmp_path, good_data)
    before = snapshot_files(tmp_path, Path(good_data))
    proc = _console(*argv, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and chosen.culprit in lines[0], proc.stderr
    assert snapshot_files(tmp_path, Path(good_data)) == before


# ---- a second Ray cluster on the machine (ray) ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _end_session(proc: subprocess.Popen) -> None:
    """End `ray start --block` and every process of the session it leads (its node's processes)."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == proc.pid:
            try:
                os.kill(int(stat.parent.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


@pytest.fixture
def other_cluster(tmp_path_factory):
    """A second Ray cluster on this machine, started by `ray start` (the latest one it records)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "token"
    port = _free_port()
    log = open(tmp_path_factory.mktemp("other") / "ray_start.log", "w")
    subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], env=env, capture_output=True,
                   timeout=60)
    proc = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--node-ip-address=127.0.0.1", "--num-cpus=1", "--include-dashboard=false"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run([str(BIN / "ray"), "status", "--address", f"127.0.0.1:{port}"], env=env,
                             capture_output=True, timeout=60).returncode != 0:
            assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()[-3000:]
            time.sleep(1)
        yield f"127.0.0.1:{port}"
    finally:
        _end_session(proc)
        log.close()


# a run that starts its own cluster beside this one: tests/test_runend.py's crash run


@pytest.mark.unit
def test_wandb_online_without_a_key_is_refused_before_ray(tmp_path, good_data, capsys, no_ray,
                                                          monkeypatch):
    """log.wandb with W&B online and no key anywhere: one error naming log.wandb and the ways
    out, nothing written; offline mode, or a key in ~/.netrc, is accepted (the tripwire)."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "netrc").write_text("")
    (tmp_path / "netrc").chmod(0o600)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    argv = train("log.wandb=proj")(tmp_path, good_data)
    before = snapshot_files(tmp_path, Path(good_data))
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "log.wandb=proj" in errors[0] and "WANDB_MODE=offline" in errors[0]
    assert snapshot_files(tmp_path, Path(good_data)) == before
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k" + "0" * 39 + "\n")
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(argv)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(argv)


@pytest.mark.unit
def test_an_sql_mlflow_store_needs_the_full_mlflow(monkeypatch, tmp_path):
    """sqlite:// (or another SQL store) without SQLAlchemy/Alembic, as with mlflow-skinny alone:
    refused naming log.mlflow and the package; with them, accepted; a sqlite file under a plain
    file refused."""
    import importlib.util

    from elastic_train.config import ConfigError
    from elastic_train.preflight import tracking

    real = importlib.util.find_spec
    have: set[str] = set()
    monkeypatch.setattr(tracking.importlib.util, "find_spec",
                        lambda name: real("json") if name in have else None)
    with pytest.raises(ConfigError, match="log.mlflow: a sqlite store needs the full mlflow"):
        tracking.check_mlflow(f"sqlite:///{tmp_path}/m.db")
    have.update({"sqlalchemy", "alembic"})
    tracking.check_mlflow(f"sqlite:///{tmp_path}/m.db")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="log.mlflow: the sqlite database"):
        tracking.check_mlflow(f"sqlite:///{tmp_path}/f/m.db")


@pytest.mark.unit
def test_a_resume_that_moves_the_lr_schedule_says_from_what_to_what(tmp_path, good_data, caplog,
                                                                    no_ray):
    """The cosine ends at the run's last step (optim.schedule_steps resolved by check_inputs:
    train.epochs here, before train.max_steps). A run at step 2 resumed with a train.max_steps
    that ends it sooner: one warning, before Ray, with the LR the resume step had and the one it
    gets now; a train.max_steps still past the epoch's end moves nothing but the warmup's
    change; the same config says nothing."""
    import logging

    from elastic_train.config import load_config
    from elastic_train.preflight.inputs import check_inputs
    from elastic_train.training.optim import lr_at

    run = resumable_run(tmp_path / "runs", good_data, "t")
    saved = load_config(str(run / "config.yaml"), [])
    epoch_end = saved.optim.schedule_steps
    assert 4 < epoch_end < saved.train.max_steps  # one epoch ends the run: its cosine too
    caplog.set_level(logging.WARNING)
    shorter = epoch_end - 2
    argv = train(f"train.max_steps={shorter}", "optim.warmup_steps=1")(tmp_path, good_data)
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(argv)
    notes = [r.getMessage() for r in caplog.records if "learning rate goes from" in r.getMessage()]
    now = load_config(None, [*TINY, f"data.path={good_data}", f"run.storage_path={tmp_path / 'r2'}",
                             f"train.max_steps={shorter}", "optim.warmup_steps=1"])
    check_inputs(now)
    assert now.optim.schedule_steps == shorter
    before, after = lr_at(2, saved.optim, 0), lr_at(2, now.optim, 0)
    assert before != after
    assert notes == [f"run t: resuming at step 2, the learning rate goes from {before:.3g} to "
                     f"{after:.3g} (the schedule's end moves from step {epoch_end} to {shorter} "
                     f"(train.max_steps {saved.train.max_steps} -> {shorter}); "
                     f"optim.schedule_steps={epoch_end} keeps the checkpoint's; the schedule "
                     "follows the current config)"]
    caplog.clear()
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(train(f"train.max_steps={saved.train.max_steps * 2}")(tmp_path, good_data))
    assert not [r for r in caplog.records if "learning rate goes from" in r.getMessage()]
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(train()(tmp_path, good_data))
    assert not [r for r in caplog.records if "learning rate goes from" in r.getMessage()]


@pytest.mark.unit
def test_a_resume_keeps_the_batch_sizes_its_run_derived(tmp_path, held_out_dataset):
    """Batch sizes left to the data are derived from it and from scaling.max_workers (and the
    device): a resume keeps those its checkpoint's data position was cut by. With
    max_workers=10 a new run derives 10 micro-batches a step, but the resume keeps 8 and says
    that they cap it at 8 workers (it was refused as "trained on other data"); at 8 it resumes.
    eval.fraction on a data set prepared with held-out documents changes nothing trained on:
    a resume without evaluation is no other data."""
    from elastic_train.config import ConfigError, load_config
    from elastic_train.preflight.inputs import check_inputs

    derived = tuple(o for o in TINY if not o.startswith(("data.micro_batch_tokens",
                                                         "data.global_batch_tokens")))
    first = (*derived, "eval.fraction=0.1")
    run = resumable_run(tmp_path / "runs", held_out_dataset, "r", config=first)
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert saved["global_batch_tokens"] // saved["micro_batch_tokens"] == 8
    common = [*first, f"data.path={held_out_dataset}", f"run.storage_path={tmp_path / 'runs'}"]
    fresh = load_config(None, [*common, "run.name=fresh", "scaling.max_workers=10"])
    check_inputs(fresh)  # a new run derives its own
    assert fresh.data.global_batch_tokens // fresh.data.micro_batch_tokens == 10
    with pytest.raises(ConfigError, match=r"^scaling\.max_workers: run r cuts each step into 8 "
                       r"micro-batches \(data\.global_batch_tokens 2048 / data\.micro_batch_tokens "
                       r"256, as its checkpoint checkpoint_000000002 has them\), so it trains on "
                       r"at most 8 workers, not 10: resume with scaling\.max_workers=8 or fewer"):
        check_inputs(load_config(None, [*common, "run.name=r", "scaling.max_workers=10"]))
    resumed = load_config(None, [*common, "run.name=r", "scaling.max_workers=8", "eval.fraction=0"])
    check_inputs(resumed)
    assert (resumed.data.micro_batch_tokens, resumed.data.global_batch_tokens) == (
        saved["micro_batch_tokens"], saved["global_batch_tokens"])
    # on GPU workers with the step set: the micro-batch is still left to the data, so the resume
    # on fewer workers keeps the checkpoint's (it was derived from max_workers as the config
    # loaded, looked set, and the resume was refused naming data.micro_batch_tokens)
    from elastic_train.preflight.resume import keep_batch_sizes

    gpu = load_config(None, [*common, "run.name=r", "scaling.use_gpu=true", "scaling.min_workers=1",
                             "scaling.max_workers=1",
                             f"data.global_batch_tokens={saved['global_batch_tokens']}"])
    keep_batch_sizes(gpu)
    assert gpu.data.micro_batch_tokens == saved["micro_batch_tokens"]


@pytest.mark.unit
def test_a_data_set_of_its_own_sizes_the_vocabulary_from_its_token_statistics(tmp_path):
    """No `_prepare.json`: the largest token id comes from the Parquet statistics of `tokens`
    (the model was 256 wide and the first batch failed on a worker); below 256 it stays 256."""
    from elastic_train.config import load_config
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.preflight.inputs import fill_from_dataset

    big = big_token_ids(tmp_path, "")
    assert inspect_dataset(big).max_token_id == 50000
    for path, vocab in ((big, 50001), (dataset(tmp_path / "small", list(range(8))), 256)):
        cfg = load_config(None, [*TINY, f"data.path={path}"])
        fill_from_dataset(cfg, inspect_dataset(path))
        assert cfg.model.vocab_size == vocab


@pytest.mark.unit
def test_a_relative_storage_path_in_a_ray_job_is_refused(monkeypatch, tmp_path, good_data, capsys):
    """A Ray job's driver runs in a copy of --working-dir that Ray deletes with the session: a
    relative run.storage_path (the embedded default ./runs) would put the run folder there, lost
    with it. Refused naming the key; the same command outside a job, or with an absolute path,
    passes this check."""
    from elastic_train.config import load_config
    from elastic_train.preflight.resolve import RAY_JOB_ENV, resolve_paths

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(RAY_JOB_ENV, "{}")
    argv = ["train", *TINY, f"data.path={good_data}", "run.storage_path=runs"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run.storage_path: 'runs' is relative, and this driver runs as "
                          "a Ray job") and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()
    resolve_paths(load_config(None, [f"run.storage_path={tmp_path / 'runs'}"]))
    resolve_paths(load_config(None, ["run.storage_path=~/runs"]))
    monkeypatch.delenv(RAY_JOB_ENV)
    resolve_paths(load_config(None, ["run.storage_path=runs"]))


@pytest.mark.unit
def test_a_resume_on_another_evaluation_set_says_the_best_was_measured_on_the_other():
    """eval.max_batches (or eval.path, eval.fraction) other than the checkpoint's, with a best
    so far: one line naming the change and the best; the same set, or no best yet, nothing."""
    from elastic_train.config import load_config
    from elastic_train.preflight.resume import eval_change_note

    cfg = load_config(None, [*TINY, "run.name=r", "eval.max_batches=4"])
    saved = load_config(None, [*TINY, "eval.max_batches=1"]).to_dict()
    state = {"config": saved, "train_state": {"step": 30, "best_eval_loss": 2.5, "best_step": 20}}
    assert eval_change_note(cfg, state) == (
        "run r: resuming with another evaluation set (eval.max_batches 1 -> 4): the best so far "
        "(eval loss 2.5 at step 20) was measured on the other one, and the best checkpoint and "
        "summary.json's best_* compare losses of both; to compare like with like, resume with "
        "the checkpoint's eval settings")
    same = load_config(None, [*TINY, "run.name=r", "eval.max_batches=1"])
    assert eval_change_note(same, state) is None
    assert eval_change_note(cfg, {"config": saved, "train_state": {"step": 30}}) is None
