"""Hugging Face `transformers` causal LMs (`model.name: hf`, `model.path: FOLDER_OR_URI`).

The folder holds a `config.json`, with or without weights: with them the model is loaded from
its safetensors files a tensor at a time, without it is initialised from the config with
transformers' `_init_weights` and the global torch RNG (the loop seeds it alike on every rank, so
every rank builds the same weights without a broadcast); either way built on the meta device
first, so that fsdp ranks read or create only their rows (hfshards.py).
Always fp32 master weights (newer transformers default to the checkpoint's dtype), `use_cache`
off while training, `trust_remote_code` only when the user sets it. A URI is copied once per node
into a local cache folder, so the weights are read from storage once per node, not once per rank.
Nothing is ever downloaded from a hub: everything is `local_files_only`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
from torch import nn

from elastic_train.config import ModelConfig
from elastic_train.training.hfshards import SOURCE_ATTR, missing_from_files, stored_tensors

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
HF_EXTRA = "pip install 'elastic_train[hf]'"


def require_transformers():
    """The transformers module, or a ValueError saying which extra to install."""
    try:
        import transformers
    except ImportError:
        raise ValueError(f"model.name=hf needs transformers: {HF_EXTRA}") from None
    return transformers


def _cache_root() -> Path:
    root = os.environ.get("ELASTIC_TRAIN_CACHE") or Path.home() / ".cache" / "elastic_train"
    return Path(root).expanduser() / "models"


def local_model_folder(path: str) -> Path:
    """A local folder holding the model at `path`: itself, or for a URI a per-node copy (made
    under a file lock by the first process of the node, in a scratch folder renamed into place)."""
    if "://" not in path:
        return Path(path).expanduser()
    fs, root = pafs.FileSystem.from_uri(path)
    final = _cache_root() / hashlib.sha256(path.encode()).hexdigest()[:16]
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{final}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not final.is_dir():
            scratch = Path(tempfile.mkdtemp(prefix=".download-", dir=final.parent))
            for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
                if info.type == pafs.FileType.File:
                    dest = scratch / os.path.relpath(info.path, root)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    with fs.open_input_stream(info.path) as src, open(dest, "wb") as out:
                        shutil.copyfileobj(src, out)
            os.rename(scratch, final)
    return final


def has_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def load_hf_config(model_cfg: ModelConfig):
    """The model's `PretrainedConfig`, with `use_cache` off; ValueError naming a bad path."""
    transformers = require_transformers()
    shown = model_cfg.path
    if "://" not in str(shown) and not (Path(str(shown)).expanduser() / "config.json").is_file():
        raise ValueError(f"model.path: '{shown}' holds no config.json (a folder of a transformers "
                         "model is expected)")
    folder = local_model_folder(str(shown))
    try:
        config = transformers.AutoConfig.from_pretrained(
            folder, trust_remote_code=model_cfg.trust_remote_code, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.path: '{shown}': transformers cannot read its config.json: "
                         f"{exc}") from None
    check_causal_lm(config, str(shown), model_cfg.trust_remote_code)
    config.use_cache = False
    return config, folder


def check_causal_lm(config, shown: str, trust_remote_code: bool = False) -> None:
    """The model predicts each token from the ones before it only: a causal decoder. Else its
    loss means nothing (a bidirectional encoder sees the token it predicts) and training it
    is refused by name. transformers' causal-LM mapping knows some encoders too (BERT, RoBERTa,
    ... as decoders, with `is_decoder: true` in their config): those must say so."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CAUSAL,
    )
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_MASKED_LM_MAPPING_NAMES as MASKED,
    )
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES as BASE

    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return  # the model's own code says it is one
    kind = config.model_type
    archs = list(getattr(config, "architectures", None) or [])
    named = f"model.path: '{shown}' is a {kind} model" + (f" ({', '.join(archs)})" if archs else "")
    # the causal-LM classes, and the bare models under them (a decoder saved without its head)
    causal_classes = {n for m in (CAUSAL, BASE) for v in m.values()
                      for n in ([v] if isinstance(v, str) else v)}
    if kind not in CAUSAL:
        raise ValueError(f"{named}, not a causal language model: transformers has no causal-LM "
                         f"class for {kind} (model.name=hf trains AutoModelForCausalLM)")
    if archs and not any(a in causal_classes or a.endswith(("ForCausalLM", "LMHeadModel"))
                         for a in archs):
        raise ValueError(f"{named}, not a causal language model: model.name=hf trains next-token "
                         "prediction, which this architecture was not made for")
    bidirectional = kind in MASKED and not (config.is_decoder or config.is_encoder_decoder
                                            or getattr(config, "causal", False))
    if bidirectional:
        raise ValueError(f"{named}, a bidirectional encoder, not a causal language model: each "
                         "position would see the token it predicts, so its loss means nothing; "
                         "set is_decoder: true in its config.json to train it as a decoder")


def build_hf_model(model_cfg: ModelConfig) -> nn.Module:
    """The causal LM of `model_cfg.path`, in fp32, built on the meta device and marked with where
    its values come from (hfshards.py): `build_model` then gives it memory and values whole,
    or `train.sharding=fsdp` each rank its rows. QLoRA, and weights stored under names the model
    does not use, load as before (`from_pretrained`, whole)."""
    transformers = require_transformers()
    config, folder = load_hf_config(model_cfg)
    auto = transformers.AutoModelForCausalLM
    common = dict(trust_remote_code=model_cfg.trust_remote_code, dtype=torch.float32)
    on_meta = torch.empty(0).device.type == "meta"
    weights = has_weights(folder)
    if weights and not on_meta and model_cfg.lora.load_in_4bit:  # QLoRA: 4 bits as it loads (lora.py)
        model = auto.from_pretrained(folder, config=config, local_files_only=True,
                                     **common, **qlora_load_kwargs())
        return _ready(model)
    if on_meta:  # the caller's meta device (build_meta_model): not a second context inside it
        model = auto.from_config(config, **common)
    else:
        with torch.device("meta"):
            model = auto.from_config(config, **common)
    source = str(folder) if weights else ""
    if weights and missing_from_files(model, stored_tensors(folder)):
        if on_meta:
            return _ready(model)  # the driver's shapes: no values to say where from
        model = auto.from_pretrained(folder, config=config, local_files_only=True, **common)
        return _ready(model)
    setattr(model, SOURCE_ATTR, source)
    return _ready(model)


def _ready(model: nn.Module) -> nn.Module:
    model.tie_weights()  # tied embeddings stay tied, also after a build on the meta device
    model.train()
    return model


def qlora_load_kwargs() -> dict[str, Any]:
    """What `from_pretrained` adds for QLoRA (model.lora.load_in_4bit, lora.py): the weights
    quantised to NF4 with double quantisation (QLoRA's recipe), computing in bf16, loaded onto
    this process's GPU (Ray Train sets it) rather than first into host memory whole."""
    if not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit "
                         "kernels do not train on CPU")
    from transformers import BitsAndBytesConfig

    from elastic_train.training.optim import import_bitsandbytes

    import_bitsandbytes()  # before transformers imports it: with the Hub off
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    return {"quantization_config": quantization, "dtype": torch.bfloat16,
            "device_map": {"": torch.cuda.current_device()}}
