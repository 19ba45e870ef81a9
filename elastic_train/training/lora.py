"""LoRA fine-tuning (`model.lora.r > 0`): the model's weights frozen, low-rank adapters (peft)
trained, and only the adapters in the checkpoint.

Why a wrapper whose `state_dict` holds the adapters alone: everything that saves, restores,
reduces and optimizes already goes through `state_dict()` and the parameters that require a
gradient (`ExactGradSum`, the optimizer's groups, the checkpoint's shards and signature). With
the frozen base left out of the state dict, a LoRA checkpoint holds the adapters (and their
optimizer state) only, and every guarantee of a full fine-tune holds for them unchanged: the
exact reduction sums only their gradients, so a step is the same to the bit at any world size.

The base is rebuilt from its own source on every start (the hf folder, the seed), so the
checkpoint must know which base its adapters belong to: the state dict carries `BASE_KEY`, the
SHA-256 of the base (basehash.py: of the folder's weights as stored, before any cast or
quantisation, cached per node; or of the state dict as built from the seed), and loading
adapters onto a base of another hash is refused, naming both. `model.base_dtype=bf16` casts the
frozen base to bf16; peft keeps the adapters in fp32 (its `autocast_adapter_dtype`), so their
gradients and AdamW state are fp32.

With train.sharding=fsdp (lorashard.py): the frozen base is what is large, so it alone is
sharded: FSDP2 on each block and the root with the adapters as `ignored_params`, each rank
holding rows [start, end) of every base tensor, in the base's own dtype, gathered in that dtype
for forward and backward (a MixedPrecisionPolicy with no cast). sharding.py's float64 master
shards exist for the exact sum of gradients and the update; a frozen weight has neither, so the
base gets none: a bf16 base stays 2 bytes a parameter over W, and computes in bf16 exactly as
the unsharded LoRA run does (gathering reassembles the same values). The adapters stay whole on
every rank (a fraction of a percent of the parameters): their gradients are reduced as
without sharding (`LoraShardedReduce`: ExactGradSum's float64 sum, or one fp32 all-reduce for
`ddp`), their AdamW state is whole on every rank (16 bytes an adapter parameter, plus 8 for the
exact sum), and the checkpoint is an unsharded run's (sharding.py saves and loads a model
without sharded tensors as checkpoint.py does). So a step is the unsharded LoRA step to the bit
at any world size, a checkpoint resumes at any size in either sharding mode, and export reads
whole adapters. Each rank keeps its own rows of the base it built (a base of safetensors files
built on the meta device, each rank reading only its rows: hfshards.py), so the ranks' base
hashes are compared before the first step.

QLoRA (`model.lora.load_in_4bit`, GPU only): transformers loads the folder's weights quantised
to 4-bit NF4 by bitsandbytes (hf.qlora_load_kwargs, on this worker's GPU), peft's
`prepare_model_for_kbit_training` freezes the base and casts what is not 4-bit to fp32, and
the adapters (fp32) are added as on the CPU path; the base's hash is of the folder's weights
before quantisation. Refused on CPU (bitsandbytes' 4-bit training kernels need CUDA), with
fsdp (validate.py: 4-bit weights cannot be cut into row shards), and on a folder without
weights (nothing to quantise: `check_qlora_inputs` on the driver, before any worker builds the
base; `check_qlora` on the worker). The memory check counts the base as bitsandbytes stores it
(`qlora_quantised_weights`, memory.py), not at the meta model's fp32 size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from elastic_train.config import Config, ConfigError, ModelConfig
from elastic_train.training.basehash import folder_hash, state_dict_hash
from elastic_train.training.optim import import_bitsandbytes

BASE_KEY = "lora_base_sha256"  # the base's hash, a uint8 tensor of 32 bytes in the state dict
LORA_EXTRA_HINT = "pip install 'elastic_train[lora]'"


def require_peft() -> Any:
    """The peft module; ValueError naming the extra when it is missing. bitsandbytes, which peft
    imports to wrap a model, is imported first with the Hub off (optim.import_bitsandbytes)."""
    import_bitsandbytes()
    try:
        import peft
    except ImportError as exc:
        raise ValueError(f"model.lora needs peft, which is not installed ({exc}): "
                         f"{LORA_EXTRA_HINT}") from None
    return peft


def base_hash(model: nn.Module, model_cfg: ModelConfig) -> bytes:
    """The base's identity (basehash.py): of the weights in model.path when the model was
    loaded from them, else of the state dict as built."""
    if model_cfg.name == "hf" and not any(p.is_meta for p in model.parameters()):
        from elastic_train.training.hf import local_model_folder

        digest = folder_hash(local_model_folder(str(model_cfg.path)))
        if digest is not None:
            return digest
    return state_dict_hash(model)


class LoraModel(nn.Module):
    """A peft LoRA model whose state dict is its trainable adapters and the base's hash.

    `forward(tokens)` returns the peft model's output (logits in `.logits` for a transformers
    model, what the base returns for any other `nn.Module`); `peft` is the `PeftModel` itself
    (export saves or merges it). A transformers model is called as one (`input_ids=`, no KV
    cache); any other module with the tokens alone, as the loop calls a model without LoRA."""

    def __init__(self, peft_model: nn.Module, digest: bytes, transformers_call: bool = True) -> None:
        super().__init__()
        self.peft = peft_model
        self.transformers_call = transformers_call
        self.register_buffer(BASE_KEY, torch.tensor(list(digest), dtype=torch.uint8))

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        if self.transformers_call:
            return self.peft(input_ids=tokens, use_cache=False, **kwargs)
        return self.peft.get_base_model()(tokens, **kwargs)

    def _kept(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad} | {BASE_KEY}

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The adapters and the base's hash only (the frozen base is rebuilt, never saved)."""
        kept = self._kept()
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return type(full)((k, v) for k, v in full.items() if k[len(prefix):] in kept)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load adapters saved by `state_dict`, refusing those of another base (ConfigError)."""
        saved = state_dict.get(BASE_KEY)
        ours = getattr(self, BASE_KEY)
        if saved is not None and not torch.equal(saved.to(ours.device, ours.dtype), ours):
            # ConfigError: a restart would fail the same way, so the run stops with this reason
            raise another_base_error(bytes(saved.tolist()), bytes(ours.tolist()))
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in missing if name in self._kept()]
        if strict and (missing or unexpected):
            raise RuntimeError(f"LoRA state dict: missing {missing[:5]}, unexpected "
                               f"{list(unexpected)[:5]}")
        return missing, unexpected


def another_base_error(saved: bytes, ours: bytes, whose: str = "the checkpoint's",
                       fix: str = "resume on the base model.path it was trained on") -> ConfigError:
    """The one line that refuses adapters whose recorded base hash (`saved`) is not the hash of
    the base they would load onto (`ours`): a run's checkpoint, or an adapter export's
    (export.py, `BASE_HASH_FILE`)."""
    return ConfigError(f"{whose} LoRA adapters were trained on another base model (base sha256 "
                       f"{saved.hex()[:16]}..., this one's {ours.hex()[:16]}...): {fix}")


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> LoraModel:
    """`model` frozen (hashed, then cast to `model.base_dtype`, or prepared for k-bit training
    when QLoRA loaded it in 4 bits) with LoRA adapters of `model.lora` on it. ValueError naming
    the key for a missing peft, no module matching `target_modules`, a target whose weight is
    tied to another parameter, or QLoRA without a GPU or without weights to quantise."""
    peft = require_peft()
    lora = model_cfg.lora
    on_meta = any(p.is_meta for p in model.parameters())  # the driver's shape check
    if lora.load_in_4bit and not on_meta:
        check_qlora(model, model_cfg)
    digest = base_hash(model, model_cfg)
    if lora.load_in_4bit and not on_meta:
        # freezes the base, casts what is not 4-bit to fp32; activation checkpointing, if asked
        # for, build_model turned on already (non-reentrant: no input-grad hook needed)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif model_cfg.base_dtype == "bf16":
        model.to(torch.bfloat16)
    settings = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                               target_modules=list(lora.target_modules) or None)
    try:
        wrapped = peft.get_peft_model(model, settings, autocast_adapter_dtype=True)
    except ValueError as exc:
        if lora.target_modules:
            raise ValueError(f"model.lora.target_modules: {' '.join(str(exc).split())[:300]}") \
                from None
        names = linear_names(model)
        raise ValueError(
            "model.lora.target_modules is empty and peft has no default for this model (it has "
            "defaults for the transformers model types it knows): name the modules to adapt, "
            f"e.g. model.lora.target_modules='[{', '.join(names[:2])}]' (this model's Linear "
            f"layers: {', '.join(names)})") from None
    check_untied_targets(wrapped, model_cfg)
    for _, p in wrapped.named_parameters():  # adapters in fp32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    # transformers models take input_ids= (peft's causal-LM wrapper expects it); the embedded
    # GPT and a user's module take the tokens as their one positional argument
    transformers_call = callable(getattr(model, "prepare_inputs_for_generation", None))
    return LoraModel(wrapped, digest, transformers_call)


def tied_target(peft_model: nn.Module) -> tuple[str, str] | None:
    """(a module LoRA adapts whose weight is the same tensor as another parameter, that
    parameter's name), or None. Such a weight is shared: the embedded GPT's head is its input
    embedding (model.py), as is a transformers model's with `tie_word_embeddings`. Training
    adapts only one use of it, but merging (peft's `merge_and_unload`, export --merge) writes
    W + BA into the shared tensor, so the other use changes too: the merged model is not the
    trained one."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    names: dict[int, list[str]] = {}
    for name, p in peft_model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name.removeprefix(prefix))
    for name, module in peft_model.named_modules():
        weight = getattr(getattr(module, "base_layer", None), "weight", None)
        if isinstance(module, LoraLayer) and isinstance(weight, nn.Parameter):
            short = name.removeprefix(prefix)
            others = [n for n in names.get(id(weight), []) if not n.startswith(f"{short}.")]
            if others:
                return short, others[0]
    return None


def check_untied_targets(peft_model: nn.Module, model_cfg: ModelConfig) -> None:
    """ConfigError naming model.lora.target_modules when a module it adapts has a tied weight
    (`tied_target`). Runs in every build, so on the driver's meta build too (check_inputs),
    before Ray starts."""
    tied = tied_target(peft_model)
    if tied is None:
        return
    module, other = tied
    untie = (" (or, to adapt it, point model.path at a config.json with "
             "tie_word_embeddings=false)" if model_cfg.name == "hf" else "")
    raise ConfigError(
        f"model.lora.target_modules: {module}'s weight is tied to {other} (one tensor): merging "
        f"the adapters (export --merge) would add their update to {other} as well and change "
        f"the model; leave {module} out of model.lora.target_modules{untie}")


def linear_names(model: nn.Module) -> list[str]:
    """The names `target_modules` can give this model's Linear layers, in model order, each
    once: the last component of each Linear's name, or the last two where the last is a number
    (`mlp.0`). A Linear whose weight is tied to another parameter is left out: it cannot be a
    target (`check_untied_targets`)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and uses.get(id(module.weight), 0) == 1:
            parts = name.split(".")
            short = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]
            if short not in names:
                names.append(short)
    return names


def lora_values_source(model: LoraModel) -> str | None:
    """The folder of safetensors files a meta-built LoRA model's base is read from
    (`fill_lora`), or None: a base without weights is built whole (its hash is of the whole
    base as built)."""
    from elastic_train.training.hfshards import values_source

    return values_source(model.peft.get_base_model()) or None


def fill_lora(model: LoraModel) -> None:
    """A meta-built LoRA model given memory (model.materialize): the base's hash from its files,
    this rank's rows of the base read from them, then peft's initialisation of the whole
    adapters (hfshards.py)."""
    from elastic_train.training.hfshards import fill_adapters, fill_from_files

    folder = lora_values_source(model)
    digest = folder_hash(Path(folder))  # its read buffers gone before the rows are read
    getattr(model, BASE_KEY).copy_(torch.tensor(list(digest), dtype=torch.uint8))
    fill_from_files(model.peft.get_base_model(), folder)
    fill_adapters(model)


def check_qlora(model: nn.Module, model_cfg: ModelConfig) -> None:
    """QLoRA's base must have come out of from_pretrained in 4 bits (ValueError naming why not)."""
    if not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit "
                         "kernels do not train on CPU")
    if not getattr(model, "is_loaded_in_4bit", False):
        raise ValueError(f"model.lora.load_in_4bit: model.path '{model_cfg.path}' holds no weights "
                         "to quantise (QLoRA fine-tunes a pretrained base; a base built from its "
                         "config would be random numbers rounded to 4 bits)")


def check_qlora_inputs(cfg: Config) -> None:
    """On the driver: QLoRA (model.lora.load_in_4bit) quantises pretrained weights, so a model.path
    without weight files is refused here, in one ConfigError naming both keys, instead of on each
    worker (`check_qlora`) after it built the whole fp32 base from the config. A URI's folder is
    asked for its weight files' names, not copied."""
    if not cfg.model.lora.load_in_4bit or cfg.model.name != "hf" or not cfg.model.path:
        return
    from elastic_train.training.hf import WEIGHT_FILES, has_weights

    path = str(cfg.model.path)
    if "://" in path:
        import pyarrow.fs as pafs

        try:
            fs, root = pafs.FileSystem.from_uri(path)
            infos = fs.get_file_info([f"{root.rstrip('/')}/{name}" for name in WEIGHT_FILES])
        except (OSError, ValueError):  # storage that does not answer here: the workers check
            return
        found = any(info.type == pafs.FileType.File for info in infos)
    else:
        found = has_weights(Path(path).expanduser())
    if not found:
        raise ConfigError(
            f"model.lora.load_in_4bit (QLoRA) with model.path '{path}', which holds no weights "
            f"({' or '.join(WEIGHT_FILES)}): QLoRA fine-tunes a pretrained base quantised to 4 "
            "bits, and a base built from its config would be random numbers rounded to 4 bits; "
            "point model.path at a folder with the pretrained weights, or drop "
            "model.lora.load_in_4bit")


def qlora_quantised_weights(base: nn.Module) -> list[nn.Parameter]:
    """The frozen weights QLoRA's `from_pretrained` (hf.qlora_load_kwargs) stores in 4 bits, found
    on the transformers model `base` (meta or not, with or without peft's layers): the weight of
    every `nn.Linear` (and transformers' `Conv1D`) but those transformers keeps in full precision.
    Read from transformers 5.25's bnb 4-bit quantizer (quantizers/base.py
    `get_keys_to_not_convert`, `HfQuantizer.get_modules_to_not_convert`): the output embeddings
    (lm_head), tied weights, the last parameter's module and the model's `_keep_in_fp32_modules`
    (we pass no `llm_int8_skip_modules`); matched as `should_convert_module` does. Biases stay in
    the compute dtype (and prepare_model_for_kbit_training casts them to fp32)."""
    try:
        from transformers.pytorch_utils import Conv1D
        from transformers.quantizers.base import get_keys_to_not_convert
        from transformers.quantizers.quantizers_utils import should_convert_module

        kept = list(get_keys_to_not_convert(base))
    except (ImportError, AttributeError, TypeError):  # another transformers: its head and fp32 list
        from transformers.pytorch_utils import Conv1D

        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        kept = [name for name, module in base.named_modules() if head is not None and module is head]

        def should_convert_module(name: str, patterns: list[str]) -> bool:
            return not any(name == key or name.startswith(key + ".") or name.endswith(key)
                           for key in patterns)
    kept += list(getattr(base, "_keep_in_fp32_modules", None) or [])
    weights = []
    for name, module in base.named_modules():
        name = name.removesuffix(".base_layer")  # peft's LoRA layer wraps the quantised Linear
        if (type(module) is nn.Linear or isinstance(module, Conv1D)) \
                and not module.weight.requires_grad and should_convert_module(name, kept):
            weights.append(module.weight)
    return weights
