"""The models: the embedded byte-level GPT, a Hugging Face causal LM, or a user's `nn.Module`.

`build_model(model_cfg, max_seq_len, model_fn)` is the one way the driver and the workers build a
model: `model_fn` (Python API) if given, else `model_cfg.name`: `gpt`, `hf` (see `hf.py`) or an
import path "package.module:function" called with `vocab_size`, `max_seq_len` and `model_cfg.kwargs`.
Initialisation draws from the global torch RNG, so callers fix it with `torch.manual_seed` before
building: every rank then builds the same weights without a broadcast. Nothing here knows the loss;
that is `losses.py`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from elastic_train.config import GPT_KWARGS, ConfigError, ModelConfig, gpt_config

BYTE_VOCAB = 256  # the vocabulary of byte-tokenized data (prepare without --tokenizer)
ModelFn = Callable[..., nn.Module]
logger = logging.getLogger("elastic_train")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; the mask also hides right padding from real tokens."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LN, head tied to the embedding."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int, vocab_size: int = BYTE_VOCAB) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.gradient_checkpointing = False
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.n_layer = cfg.n_layer
        if not self.wte.weight.is_meta:  # built directly, not by build_gpt: initialise in place
            fill_initial_values(self)

    def initial_value(self, name: str, shape: torch.Size) -> torch.Tensor:
        """The initial value of parameter `name`, whole, in fp32, drawn from the global torch RNG.

        `materialize` calls it once per parameter in `named_parameters()` order, unsharded and
        sharded alike, so both draw the same stream and a rank keeps the rows it owns of values
        equal to the bit to an unsharded build's; only one parameter is whole at a time. GPT-2's
        scheme: N(0, 0.02), the projections that write into the residual stream scaled down by
        sqrt(2 * n_layer) so the stream's variance does not grow with depth; layer norms 1 and 0.
        """
        owner, _, kind = name.rpartition(".")
        if kind == "bias":
            return torch.zeros(shape, device="cpu")
        if isinstance(self.get_submodule(owner), nn.LayerNorm):
            return torch.ones(shape, device="cpu")
        residual = name.endswith(("attn.proj.weight", "mlp.2.weight"))
        std = 0.02 / math.sqrt(2 * self.n_layer) if residual else 0.02
        return torch.empty(shape, device="cpu").normal_(mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor[B, T] -> logits [B, T, vocab]."""
        t = tokens.shape[1]
        if t > self.max_seq_len:
            raise ValueError(
                f"sequence of {t} tokens is longer than max_seq_len={self.max_seq_len}"
            )
        pos = torch.arange(t, device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)  # non-reentrant: works under DDP
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block's activations in backward instead of keeping them."""
        self.gradient_checkpointing = True


def build_gpt(model_cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    """The byte-level GPT of `model_cfg` (its `kwargs` over the fields of the same names), with
    positions up to `max_seq_len`."""
    unknown = sorted(set(model_cfg.kwargs) - set(GPT_KWARGS))
    if unknown:
        raise ValueError(f"model.kwargs: {', '.join(unknown)} not known to model.name=gpt (the "
                         f"embedded GPT takes {', '.join(GPT_KWARGS)})")
    with torch.device("meta"), _SkipValueWritesOnMeta():
        model = GPT(gpt_config(model_cfg), max_seq_len, model_cfg.vocab_size or BYTE_VOCAB)
    if not building_on_meta():
        materialize(model, torch.device("cpu"))
    return model


def building_on_meta() -> bool:
    """Whether the caller builds on the meta device (`build_meta_model`)."""
    return torch.empty(0).device.type == "meta"


def can_materialize(model: nn.Module) -> bool:
    """Whether a meta build of the model can be given its values a parameter at a time, or a
    rank's rows at a time: it draws each parameter's initial value on its own
    (`initial_value(name, shape)`, as the embedded GPT does), or it is a transformers model (or
    LoRA on one with weights) whose values come from its files or config (hfshards.py)."""
    if callable(getattr(model, "initial_value", None)):
        return True
    from elastic_train.training.hfshards import values_source
    from elastic_train.training.lora import LoraModel, lora_values_source

    if isinstance(model, LoraModel):
        return lora_values_source(model) is not None
    return values_source(model) is not None


def materialize(root: nn.Module, device: torch.device, model: nn.Module | None = None) -> None:
    """Give a meta-built `root` memory on `device` and `model`'s initial values (`model`: the
    module with `initial_value`, `root` itself or inside it): one whole parameter at a time, in
    `model.named_parameters()` order, from the global torch RNG. A parameter FSDP sharded
    (a DTensor) keeps only this rank's rows of each whole value, so a sharded build holds the
    largest parameter whole at most, and its rows equal an unsharded build's to the bit."""
    ties = []  # (module, name, the module and name it shares its parameter with)
    first: dict[int, tuple[nn.Module, str]] = {}
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                ties.extend([(module, name, first[id(p)])] if id(p) in first else [])
                first.setdefault(id(p), (module, name))
    root.to_empty(device=device)
    for module, name, (owner, owner_name) in ties:  # to_empty unties plain tensors: tie again
        setattr(module, name, getattr(owner, owner_name))
    fill_initial_values(model or root)


def fill_initial_values(model: nn.Module) -> None:
    """`model.initial_value` of each parameter, in order, into its memory (`materialize`); a
    transformers model's values from its files or config (hfshards.fill_hf)."""
    from elastic_train.training.shardfiles import is_dtensor, row_range

    if not callable(getattr(model, "initial_value", None)):
        from elastic_train.training.hfshards import fill_hf
        from elastic_train.training.lora import LoraModel, fill_lora

        fill_lora(model) if isinstance(model, LoraModel) else fill_hf(model)
        return
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = model.initial_value(name, p.shape)
            if is_dtensor(p):
                rank, ranks = p.device_mesh.get_local_rank(), p.device_mesh.size()
                start, end = row_range(p.shape[0], rank, ranks)
                p.to_local().copy_(whole[start:end])
            else:
                p.copy_(whole)


def _build_hf(model_cfg: ModelConfig, max_seq_len: int) -> nn.Module:
    from elastic_train.training.hf import build_hf_model

    return build_hf_model(model_cfg)


MODELS: dict[str, Callable[[ModelConfig, int], nn.Module]] = {"gpt": build_gpt, "hf": _build_hf}


def import_factory(path: str) -> ModelFn:
    """The function named by "package.module:function"; ValueError naming what did not import."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's module's
        raise ValueError(f"model.name: cannot import module '{module_name}' of {path!r}: "
                         f"{type(exc).__name__}: {exc} (is its folder on PYTHONPATH?)") from None
    factory: Any = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"model.name: module '{module_name}' has no attribute '{attr}'")
    if not callable(factory):
        raise ValueError(f"model.name: {path!r} is not callable")
    return factory


class FactoryError(ValueError):
    """A user's factory (model_fn, or model.name's import path) raised while building."""


def call_factory(factory: ModelFn, model_cfg: ModelConfig, max_seq_len: int, shown: str) -> nn.Module:
    """`factory(vocab_size=, max_seq_len=, **kwargs)`, checked to return an nn.Module;
    FactoryError naming the factory and what it raised. `vocab_size` and `max_seq_len` come from
    model.vocab_size and data.max_seq_len (the checks of the data against the model use them),
    never from model.kwargs: ConfigError there."""
    given = sorted({"vocab_size", "max_seq_len"} & set(model_cfg.kwargs))
    if given:
        key = "model.vocab_size" if given[0] == "vocab_size" else "data.max_seq_len"
        raise ConfigError(f"model.kwargs.{given[0]}: the factory gets {given[0]} from {key}, "
                          f"which the data is checked against: set {key} instead")
    kwargs = {"vocab_size": model_cfg.vocab_size or BYTE_VOCAB, "max_seq_len": max_seq_len,
              **model_cfg.kwargs}
    try:
        model = factory(**kwargs)
    except Exception as exc:  # noqa: BLE001 - reported with the factory's name
        raise FactoryError(f"model: {shown}({', '.join(kwargs)}) raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: {shown} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def build_model(model_cfg: ModelConfig, max_seq_len: int, model_fn: ModelFn | None = None) -> nn.Module:
    """The model to train: `model_fn` if given, else the one `model_cfg.name` names.

    ValueError (one message naming the culprit) for an unknown name, an import path that does
    not import, a factory that raises or returns something that is not a module.
    """
    if model_fn is not None:
        shown = getattr(model_fn, "__qualname__", repr(model_fn))
        model = call_factory(model_fn, model_cfg, max_seq_len, f"model_fn {shown}")
    elif model_cfg.name in MODELS:
        model = MODELS[model_cfg.name](model_cfg, max_seq_len)
    elif ":" in model_cfg.name:
        model = call_factory(import_factory(model_cfg.name), model_cfg, max_seq_len, model_cfg.name)
    else:
        raise ValueError(f"model.name: unknown model {model_cfg.name!r} (known: "
                         f"{', '.join(sorted(MODELS))}, or an import path 'package.module:function')")
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if model_cfg.lora.r > 0:  # the base frozen, adapters trained (lora.py)
        from elastic_train.training.hfshards import SOURCE_ATTR
        from elastic_train.training.lora import apply_lora

        if getattr(model, SOURCE_ATTR, None) == "" and not building_on_meta():
            materialize(model, torch.device("cpu"))  # a base from its config: hashed whole, as built
        if any(p.is_meta for p in model.parameters()) and not building_on_meta():
            with torch.device("meta"), _SkipValueWritesOnMeta():  # adapters on meta too, as the
                model = apply_lora(model, model_cfg)  # driver's build: no draws before the fill
        else:
            model = apply_lora(model, model_cfg)
    if not building_on_meta() and any(p.is_meta for p in model.parameters()) and can_materialize(model):
        materialize(model, torch.device("cpu"))  # hf models are built on meta (hf.build_hf_model)
    return model


# In-place writes of values (what initialisation does): a meta tensor holds no values, so on one they
# change nothing; its shape stays. torch.nn.init's functions and the tensor methods alike.
_VALUE_WRITES = frozenset({
    "normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "log_normal_",
    "geometric_", "cauchy_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "add_", "sub_",
    "mul_", "div_",
})


class _SkipValueWritesOnMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _VALUE_WRITES:
            target = args[0] if args else kwargs.get("tensor")  # a method's self, init's `tensor`
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_meta_model(model_cfg: ModelConfig, max_seq_len: int,
                     model_fn: ModelFn | None = None) -> nn.Module:
    """`build_model` on the meta device: parameters with their shapes and no memory, for the
    driver's checks and the worker's fit check. Initialisation is skipped: it would write no
    values, and some of its kernels on meta tensors run through torch._refs, whose first use
    imports torch._dynamo (1.2 s of the command's start-up).

    A user's factory (model_fn, or model.name's import path) that raises on the meta device, as
    `from_pretrained` does inside it or `.item()` on a meta tensor, is built once for real on the
    CPU instead, from the same RNG state: that model, with memory and values, is what the checks
    read and what the worker trains (`build_training` does not build it again). Only what the
    real build raises too is the factory's fault (FactoryError). The embedded GPT and `hf` are
    ours and always build on meta: no rank holds them whole before the fit check (issue 37)."""
    rng = torch.get_rng_state()
    try:
        with torch.device("meta"), _SkipValueWritesOnMeta():
            return build_model(model_cfg, max_seq_len, model_fn)
    except FactoryError as exc:
        on_meta = exc
    torch.set_rng_state(rng)  # the weights a build that never tried meta would draw
    model = build_model(model_cfg, max_seq_len, model_fn)
    logger.info("%s; on the meta device only: built on the CPU for the checks instead", on_meta)
    return model


def is_meta_model(model: nn.Module) -> bool:
    """Whether `build_meta_model` gave shapes without memory (False: a user's factory that
    refused the meta device, built for real)."""
    return any(p.is_meta for p in model.parameters())


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute activations in backward, non-reentrant (reentrant checkpointing breaks DDP)."""
    hf_new = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if hf_new is not None:
        hf_new(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"model.gradient_checkpointing: {type(model).__name__} has no "
                         "gradient_checkpointing_enable()")
    if "gradient_checkpointing_kwargs" in inspect.signature(enable).parameters:  # transformers 4
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        enable()


def base_model_of(model: nn.Module) -> nn.Module:
    """The model itself, or a LoRA model's base (`lora.LoraModel`: peft's model, the adapters in
    place), whose embeddings and config say what it embeds."""
    peft = getattr(model, "peft", None)
    return peft.get_base_model() if peft is not None else model


def input_embedding_rows(model: nn.Module, vocab_size: int | None = None) -> int | None:
    """How many token ids the model embeds: its input embedding's rows (None if it has none).

    The input embedding is what `get_input_embeddings()` returns when the model has it (a
    transformers model, or a user's that says so); else, of its `nn.Embedding`s, one of
    `vocab_size` rows (what the factory was given) when there is one, else the largest. Not the
    first declared: a position table declared before the token table would be taken for it.
    The largest errs towards accepting: a token table smaller than the position table, in a
    model that ignores vocab_size, goes unseen here and fails at its first out-of-range id."""
    model = base_model_of(model)  # LoRA's wrapper has neither embeddings nor config of its own
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    rows = [m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)]
    if not rows:
        return None
    return vocab_size if vocab_size in rows else max(rows)


def token_loss_sum(
    model: nn.Module, tokens: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of right-padded rows, and the number of real targets
    (`losses.causal_lm_loss` on the batch of `tokens` and `lengths`)."""
    from elastic_train.data.batches import make_batch
    from elastic_train.training.losses import (
        causal_lm_loss,
    )

    return causal_lm_loss(model, make_batch(tokens, lengths.to(tokens.device)))


def missing_module_classes(model: nn.Module, names: list[str],
                           key: str = "model.shard_modules") -> str | None:
    """Why `key` (model.shard_modules, train.compile_modules) = `names` does not fit `model`:
    the class names of which it has no module, and the classes it has; None when every name
    matches a module. The driver checks it on the meta model (preflight), the worker again
    before sharding or compiling (sharding.find_blocks, compile.compile_model)."""
    classes = {type(m).__name__ for m in model.modules() if m is not model}
    missing = [name for name in names if name not in classes]
    if not missing:
        return None
    return (f"{key}: no module of class {', '.join(missing)} in "
            f"{type(model).__name__} (its classes: {', '.join(sorted(classes))})")


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def matmul_parameters(model: nn.Module) -> int:
    """The weights `model` multiplies by (PaLM appendix B's N): every parameter of two or more
    dimensions once, but an embedding's table only when it is also an output layer's weight (a
    tied head); a lookup table (an untied input embedding, positions), norms and biases do no
    matmul. For the embedded GPT: 12 d^2 a layer + the vocab x d head, its closed form."""
    heads = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen or p.dim() < 2:
                continue
            seen.add(id(p))
            if isinstance(module, nn.Embedding) and id(p) not in heads:
                continue
            total += p.numel()
    return total


def attention_shape(model_cfg: ModelConfig, model: nn.Module | None) -> tuple[int, int] | None:
    """(layers, width) of the attention: the embedded GPT's, or a transformers config's
    (`num_hidden_layers`, `hidden_size`, on the model or a module inside it, as under LoRA);
    None for a model that says neither."""
    if model_cfg.name == "gpt":
        gpt = gpt_config(model_cfg)
        return gpt.n_layer, gpt.d_model
    for module in model.modules() if model is not None else ():
        config = getattr(module, "config", None)
        layers, width = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
        if isinstance(layers, int) and isinstance(width, int):
            return layers, width
    return None


def model_flops_per_token(model_cfg: ModelConfig, seq_len: int | None,
                          model: nn.Module | None = None) -> float:
    """Training FLOPs per token, one convention for every model: PaLM appendix B, 6 N + 12 L d T.
    N: `matmul_parameters`; 12 L d T: the attention's score and value matmuls over a context of
    `seq_len`, forward and backward, with L and d from `attention_shape` (left out for a model
    that has none, or with no `seq_len`, a config the driver did not resolve: a lower bound).
    The embedded GPT's is its closed form (no model needed):
    6 (12 L d^2 + V d) + 12 L d T. Frozen weights (LoRA's base) count as trained ones: their
    weight-gradient matmuls are not run, so there it is an upper bound."""
    shape = attention_shape(model_cfg, model)
    if model_cfg.name == "gpt":
        n_layer, d = shape
        n_matmul = 12 * n_layer * d * d + (model_cfg.vocab_size or BYTE_VOCAB) * d
    else:
        n_matmul = matmul_parameters(model) if model is not None else 0
    attention = 12.0 * shape[0] * shape[1] * seq_len if shape is not None and seq_len else 0.0
    return 6.0 * n_matmul + attention
