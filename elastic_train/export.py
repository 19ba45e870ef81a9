"""What a run trained, out of the run folder: `export` to a folder other tools load, `sample` text.

    elastic-train export RUN_FOLDER --output DIR [--checkpoint NAME] [--merge]
    elastic-train sample RUN_FOLDER --prompt TEXT [--max-new-tokens N]

The model is rebuilt from the run's resolved `config.yaml` (or the caller's `model_fn`, for runs
that trained an inline model) and loaded from a complete checkpoint: the best one (lowest eval
loss) when the run kept it (`checkpoint.keep_best`), else the newest, unless `checkpoint` names
another. For `model.name=hf` the export is a folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads (`save_pretrained`: safetensors,
tied weights handled), with the data set's tokenizer beside it for `AutoTokenizer`; for any other
model `model.safetensors`, the resolved `config.yaml` and the tokenizer's copy. A LoRA run
(`model.lora.r > 0`) exports its adapters (peft's `adapter_config.json` and
`adapter_model.safetensors`, naming model.path as the base: `PeftModel.from_pretrained(base, DIR)`
loads them, and `lora_base_sha256.json`, the hash of the base they trained on, which loading the
export checks the base against), or with `merge` the adapters merged into the base, written as
above (a folder `from_pretrained` loads alone). An hf export's config.json and
generation_config.json have the KV cache on (training turned it off), and the generation config
is the base's own generation_config.json where model.path has one. A QLoRA run's adapters are
loaded onto its base unquantised, in bf16, so export and sample need no GPU (`_unquantised`).
The output is written in a scratch folder renamed into place: an existing folder is never
overwritten. The output is checked (and the scratch folder made) before the model loads, so a
bad `--output` (a URI among them: exports are written to a local folder) costs nothing; so is
`merge` (the source must hold LoRA adapters: its config.yaml or files say). A LoRA run of a
model that is not `hf` (the GPT, an import path) always exports merged: peft adapters load only
onto a base transformers can name, and the config.yaml written is the merged model's (LoRA off).

Both say on stderr which checkpoint they load (its folder, step, and eval loss for the best), and
warn when `best_checkpoint.json` names a folder that is missing or incomplete (then the newest
complete one is used). A run folder on remote storage (`s3://`, `gs://`: any pyarrow.fs URI) is
read through a temporary local copy of the files they need (`local_run`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pyarrow.fs as pafs
import torch
import yaml
from torch import nn

from elastic_train.config import Config, ConfigError, ModelConfig, config_from_dict, redact
from elastic_train.data.batches import make_batch
from elastic_train.data.tokenizer import Tokenizer
from elastic_train.observe.runfolder import CONFIG_FILE, local_copy
from elastic_train.training.checkpoint import (
    BEST_POINTER,
    CheckpointError,
    complete_checkpoints,
    is_complete,
    load_model_weights,
    read_best_pointer,
    read_state,
    signature_mismatch,
)
from elastic_train.training.lora import BASE_KEY, LoraModel, another_base_error, require_peft
from elastic_train.training.losses import (
    forward,
)
from elastic_train.training.model import ModelFn, build_model

BASE_HASH_FILE = "lora_base_sha256.json"  # in an adapter export: the base the adapters trained on


@dataclass
class TrainedModel:
    """A run's model loaded from one of its checkpoints, with its config and tokenizer."""

    model: nn.Module
    config: Config
    checkpoint: Path  # for a remote run, in a temporary copy gone once load_trained returns
    tokenizer: Tokenizer


@dataclass
class CheckpointChoice:
    """The checkpoint export and sample load, and why: told on the console."""

    path: Path
    why: str  # "the newest", "the best, eval loss X", "as named"
    warnings: list[str] = field(default_factory=list)


def _tell(line: str) -> None:
    print(redact.shown(line), file=sys.stderr)


def latest_checkpoint(run_folder: Path) -> Path:
    """The newest complete checkpoint of a run (ValueError if it has none)."""
    names = sorted((p for p in run_folder.glob("checkpoint_*") if is_complete(p)), reverse=True)
    if not names:
        raise ValueError(f"run folder '{run_folder}' holds no complete checkpoint")
    return names[0]


def choose_checkpoint(run_folder: Path, checkpoint: str | None = None) -> CheckpointChoice:
    """`checkpoint` when named; else the best (lowest eval loss, `checkpoint.keep_best`) when the
    run kept one and it is complete, else the newest complete one, with a warning when the
    pointer names a folder that is gone or half written (a deleted folder, a partial copy)."""
    if checkpoint:
        return CheckpointChoice(run_folder / checkpoint, "as named")
    pointer = read_best_pointer(pafs.LocalFileSystem(), str(run_folder.resolve()))
    warnings = []
    if pointer is not None:
        best = run_folder / pointer["checkpoint"]
        if is_complete(best):
            loss = pointer.get("eval_loss")
            return CheckpointChoice(best, "the best" + (f", eval loss {loss:.4f}" if isinstance(
                loss, int | float) else ""))
        warnings.append(f"warning: {BEST_POINTER} names {pointer['checkpoint']}, which is missing "
                        "or incomplete: using the newest complete checkpoint")
    return CheckpointChoice(latest_checkpoint(run_folder), "the newest", warnings)


def default_checkpoint(run_folder: Path) -> Path:
    """The checkpoint export and sample load by default (`choose_checkpoint`)."""
    return choose_checkpoint(run_folder).path


def _is_remote_export(names: dict[str, pafs.FileType]) -> bool:
    """A remote folder that `export` wrote (as `is_export_folder`, from its listing)."""
    if any(n.startswith("checkpoint_") for n in names):
        return False
    return ("config.json" in names or "adapter_config.json" in names
            or ("model.safetensors" in names and CONFIG_FILE in names))


def _download_run(fs: pafs.FileSystem, path: str, local: Path, checkpoint: str | None,
                  needs_adapters: str | None = None) -> None:
    """Copy what export and sample read of a remote folder into `local`: the whole of an export
    folder; of a run folder its config.yaml, best pointer and the one checkpoint they will load
    (the best when whole, else the newest with a manifest), never every checkpoint it keeps.
    `needs_adapters` (the folder as shown): refuse one without LoRA adapters before copying
    its model (`_check_adapters`)."""

    def fetch(name: str) -> None:
        if name in names:
            if names[name] == pafs.FileType.Directory:
                (local / name).mkdir()  # copy_files makes the folders below, not this one
            pafs.copy_files(f"{path}/{name}", str(local / name), source_filesystem=fs,
                            destination_filesystem=pafs.LocalFileSystem())

    local.mkdir(parents=True)
    names = {i.base_name: i.type for i in fs.get_file_info(pafs.FileSelector(path))}
    if _is_remote_export(names):
        if needs_adapters:
            _check_adapters(set(names), True, lambda: None, needs_adapters)
        for name in names:
            fetch(name)
        return
    fetch(CONFIG_FILE)
    if needs_adapters:
        _check_adapters(set(names), False, lambda: _readable_config(local), needs_adapters)
    fetch(BEST_POINTER)
    if checkpoint:
        return fetch(checkpoint)
    pointer = read_best_pointer(pafs.LocalFileSystem(), str(local))
    if pointer is not None:
        fetch(pointer["checkpoint"])
        if is_complete(local / pointer["checkpoint"]):
            return
    for name in complete_checkpoints(fs, path)[:1]:
        fetch(name)


def load_run_config(run_folder: Path, keys_from: str = "") -> Config:
    """The run's config.yaml; its URIs' secrets (masked there: config/redact.py) are those of
    `keys_from`, the run folder as given, where it has the same key."""
    path = run_folder / "config.yaml"
    if not run_folder.exists():
        raise ValueError(f"run folder '{run_folder}' does not exist")
    if not path.is_file():
        raise ValueError(f"'{run_folder}' is not a run folder: it has no config.yaml")
    try:
        cfg = config_from_dict(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ConfigError) as exc:
        raise ValueError(f"run config '{path}' is not readable: {exc}") from None
    for section, key in (("run", "storage_path"), ("data", "path"), ("eval", "path"),
                         ("model", "path")):
        part = getattr(cfg, section)
        setattr(part, key, redact.with_keys(getattr(part, key), [keys_from]))
    return cfg


def run_tokenizer(cfg: Config, recorded: dict | None = None) -> Tokenizer:
    """The tokenizer the run's data set records (bytes for byte data). `recorded`: the run's
    provenance (a checkpoint's), which says which tokenizer it trained with. With it, a data set
    that is gone (deleted, or on another machine: a run folder copied from s3) still gives bytes
    to a byte run, and one prepared again with another tokenizer is refused (its ids would be
    decoded with the wrong vocabulary); ValueError naming the data set otherwise."""
    from elastic_train.data.dataset import inspect_dataset, load_dataset_tokenizer
    from elastic_train.data.prepare import default_corpus_dir
    from elastic_train.data.tokenizer import ByteTokenizer
    from elastic_train.observe.provenance import tokenizer_hash

    recorded = recorded or {}
    path = cfg.data.path or str(default_corpus_dir(cfg.data.max_seq_len))
    trained = recorded.get("tokenizer_hash")
    try:
        info = inspect_dataset(path)
    except (ValueError, OSError) as exc:
        if trained == "bytes":
            return ByteTokenizer()
        named = f" ({recorded['tokenizer']})" if recorded.get("tokenizer") else ""
        raise ValueError(f"the run's tokenizer{named} is the copy in its data set, data.path "
                         f"'{path}', which cannot be read ({exc}): put the data set back there, "
                         "or export from a machine that has it (an export folder carries the "
                         "tokenizer)") from None
    now = tokenizer_hash(info)
    if trained and now and now != trained:
        raise ValueError(f"data set '{path}' now holds another tokenizer ({now}) than the run "
                         f"trained with ({trained}): it was prepared again; its ids would be "
                         "decoded with the wrong vocabulary")
    return load_dataset_tokenizer(info)


def load_trained(run_folder: str | os.PathLike, checkpoint: str | None = None,
                 model_fn: ModelFn | None = None,
                 say: Callable[[str], None] = _tell, needs_adapters: bool = False) -> TrainedModel:
    """Rebuild the run's model and load a checkpoint's weights into it (on the CPU, eval mode);
    or, for a folder `export` wrote, the model it holds (`load_exported`). `say` gets the line
    naming the checkpoint (and any warning about the choice). `needs_adapters` (export's merge):
    a run or export folder that holds no LoRA adapters is refused before anything loads."""
    given = os.fspath(run_folder)
    shown = redact.shown(given)

    def download(fs: pafs.FileSystem, path: str, local: Path) -> None:
        _download_run(fs, path, local, checkpoint, shown if needs_adapters else None)

    with local_copy(run_folder, download, "elastic-train-run-") as (folder, remote):
        if needs_adapters and not remote:  # a remote one was checked as it was copied
            names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
            _check_adapters(names, is_export_folder(folder),
                            lambda: _readable_config(folder), shown)
        return _load_trained(folder, given, checkpoint, model_fn, say)


def _readable_config(folder: Path) -> Config | None:
    """The run's config, or None where it cannot be read (loading it says why, by name)."""
    try:
        return load_run_config(folder)
    except ValueError:
        return None


def _check_adapters(names: set[str], export_folder: bool, config: Callable[[], Config | None],
                    shown: str) -> None:
    """--merge merges LoRA adapters: a source without them is refused (ValueError), from its
    files before its model loads. An export folder holds adapters when it has an
    adapter_config.json (merged into the base as it loads: the export is that merged model);
    a run folder when its config.yaml has model.lora.r > 0."""
    if export_folder:
        if "adapter_config.json" in names:
            return
        held = ("a whole transformers model (config.json)" if "config.json" in names
                else "a whole model (model.safetensors)")
        raise ValueError(f"--merge: export folder '{shown}' holds {held}, no LoRA adapters: "
                         "there is nothing to merge; export it without --merge")
    cfg = config()
    if cfg is not None and cfg.model.lora.r == 0:
        raise ValueError(f"--merge: run '{shown}' trained no LoRA adapters (model.lora.r is 0): "
                         "its export is the whole model already; export it without --merge")


def _load_trained(folder: Path, given: str, checkpoint: str | None, model_fn: ModelFn | None,
                  say: Callable[[str], None]) -> TrainedModel:
    if checkpoint is None and is_export_folder(folder):
        return load_exported(folder, model_fn)
    cfg = load_run_config(folder, keys_from=given)
    if cfg.model.inline_fn and model_fn is None:
        raise ValueError(
            f"run '{folder}' trained an inline model ({cfg.model.inline_fn}, the Python API's "
            "model_fn), which its config cannot rebuild: use the Python API with that function, "
            "elastic_train.export.export(RUN, OUTPUT, model_fn=...) or load_trained(RUN, "
            "model_fn=...)")
    choice = choose_checkpoint(folder, checkpoint)
    ckpt = choice.path
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint '{ckpt}' does not exist")
    try:
        state = read_state(ckpt)
    except (CheckpointError, OSError) as exc:
        raise ValueError(f"checkpoint '{ckpt}': {exc}") from None
    for line in choice.warnings:
        say(line)
    step = state.get("train_state", {}).get("step", "?")
    say(f"checkpoint: {ckpt.name} (step {step}, {choice.why}) of {redact.shown(given)}")
    provenance = state.get("provenance") if isinstance(state.get("provenance"), dict) else {}
    tokenizer = run_tokenizer(cfg, provenance)  # before the model: its errors cost no load
    torch.manual_seed(cfg.train.seed)
    model = build_model(_unquantised(cfg.model), cfg.data.max_seq_len, model_fn)
    mismatch = signature_mismatch(state, {n: list(t.shape) for n, t in model.state_dict().items()})
    if mismatch:
        hint = "" if model_fn else " (a run of an inline model: pass its model_fn to export)"
        raise ValueError(f"checkpoint '{ckpt}' {mismatch}{hint}")
    load_model_weights(ckpt, model)  # an fsdp run's rows assembled a tensor at a time
    return TrainedModel(model.eval(), cfg, ckpt, tokenizer)


def is_export_folder(folder: Path) -> bool:
    """A folder `export` wrote: no checkpoint in it, and a transformers model (config.json), a
    LoRA adapter (adapter_config.json) or our own `model.safetensors` beside `config.yaml`."""
    if not folder.is_dir() or any(folder.glob("checkpoint_*")):
        return False
    return ((folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()
            or ((folder / "model.safetensors").is_file() and (folder / "config.yaml").is_file()))


def load_exported(folder: Path, model_fn: ModelFn | None = None) -> TrainedModel:
    """The model of an export folder, for `sample`: a transformers model, LoRA adapters merged
    into the base their adapter_config.json names, or our own model from its `config.yaml`
    (an inline model built by `model_fn`, which it needs); the tokenizer beside it (bytes
    without one)."""
    from elastic_train.data.tokenizer import load_tokenizer

    if (folder / "config.yaml").is_file() and not (folder / "config.json").is_file():
        cfg = load_run_config(folder)
        if cfg.model.inline_fn and model_fn is None:
            raise ValueError(f"export '{folder}' holds an inline model ({cfg.model.inline_fn}), "
                             "which its config cannot rebuild: load it with your model_fn, "
                             "load_trained(EXPORT, model_fn=...)")
        from safetensors.torch import load_model

        model = build_model(replace(cfg.model, lora=replace(cfg.model.lora, r=0)),
                            cfg.data.max_seq_len, model_fn)
        load_model(model, str(folder / "model.safetensors"))
        tokenizer = load_tokenizer(folder / "tokenizer" if (folder / "tokenizer").is_dir() else None)
        return TrainedModel(model.eval(), cfg, folder, tokenizer)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights": sample prints the text alone
    if (folder / "adapter_config.json").is_file():
        peft = require_peft()  # bitsandbytes first, with the Hub off
        base_path = peft.PeftConfig.from_pretrained(str(folder)).base_model_name_or_path
        if not base_path:
            raise ValueError(f"export '{folder}' holds LoRA adapters of a model that is not a "
                             "transformers one: sample its run folder, or export it with --merge")
        base = AutoModelForCausalLM.from_pretrained(_adapter_base(folder, base_path),
                                                    local_files_only=True)
        model = peft.PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    cfg = config_from_dict({"model": {"name": "hf", "path": str(folder)}})
    cfg.data.max_seq_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    has_tokenizer = any((folder / name).is_file() for name in ("tokenizer.json",
                                                                  "tokenizer_config.json"))
    return TrainedModel(model.eval(), cfg, folder, load_tokenizer(folder if has_tokenizer else None))


def _adapter_base(folder: Path, base_path: str) -> Path:
    """The local folder of the base an adapter export names (adapter_config.json's
    base_model_name_or_path), refused by name (ValueError) when it is a URI, is not found, has
    no weights, or holds other weights than the adapters trained on: the hash in
    `BASE_HASH_FILE` (an older export has none: not checked), computed as the run did
    (basehash.folder_hash) and refused in the run's own words (lora.another_base_error)."""
    from elastic_train.training.basehash import folder_hash, weight_files

    named = f"export '{folder}' holds LoRA adapters of the base '{base_path}'"
    fix = "set base_model_name_or_path in its adapter_config.json to the base's local folder"
    if "://" in base_path:
        raise ValueError(f"{named}, a URI, which cannot be loaded here (a base is loaded from a "
                         f"local folder): copy the base to one and {fix}")
    base = Path(base_path).expanduser()
    if not base.is_dir():
        raise ValueError(f"{named}, a folder that is not found: put the base back there, or {fix}")
    if not weight_files(base):
        raise ValueError(f"{named}, which has no weights (the run built it from its config and "
                         "seed): sample the run folder, or its export with --merge")
    recorded = _recorded_base_hash(folder)
    ours = folder_hash(base) if recorded is not None else None
    if ours is not None and ours != recorded:
        raise another_base_error(recorded, ours, whose=f"export '{folder}': its",
                                 fix=f"put the base they trained on back at '{base_path}', or {fix}")
    return base


def _recorded_base_hash(folder: Path) -> bytes | None:
    """The base hash an adapter export recorded (`BASE_HASH_FILE`), None without the file."""
    path = folder / BASE_HASH_FILE
    if not path.is_file():
        return None
    try:
        return bytes.fromhex(json.loads(path.read_text())[BASE_KEY])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"export '{folder}': {BASE_HASH_FILE} is not readable ({exc})") from None


def _unquantised(model_cfg: ModelConfig) -> ModelConfig:
    """A QLoRA run's adapters go onto its base unquantised, in bf16 (as QLoRA merges them): so
    export and sample run without a GPU, and a merged export is a plain bf16 model. The base
    hash is of the folder's weights before quantisation, so the adapters load onto it."""
    if not model_cfg.lora.load_in_4bit:
        return model_cfg
    return replace(model_cfg, lora=replace(model_cfg.lora, load_in_4bit=False), base_dtype="bf16")


def export(run_folder: str | os.PathLike, output: str | os.PathLike, checkpoint: str | None = None,
           model_fn: ModelFn | None = None, merge: bool = False,
           say: Callable[[str], None] = _tell) -> Path:
    """Write the trained model of `run_folder` to `output` (see the module docstring)."""
    out, scratch, made = _claim_output(output)
    try:
        # with merge, a source without adapters is refused before its model loads; an adapter
        # export loads merged already (load_exported)
        trained = load_trained(run_folder, checkpoint, model_fn, say, needs_adapters=merge)
        lora = isinstance(trained.model, LoraModel)
        if lora and not merge and trained.config.model.name != "hf":
            say(f"note: LoRA adapters of model.name={trained.config.model.name} load onto no "
                "transformers base: exporting them merged into the model")
            merge = True
        try:
            if lora and not merge:
                _write_adapters(trained, scratch)
            else:
                if lora:
                    trained.model = trained.model.peft.merge_and_unload()
                    trained.config = _merged_config(trained.config)
                _write_export(trained, scratch)
            _open_to_umask(scratch)
            if out.exists():
                out.rmdir()  # empty, checked above
            os.rename(scratch, out)
        except OSError as exc:
            raise ValueError(f"output '{output}': {exc.strerror or exc}") from None
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        _remove_made(scratch.parent, made)
        raise
    return out


def _claim_output(output: str | os.PathLike) -> tuple[Path, Path, Path | None]:
    """Check `output` before anything loads (a bad one would fail only after a model of many GB
    loaded), and make the scratch folder the export is written in, beside it. Returns the folder
    to write (a link's target: the link stays), the scratch folder, and the first folder above
    it that this made (None: none), removed again if the export fails."""
    shown = f"output '{output}'"
    if "://" in os.fspath(output):  # realpath would make it a local folder named 's3:'
        raise ValueError(f"{shown} is a URI: exports are written to a local folder; export to "
                         "one and copy it up after")
    out = Path(os.path.realpath(os.path.expanduser(output)))
    if Path.cwd().resolve().is_relative_to(out):
        raise ValueError(f"{shown}: it is the current folder or holds it: name a new folder")
    made = None
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"{shown}: already exists and is not an empty folder; refusing to "
                             "overwrite it")
        for above in out.parents:
            if above.exists():
                if not above.is_dir():
                    raise ValueError(f"{shown}: '{above}' is a file, not a folder")
                break
            made = above
        out.parent.mkdir(parents=True, exist_ok=True)
        return out, Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent)), made
    except OSError as exc:
        _remove_made(out.parent, made)
        raise ValueError(f"{shown}: {exc.strerror or exc}") from None


def _remove_made(folder: Path, made: Path | None) -> None:
    """Remove the (empty) folders from `folder` up to `made`, which `_claim_output` made."""
    if made is None:
        return
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == made:
            return


def _merged_config(cfg: Config) -> Config:
    """The config of a merged LoRA model as saved: LoRA off, so that building the model from
    the exported config.yaml gives the names and shapes of its model.safetensors."""
    model = replace(cfg.model, lora=replace(cfg.model.lora, r=0, load_in_4bit=False),
                    base_dtype="fp32")
    return replace(cfg, model=model)


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (/proc), else by
    setting and restoring it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _open_to_umask(folder: Path) -> None:
    """The export's modes as any new file of this process would have them: the scratch folder
    (mkdtemp) is 0700 and safetensors writes 0600, which left an export others could not read."""
    mask = _umask()
    for root, _dirs, names in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in names:
            os.chmod(os.path.join(root, name), 0o666 & ~mask)


def _write_adapters(trained: TrainedModel, folder: Path) -> None:
    """A LoRA run's adapters as peft saves them, model.path named as their base, the base's hash
    beside them (`BASE_HASH_FILE`: loading the export checks the base against it, as a resume
    does; peft's files carry none), and the tokenizer."""
    peft_model = trained.model.peft
    for settings in peft_model.peft_config.values():
        settings.base_model_name_or_path = redact.shown(trained.config.model.path)
    peft_model.save_pretrained(str(folder), safe_serialization=True)
    digest = bytes(getattr(trained.model, BASE_KEY).tolist())  # checked against the base on load
    (folder / BASE_HASH_FILE).write_text(json.dumps({
        BASE_KEY: digest.hex(), "base_model_name_or_path": redact.shown(trained.config.model.path),
        "of": "the base's weights as stored in its folder (elastic_train.training.basehash)"},
        indent=2) + "\n")
    if trained.tokenizer.kind == "hf":
        trained.tokenizer.save_for_transformers(folder)


def _write_export(trained: TrainedModel, folder: Path) -> None:
    tok = trained.tokenizer
    if trained.config.model.name == "hf":
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # "Writing model shards": export's line alone
        _ready_to_generate(trained.model, trained.config.model.path)
        trained.model.save_pretrained(folder, safe_serialization=True)
        if tok.kind == "hf":
            tok.save_for_transformers(folder)
        return
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ValueError("export needs safetensors: pip install 'elastic_train[hf]'") from None
    save_model(trained.model, str(folder / "model.safetensors"))  # shared (tied) tensors once
    (folder / "config.yaml").write_text(redact.shown(trained.config.to_yaml()))
    if tok.kind == "hf":
        tok.save(folder / "tokenizer")


def _ready_to_generate(model: nn.Module, base_path: str | None) -> None:
    """The transformers model's configs as generation wants them: the KV cache on (training
    turned it off, hf.load_hf_config, and the generation config derived from that config copied
    it: generate would recompute every position for every token), and the base's own
    generation_config.json (its end-of-text ids, sampling defaults) where model.path has one,
    not one derived from config.json: the model was built from its config (`from_config`)."""
    from transformers import GenerationConfig

    from elastic_train.training.hf import local_model_folder

    model.config.use_cache = True
    folder = local_model_folder(str(base_path)) if base_path else None
    if folder is not None and (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True


@torch.no_grad()
def generate(trained: TrainedModel, prompt: str, max_new_tokens: int = 100,
             temperature: float = 0.8, seed: int = 0) -> str:
    """The prompt's continuation, sampled token by token (temperature 0: greedy), up to
    `max_new_tokens` or the tokenizer's end-of-text token."""
    tok, max_len = trained.tokenizer, trained.config.data.max_seq_len
    bos = [] if tok.bos_id is None else [tok.bos_id]  # as the documents trained on began
    ids = bos + tok.encode(prompt) or ([tok.eos_id] if tok.eos_id is not None else [0])
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        context = torch.tensor([(ids + new)[-max_len:]], dtype=torch.long)
        logits = forward(trained.model, make_batch(context, torch.tensor([context.shape[1]])))
        logits = logits[0, -1, : tok.vocab_size].float()  # the model may embed more ids
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        if next_id == tok.eos_id:
            break
        new.append(next_id)
    return tok.decode(new)
