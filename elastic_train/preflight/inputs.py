"""Every check of a run's inputs that needs no cluster, on the driver, before Ray starts: the data
set (and the held-out one), the model built on the meta device, their fit, storage, the
checkpoint to resume. Each failure is one ConfigError naming the key at fault."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from elastic_train.config import (
    Config,
    ConfigError,
    batch_tokens,
    choose_grad_reduce,
    num_partitions,
    validate,
)
from elastic_train.config.devices import gpu_micro_batch_tokens, resolve_device_defaults
from elastic_train.data.blocks import check_blocks
from elastic_train.data.dataset import (
    STATS_FILE,
    DatasetInfo,
    check_extra_columns,
    dataset_blocks,
    extra_columns,
    inspect_dataset,
    load_dataset_tokenizer,
)
from elastic_train.data.horizon import Horizon, plan_horizon
from elastic_train.data.plan import StreamSpec
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.data.rowgroups import BlockTable, hold_out
from elastic_train.preflight.checks import (
    check_compile_cache,
    check_gpu,
    check_reduce,
    check_sample_ids,
    check_storage,
)
from elastic_train.preflight.resolve import resolve_config
from elastic_train.preflight.resume import check_resumable, keep_batch_sizes
from elastic_train.preflight.vocab import (
    check_model_tokenizer,
    vocabulary,
    vocabulary_difference,
    vocabulary_hash,
)
from elastic_train.training.checkpoint import model_signature
from elastic_train.training.lora import check_qlora_inputs
from elastic_train.training.losses import LossFn
from elastic_train.training.memory import (
    RAY_MEMORY_THRESHOLD,
    GiB,
    ModelTooLargeError,
    check_fits_memory,
    device_bytes,
    host_bytes_per_rank,
    model_shapes,
)
from elastic_train.training.model import (
    BYTE_VOCAB,
    ModelFn,
    base_model_of,
    build_meta_model,
    input_embedding_rows,
    missing_module_classes,
)

logger = logging.getLogger("elastic_train")


def resolve_dataset(cfg: Config, key: str = "data.path") -> DatasetInfo:
    """The dataset to train on (or, with key="eval.path", to evaluate on), checked before any
    worker starts (ConfigError naming the key if unusable)."""
    if key == "eval.path":
        path = cfg.eval.path
    else:
        path = cfg.data.path or str(default_corpus_dir(cfg.data.max_seq_len))
    return _checked_dataset(cfg, path, key)


def _checked_dataset(cfg: Config, path: str, key: str) -> DatasetInfo:
    """`inspect_dataset(path)`, its ids checked, its rows no longer than data.max_seq_len (when
    set); ConfigError naming `key` otherwise."""
    try:
        info = inspect_dataset(path)
        check_sample_ids(info)
        check_extra_columns(info)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    limit = cfg.data.max_seq_len
    if limit is not None and info.max_length > limit:
        raise ConfigError(
            f"{key}: dataset {path} has rows of {info.max_length} tokens, longer than "
            f"data.max_seq_len={limit}; prepare it again with --max-seq-len {limit} or raise "
            "data.max_seq_len (or leave it unset: the data set's own)"
        )
    return info


@dataclass
class DataTables:
    """The blocks a run trains on and those it evaluates on (None: no evaluation)."""

    train: BlockTable
    eval: BlockTable | None
    # the data set evaluated on when it is one of its own: eval.path's, or the held-out documents
    # data.path's prepare wrote (None: no evaluation, or row groups held out of data.path)
    eval_info: DatasetInfo | None


def data_tables(cfg: Config, info: DatasetInfo, *, warn: bool = False) -> DataTables:
    """data.path's blocks, and those evaluated on: with eval.fraction, the held-out documents
    prepare recorded (`_held_out`); with eval.path, its blocks. `warn`: log the warnings of
    the choice (the driver's first call does, so each is said once)."""
    table = dataset_blocks(info)
    if cfg.eval.fraction > 0:
        return _held_out(cfg, info, table, warn)
    if cfg.eval.path:
        eval_info = resolve_dataset(cfg, "eval.path")
        missing = set(extra_columns(info)) - set(extra_columns(eval_info))
        if missing:
            raise ConfigError(f"eval.path: data set {eval_info.path} lacks the column(s) "
                              f"{sorted(missing)} that the training data has (the loss reads them)")
        if (eval_info.tokenizer_kind, eval_info.vocab_size) != (info.tokenizer_kind, info.vocab_size):
            raise ConfigError(
                f"eval.path: data set {eval_info.path} was tokenized with another tokenizer "
                f"({eval_info.tokenizer_kind}, vocabulary {eval_info.vocab_size}) than data.path "
                f"({info.tokenizer_kind}, vocabulary {info.vocab_size}): its loss would mean nothing")
        return DataTables(table, dataset_blocks(eval_info), eval_info)
    return DataTables(table, None, None)


def _held_out(cfg: Config, info: DatasetInfo, table: BlockTable, warn: bool) -> DataTables:
    """eval.fraction's evaluation set. Prepare cuts documents into rows and spreads the rows
    over every row group, so held-out row groups would evaluate on pieces of documents that
    are trained on (an optimistic loss): the whole documents `prepare --eval-fraction` held
    out are used; a data set with a `doc` column (so made by prepare) without them is refused;
    one without `doc` (made by another tool) keeps the row-group rule, with a warning."""
    split = info.eval_split
    if split is not None:
        if warn and not math.isclose(split["fraction"], cfg.eval.fraction):
            logger.warning(
                "eval.fraction is %g but data set %s was prepared with --eval-fraction %g: "
                "evaluating on the %s documents it held out", cfg.eval.fraction, info.path,
                split["fraction"], split.get("documents", "?"))
        eval_info = _checked_dataset(cfg, split["path"], "eval.fraction")
        return DataTables(table, dataset_blocks(eval_info), eval_info)
    if "doc" in info.columns:
        raise ConfigError(
            f"eval.fraction: data set {info.path} has no held-out documents (its rows are pieces "
            "of documents spread over every row group: held-out row groups would share documents "
            f"with training); prepare it with --eval-fraction {cfg.eval.fraction:g}, or set "
            "eval.path to a data set of its own and eval.fraction=0")
    if warn:
        logger.warning(
            "eval.fraction: data set %s has no doc column, so %g of its row groups are held out "
            "and a document may straddle the split (the eval loss then reads low); for whole "
            "documents prepare it with --eval-fraction, or set eval.path", info.path,
            cfg.eval.fraction)
    train, held = hold_out(table, cfg.eval.fraction)
    return DataTables(train, held, None)


def run_horizon(cfg: Config, info: DatasetInfo) -> Horizon:
    """The steps the run trains from step 0 and the limit that ends it (data/horizon.py), from
    the training blocks it will read."""
    return table_horizon(cfg, data_tables(cfg, info).train)


def table_horizon(cfg: Config, train: BlockTable) -> Horizon:
    """`run_horizon` of the training blocks `train`."""
    spec = StreamSpec(num_partitions(cfg), batch_tokens(cfg)[0], cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)
    return plan_horizon(train, spec, cfg.train.max_steps, cfg.train.epochs)


def fill_max_seq_len(cfg: Config, info: DatasetInfo) -> None:
    """data.max_seq_len, when unset: the longest row of the data set and of the held-out set
    it evaluates on (no longer than prepare's --max-seq-len: a model sized for rows the data
    does not have, e.g. position embeddings beyond a small Llama's, would be refused for
    nothing); then the batch sizes left to the data (`fill_batch_tokens`)."""
    d = cfg.data
    if d.max_seq_len is None:
        d.max_seq_len = max(2, info.max_length, *_eval_max_lengths(cfg, info))
    fill_batch_tokens(cfg, info)
    if d.micro_batch_tokens < d.max_seq_len:
        raise ConfigError(
            f"data.micro_batch_tokens ({d.micro_batch_tokens}) is smaller than the rows of "
            f"data set {info.path} (up to {d.max_seq_len} tokens: data.max_seq_len is unset, "
            "so the data set's): raise data.micro_batch_tokens, or prepare it with a smaller "
            "--max-seq-len")


def _eval_max_lengths(cfg: Config, info: DatasetInfo) -> list[int]:
    """The longest row of the set the run evaluates on, when it is one of its own."""
    try:
        if cfg.eval.fraction > 0 and info.eval_split is not None:
            return [inspect_dataset(info.eval_split["path"]).max_length]
        if cfg.eval.path:
            return [inspect_dataset(cfg.eval.path).max_length]
    except (ValueError, OSError):
        return []  # data_tables names the key that fails
    return []


def fill_batch_tokens(cfg: Config, info: DatasetInfo) -> None:
    """data.micro_batch_tokens and data.global_batch_tokens, when unset, from the data set's
    training tokens T and longest row L (data.max_seq_len), so that a small data set trains as
    prepared: a micro-batch holds the longest row and about T/256 tokens (at most 2048, as
    powers of two), and a step K such micro-batches, K about T/32 / micro (between
    scaling.max_workers and 8, and at most half the blocks: `check_blocks`). On the default
    corpus (4 M tokens, rows of 512) that is 2048 and 16384, the values this had before."""
    d, workers = cfg.data, cfg.scaling.max_workers
    tokens = max(_training_tokens(info), 1)
    micro = d.micro_batch_tokens
    if micro is None:
        fitting = _pow2_floor(tokens // 256)
        if d.global_batch_tokens is not None:  # at least one micro-batch per worker
            fitting = min(fitting, _pow2_floor(d.global_batch_tokens // workers))
        micro = max(_pow2_ceil(d.max_seq_len), min(DEFAULT_MICRO_TOKENS, fitting))
    if d.global_batch_tokens is None:
        blocks = len(dataset_blocks(info))
        k = min(MAX_AUTO_PARTITIONS, _pow2_floor(tokens // (32 * micro)), max(blocks // 2, 1))
        d.global_batch_tokens = micro * max(k, workers)
    if d.micro_batch_tokens is None:  # on GPU workers: few, large micro-batches (devices.py)
        d.micro_batch_tokens = (gpu_micro_batch_tokens(d.global_batch_tokens, workers, d.max_seq_len)
                                if cfg.scaling.use_gpu else micro)
    validate(cfg)  # the filled values, as a set one would be


def _training_tokens(info: DatasetInfo) -> int:
    """The data set's tokens: as `_prepare.json` counts them, else the sum of its `length`
    column (a data set made by another tool)."""
    import json

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        with info.filesystem.open_input_file(f"{info.path}/{STATS_FILE}") as handle:
            return int(json.loads(handle.read())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    total = 0
    for file in info.files:
        with info.filesystem.open_input_file(file) as handle:
            total += int(pc.sum(pq.read_table(handle, columns=["length"]).column("length")).as_py()
                         or 0)
    return total


DEFAULT_MICRO_TOKENS = 2048  # the most a micro-batch is given when data.micro_batch_tokens is unset
MAX_AUTO_PARTITIONS = 8  # ... and the most partitions (micro-batches a step) then


def _pow2_floor(n: int) -> int:
    return 1 << max(int(n), 1).bit_length() - 1


def _pow2_ceil(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def fill_from_dataset(cfg: Config, info: DatasetInfo, eval_info: DatasetInfo | None = None) -> None:
    """Fill in what the config leaves to the data set, so the resolved config says it:
    data.max_seq_len, data.pad_id, model.vocab_size (the tokenizer's size, or more when the
    largest token id of the training or evaluation set says so)."""
    fill_max_seq_len(cfg, info)
    if cfg.data.pad_id is None:
        cfg.data.pad_id = info.pad_id if info.pad_id is not None else 0
    if cfg.model.vocab_size is None and cfg.model.name != "hf":
        # a tokenizer may report fewer tokens than its largest id: the larger of the two (a
        # data set of its own records no tokenizer: bytes, or more where its ids say so)
        largest = max((i.max_token_id or -1) for i in (info, eval_info) if i is not None)
        cfg.model.vocab_size = max(info.vocab_size or BYTE_VOCAB, largest + 1)


def check_inputs(cfg: Config, model_fn: ModelFn | None = None,
                 loss_fn: LossFn | None = None) -> DatasetInfo:
    """Every check that needs no cluster: the dataset, the model (built once on the meta device:
    shapes only; a user's factory that refuses it, on the CPU), their fit, storage, the checkpoint
    to resume. Fills in what the config leaves to the data set (`fill_from_dataset`), so the
    resolved config says it."""
    resolve_device_defaults(cfg)  # a Config built in Python has not been through load_config:
    validate(cfg)  # its "auto" keys settled, then checked
    resolve_config(cfg, model_fn, loss_fn)
    check_gpu(cfg)
    remote = "://" in cfg.run.storage_path
    if remote:  # before anything reads it (a resume's batch sizes): one line if it cannot answer
        check_storage(cfg)
    info = resolve_dataset(cfg)
    keep_batch_sizes(cfg)  # a resume's, where they are left to the data
    fill_max_seq_len(cfg, info)  # first: the evaluation set's rows are checked against it
    tables = data_tables(cfg, info, warn=True)
    fill_from_dataset(cfg, info, tables.eval_info)
    try:
        check_blocks(tables.train, num_partitions(cfg), info.path)
    except ValueError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    if cfg.optim.schedule_steps is None:  # the cosine ends where the run does
        cfg.optim.schedule_steps = table_horizon(cfg, tables.train).total
    check_qlora_inputs(cfg)  # a 4-bit base needs pretrained weights: before any build of it
    model = meta_model(cfg, model_fn)
    # a class name that matches no module: before any worker
    for key, names, used in (("model.shard_modules", cfg.model.shard_modules,
                              cfg.train.sharding == "fsdp"),
                             ("train.compile_modules", cfg.train.compile_modules,
                              cfg.train.compile)):
        missing = missing_module_classes(model, names, key) if used else None
        if missing:
            raise ConfigError(missing)
    check_compile_cache(cfg)
    check_model_tokenizer(cfg, info)
    if cfg.eval.path:
        check_eval_set(info, tables.eval_info)
    check_model_fits_data(cfg, info, model)
    if tables.eval_info is not None:
        check_model_fits_data(cfg, tables.eval_info, model)
    if not remote:  # a local folder is made only once every input passed
        check_storage(cfg)
    saved = check_resumable(cfg, model_signature(model), info)
    check_reduce(cfg, saved)
    check_model_memory(cfg, model, saved)
    return info


def check_eval_set(info: DatasetInfo, eval_info: DatasetInfo) -> None:
    """eval.path is a data set apart from data.path, tokenized as it is: no Parquet file of the
    training set (its loss would measure what the model memorised), and where both keep a
    tokenizer copy, vocabularies that agree (two tokenizers of one size pass the size check;
    their ids mean other tokens)."""
    shared = sorted(set(info.files) & set(eval_info.files))
    if shared:
        raise ConfigError(f"eval.path: data set {eval_info.path} holds {len(shared)} Parquet "
                          f"file(s) of the training set data.path (e.g. {shared[0]}): the "
                          "evaluation would measure what the model trained on; hold documents "
                          "out with prepare --eval-fraction, or name another set")
    if info.tokenizer_path is None or eval_info.tokenizer_path is None:
        return
    try:
        ours, theirs = (vocabulary(load_dataset_tokenizer(i)) for i in (info, eval_info))
    except ValueError as exc:
        raise ConfigError(f"eval.path: {exc}") from None
    why = None if ours == theirs or None in (ours, theirs) else vocabulary_difference(ours, theirs)
    if why is not None:
        raise ConfigError(
            f"eval.path: data set {eval_info.path} was tokenized with another tokenizer "
            f"(vocabulary {vocabulary_hash(theirs)}) than data.path (vocabulary "
            f"{vocabulary_hash(ours)}): {why}; its loss would mean nothing. Prepare it again "
            f"with --tokenizer {info.tokenizer_path}")


def check_model_memory(cfg: Config, model: torch.nn.Module, saved: dict[str, Any] | None) -> None:
    """On a local cluster (this machine's memory and GPU are the workers'), the model's meta
    shapes against what a rank can have (training/memory.py), at scaling.min_workers: one
    ConfigError line naming the figures and what would fit, before Ray starts. A remote
    cluster's nodes are not known here: its workers check before they build."""
    if cfg.run.address or os.environ.get("RAY_ADDRESS"):
        return
    train_state = (saved or {}).get("train_state")
    grad_reduce = choose_grad_reduce(cfg.train, cfg.scaling.use_gpu,
                                     train_state.get("grad_reduce") if isinstance(train_state, dict)
                                     else None).chosen
    if cfg.fault.recovery == "in_place":
        grad_reduce = "exact"
    workers = cfg.scaling.min_workers
    if cfg.scaling.use_gpu:
        available, where = device_bytes(torch.device("cuda", 0)), "the GPU's memory"
    else:
        node = psutil.virtual_memory().total
        available = host_bytes_per_rank(node, workers)
        where = (f"{RAY_MEMORY_THRESHOLD:.0%} of this host's {node / GiB:.1f} GiB over "
                 f"{workers} worker(s)")
    try:
        check_fits_memory(model_shapes(model, cfg), cfg, grad_reduce, workers, available, where)
    except ModelTooLargeError as exc:
        raise ConfigError(str(exc)) from None


def meta_model(cfg: Config, model_fn: ModelFn | None = None) -> torch.nn.Module:
    """The model on the meta device (no memory), or a ConfigError naming what failed. A user's
    factory that refuses the meta device is built once on the CPU instead
    (`build_meta_model`): only what fails there too is refused."""
    try:
        return build_meta_model(cfg.model, cfg.data.max_seq_len, model_fn)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_model_fits_data(cfg: Config, info: DatasetInfo, model: torch.nn.Module) -> None:
    """The model embeds every token id of the data, the pad id, and positions up to
    data.max_seq_len (where the model says how many it has)."""
    rows = input_embedding_rows(model, cfg.model.vocab_size or BYTE_VOCAB)  # what the factory got
    largest = max(info.max_token_id or 0, cfg.data.pad_id or 0)
    if rows is not None and largest >= rows and cfg.model.name == "hf":
        raise ConfigError(
            f"model.path: the model in '{cfg.model.path}' embeds {rows} token ids but data set "
            f"{info.path} uses token id {largest} (its tokenizer has {info.vocab_size} tokens): "
            "use a model whose vocabulary covers the data's tokenizer, or prepare the data again "
            "with the model's own tokenizer (prepare --tokenizer MODEL_FOLDER)")
    if rows is not None and largest >= rows:
        raise ConfigError(
            f"model: its embedding has {rows} rows but data set {info.path} uses token id {largest}; "
            f"set model.vocab_size (or the model's own vocabulary) to at least {largest + 1}")
    positions = getattr(getattr(base_model_of(model), "config", None), "max_position_embeddings",
                        None)
    if positions is not None and cfg.data.max_seq_len > positions:
        raise ConfigError(f"data.max_seq_len ({cfg.data.max_seq_len}) is longer than the model's "
                          f"max_position_embeddings ({positions})")
