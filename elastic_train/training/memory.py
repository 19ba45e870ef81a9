"""What one rank needs to train a model, from its meta shapes, against what the rank can have.

The driver (preflight, before Ray starts) and every worker (before it materializes a parameter)
call `check_fits_memory` on the model built on the meta device: a model that cannot fit is
refused in seconds with one line naming the figures and what would fit, instead of being built in
host memory until the OS or Ray's memory monitor kills the process minutes later.

Per rank, AdamW (optim.py and sharding.py give the bytes per parameter):
- unsharded: every trainable parameter's weight (4), gradient (4), optimizer state (8 adamw,
  2 adamw8bit), reduction buffer (exact: its float64 sum, 8; ddp: the fp32 buckets, 4) and a
  communication hook's state; a frozen parameter (LoRA's base) its own bytes only.
- fsdp: 24 bytes a parameter over W (exact: float64 master and gradient, float32 moments) or 16
  over W (ddp); LoRA's frozen base over W, its adapters whole. Plus, while a block
  runs, that block gathered whole with its gradient (8 bytes a parameter of the largest block).
- activations, a stated estimate: for a transformer of L layers and width d, about 34 bytes per
  token per layer per unit of width in 16-bit (Korthikanti et al., 2022, "Reducing Activation
  Recomputation"), so 68 in fp32 and 34 with bf16/fp16 autocast, for one micro-batch of
  data.micro_batch_tokens tokens; with gradient checkpointing one layer's worth plus each layer's
  input; plus the logits and their gradient (tokens x vocab x 4 bytes, twice). Models that do not
  say L and d (user modules) get the logits term alone.

QLoRA (model.lora.load_in_4bit): the meta model's base is fp32 (nothing is quantised on the
meta device), so it is counted as bitsandbytes will store it: the weight of each Linear it
quantises (lora.qlora_quantised_weights) at `NF4_BYTES_PER_PARAM`, every other frozen parameter
(embeddings, norms, lm_head, biases) in fp32, the dtype prepare_model_for_kbit_training casts them
to; a 70B Llama's base is then about 0.54 bytes a parameter (35 GiB), not 4 (257 GiB). The fit
advice names no fsdp for it (refused with a 4-bit base, validate.py).

What a rank can have: the device's memory on a GPU; on CPU the node's memory times Ray's memory
monitor threshold (0.95: the fraction at which it kills workers) over the ranks sharing that node.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from elastic_train.config import Config, batch_tokens
from elastic_train.training.optim import (
    COMM_HOOK_STATE_BYTES,
    OPTIMIZER_STATE_BYTES,
    REDUCTION_BUFFER_BYTES,
)

GiB = 2**30
RAY_MEMORY_THRESHOLD = 0.95  # Ray's memory monitor kills workers above this share of a node's memory
KORTHIKANTI_BYTES = 34  # activation bytes per token, layer and unit of width, 16-bit
# NF4 with double quantisation (hf.qlora_load_kwargs): 4 bits a weight, one absmax per block of 64
# weights quantised to 8 bits, and one fp32 absmax per 256 of those (bitsandbytes 0.50
# functional.quantize_4bit: blocksize 64, nested quantize_blockwise blocksize 256): 4 + 8/64 +
# 32/(64*256) = 4.127 bits, the 0.127 bits of state of Dettmers et al., 2023 ("QLoRA", section 3).
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8
QLORA_OTHER_BYTES = 4  # the rest of a QLoRA base: fp32 after prepare_model_for_kbit_training


class ModelTooLargeError(RuntimeError):
    """The model cannot fit the memory a rank has: the run stops at once (a restart would not
    help)."""


@dataclass(frozen=True)
class ModelShapes:
    """What the memory estimate reads of a (meta) model."""

    trainable: int  # trainable parameters
    frozen_bytes: float  # bytes of the frozen ones (LoRA's base), as they are stored to train
    largest_block: int  # parameters of the largest block FSDP gathers whole
    n_layer: int | None = None  # for the activation estimate
    width: int | None = None
    vocab: int | None = None
    lora: bool = False
    frozen_params: int = 0
    qlora: bool = False  # a 4-bit base (model.lora.load_in_4bit): no fsdp

    @property
    def total(self) -> int:
        return self.trainable + self.frozen_params


def model_shapes(model: nn.Module, cfg: Config) -> ModelShapes:
    """Counts from a model's parameters (meta or not: only shapes and dtypes are read)."""
    from elastic_train.training.lora import LoraModel
    from elastic_train.training.sharding import find_blocks

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    try:
        blocks = find_blocks(model, cfg.model.shard_modules)
    except ValueError:
        blocks = []
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    n_layer, width, vocab = _dims(model, cfg)
    lora = isinstance(model, LoraModel)
    qlora = lora and cfg.model.lora.load_in_4bit
    frozen_bytes = (qlora_frozen_bytes(model.peft.get_base_model(), frozen) if qlora
                    else sum(p.numel() * p.element_size() for p in frozen))
    return ModelShapes(trainable=trainable, frozen_bytes=frozen_bytes,
                       largest_block=largest, n_layer=n_layer, width=width, vocab=vocab,
                       lora=lora, frozen_params=sum(p.numel() for p in frozen), qlora=qlora)


def qlora_frozen_bytes(base: nn.Module, frozen: list[nn.Parameter]) -> float:
    """The bytes of QLoRA's frozen base as it trains (module docstring): the weights bitsandbytes
    quantises at NF4's 4.127 bits, the rest in fp32, whatever dtype the meta model gave them."""
    from elastic_train.training.lora import qlora_quantised_weights

    quantised = {id(w) for w in qlora_quantised_weights(base)}
    return sum(p.numel() * (NF4_BYTES_PER_PARAM if id(p) in quantised else QLORA_OTHER_BYTES)
               for p in frozen)


def _dims(model: nn.Module, cfg: Config) -> tuple[int | None, int | None, int | None]:
    """(layers, width, vocabulary) where the model says them: the embedded GPT's config or a
    transformers config."""
    from elastic_train.config import gpt_config

    if cfg.model.name == "gpt":
        gpt = gpt_config(cfg.model)
        return gpt.n_layer, gpt.d_model, cfg.model.vocab_size or 256
    hf = getattr(model, "config", None)
    if hf is None:
        base = getattr(getattr(model, "peft", None), "get_base_model", None)
        hf = getattr(base(), "config", None) if callable(base) else None
    layers, width = getattr(hf, "num_hidden_layers", None), getattr(hf, "hidden_size", None)
    return layers, width, getattr(hf, "vocab_size", None)


@dataclass(frozen=True)
class RankNeed:
    """Bytes one rank needs, by kind."""

    weights: float
    grads: float
    optimizer: float
    reduction: float
    gathered: float
    activations: float

    @property
    def total(self) -> float:
        return (self.weights + self.grads + self.optimizer + self.reduction + self.gathered
                + self.activations)

    def describe(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.grads),
                 ("optimizer state", self.optimizer), ("reduction buffers", self.reduction),
                 ("gathered block", self.gathered), ("activations (estimate)", self.activations)]
        return ", ".join(f"{name} {b / GiB:.1f}" for name, b in parts if b)


def activation_bytes(shapes: ModelShapes, cfg: Config) -> float:
    """The stated activation estimate of one micro-batch (module docstring)."""
    tokens = batch_tokens(cfg)[0]  # unset: what the driver fills in (config.batch_tokens)
    half = cfg.train.precision in ("bf16", "fp16")
    per_unit = KORTHIKANTI_BYTES * (1 if half else 2)
    layers = 0.0
    if shapes.n_layer and shapes.width:
        layers = per_unit * tokens * shapes.width * shapes.n_layer
        if cfg.model.gradient_checkpointing:  # one layer's worth, and every layer's input
            layers = tokens * shapes.width * (per_unit + shapes.n_layer * (2 if half else 4))
    logits = 2 * 4 * tokens * (shapes.vocab or 0)
    return layers + logits


def rank_need(shapes: ModelShapes, cfg: Config, grad_reduce: str, world_size: int,
              sharding: str | None = None) -> RankNeed:
    """What one of `world_size` ranks holds (module docstring), `sharding` (default the
    config's) and `grad_reduce` (resolved: exact or ddp)."""
    sharding = sharding or cfg.train.sharding
    acts = activation_bytes(shapes, cfg)
    p = float(shapes.trainable)
    if sharding == "fsdp" and not shapes.lora:
        per = 8.0 if grad_reduce == "exact" else 4.0  # master and gradient: float64 or fp32
        return RankNeed(weights=p * per / world_size, grads=p * per / world_size,
                        optimizer=p * 8.0 / world_size, reduction=0.0,  # two float32 moments
                        gathered=8.0 * shapes.largest_block, activations=acts)
    frozen = shapes.frozen_bytes / (world_size if sharding == "fsdp" else 1)
    optimizer = OPTIMIZER_STATE_BYTES[cfg.optim.name]
    reduction = REDUCTION_BUFFER_BYTES[grad_reduce] + COMM_HOOK_STATE_BYTES.get(
        cfg.train.grad_compression, 0.0)
    return RankNeed(weights=4.0 * p + frozen, grads=4.0 * p, optimizer=optimizer * p,
                    reduction=reduction * p, gathered=0.0, activations=acts)


def host_bytes_per_rank(node_bytes: int, ranks_on_node: int) -> float:
    """What one of `ranks_on_node` CPU ranks can have of a node's memory."""
    return node_bytes * RAY_MEMORY_THRESHOLD / max(1, ranks_on_node)


def check_fits_memory(shapes: ModelShapes, cfg: Config, grad_reduce: str, world_size: int,
                      available_bytes: float, where: str) -> None:
    """ModelTooLargeError, one line naming the figures and what would fit, when a rank of
    `world_size` needs more than `available_bytes` (`where` says what that is)."""
    need = rank_need(shapes, cfg, grad_reduce, world_size)
    if need.total <= available_bytes:
        return
    setting = f"train.sharding={cfg.train.sharding}, train.grad_reduce={grad_reduce}, " \
              f"optim.name={cfg.optim.name}"
    raise ModelTooLargeError(
        f"model of {shapes.total / 1e9:.2f}B parameters does not fit: each of {world_size} "
        f"rank(s) needs {need.total / GiB:.1f} GiB ({need.describe()} GiB; {setting}) but a rank "
        f"has {available_bytes / GiB:.1f} GiB ({where}); "
        f"{what_would_fit(shapes, cfg, grad_reduce, world_size, available_bytes)}")


def what_would_fit(shapes: ModelShapes, cfg: Config, grad_reduce: str, world_size: int,
                   available_bytes: float) -> str:
    """The alternatives, each with its need per rank: fsdp (and how many ranks of this size it
    takes), LoRA with a bf16 base (sharded or not); for QLoRA `_qlora_would_fit`."""
    if shapes.qlora:
        return _qlora_would_fit(shapes, cfg, grad_reduce, world_size, available_bytes)
    options = []
    if cfg.train.sharding != "fsdp" or shapes.lora:
        fsdp = rank_need(shapes, cfg, grad_reduce, world_size, "fsdp").total
        options.append(f"train.sharding=fsdp: {fsdp / GiB:.1f} GiB per rank at {world_size}")
    ranks = min_ranks(shapes, cfg, grad_reduce, available_bytes)
    options.append(f"fsdp over {ranks} ranks of {available_bytes / GiB:.1f} GiB each (more "
                   "workers, each with its own memory)" if ranks else
                   "no number of fsdp ranks of this size (the activations or a gathered block "
                   "alone exceed it: a smaller data.micro_batch_tokens or "
                   "model.gradient_checkpointing=true shrinks the activations)")
    if not shapes.lora and shapes.trainable:
        lora = _lora_shapes(shapes)
        plain = rank_need(lora, cfg, grad_reduce, world_size, "none").total
        sharded = rank_need(lora, cfg, grad_reduce, world_size, "fsdp").total
        options.append(f"LoRA with a bf16 base (model.lora.r=8, model.base_dtype=bf16): "
                       f"~{plain / GiB:.1f} GiB per rank, ~{sharded / GiB:.1f} with fsdp")
    elif shapes.lora:
        options.append("model.base_dtype=bf16 halves an fp32 base")
    return "what would fit: " + "; ".join(options)


def _qlora_would_fit(shapes: ModelShapes, cfg: Config, grad_reduce: str, world_size: int,
                     available_bytes: float) -> str:
    """QLoRA's alternatives, each with its need per rank: not fsdp (refused with a 4-bit base),
    but a smaller r (the adapters and their state scale with it), fewer tokens a micro-batch or
    gradient checkpointing (the activations), or a GPU with more memory than the need."""
    need = rank_need(shapes, cfg, grad_reduce, world_size)
    options = []
    r = cfg.model.lora.r
    tunable = shapes.frozen_bytes < available_bytes  # else no setting of the run helps: the base
    if tunable and r > 1:
        fewer = replace(shapes, trainable=shapes.trainable * (r // 2) // r)
        options.append(f"model.lora.r={r // 2}: "
                       f"{rank_need(fewer, cfg, grad_reduce, world_size).total / GiB:.1f} GiB")
    tokens = batch_tokens(cfg)[0]
    smaller = max(cfg.data.max_seq_len or 1, tokens // 2)
    if tunable and smaller < tokens and need.activations:  # activations are linear in the tokens
        less = need.total - need.activations * (1 - smaller / tokens)
        options.append(f"data.micro_batch_tokens={smaller} (more micro-batches a step, the same "
                       f"global batch): {less / GiB:.1f} GiB")
    if tunable and not cfg.model.gradient_checkpointing and need.activations:
        ckpt = replace(cfg, model=replace(cfg.model, gradient_checkpointing=True))
        less = need.total - need.activations + activation_bytes(shapes, ckpt)
        options.append(f"model.gradient_checkpointing=true: {less / GiB:.1f} GiB")
    options.append(f"a GPU of at least {need.total / GiB:.1f} GiB (the 4-bit base alone is "
                   f"{shapes.frozen_bytes / GiB:.1f} GiB, whole on every rank)")
    return "what would fit: " + "; ".join(options)


def _lora_shapes(shapes: ModelShapes) -> ModelShapes:
    """The same model as a bf16 frozen base with r=8 adapters (about 0.2% of its parameters)."""
    adapters = max(1, shapes.total // 500)
    return ModelShapes(trainable=adapters, frozen_bytes=2 * shapes.total, largest_block=0,
                       n_layer=shapes.n_layer, width=shapes.width, vocab=shapes.vocab, lora=True,
                       frozen_params=shapes.total)


def min_ranks(shapes: ModelShapes, cfg: Config, grad_reduce: str,
              available_bytes: float) -> int | None:
    """The fewest fsdp ranks of `available_bytes` each that hold the model; None if none do
    (what every rank holds whole, a gathered block and the activations, exceeds it alone)."""
    whole = rank_need(shapes, cfg, grad_reduce, 1, "fsdp").total
    fixed = rank_need(shapes, cfg, grad_reduce, 1 << 60, "fsdp").total  # held whole by every rank
    if fixed >= available_bytes:
        return None
    ranks = max(1, math.ceil((whole - fixed) / (available_bytes - fixed)))
    while rank_need(shapes, cfg, grad_reduce, ranks, "fsdp").total > available_bytes:
        ranks += 1  # float round-off in the division
    return ranks


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_frees_to_os() -> bool:
    """glibc: allocations of 1 MiB and more are mmapped, so freeing one returns it to the OS.

    fsdp on CPU allocates and frees buffers of a block's size many times a step (each gathered
    block, its float64 reduce-scatter buffers, gloo's copies); glibc's default keeps freed heap
    memory for reuse, and its dynamic mmap threshold rises past those sizes, so the process's
    resident memory grew step after step: the 28M GPT's fsdp ranks peaked at 2.28 / 2.52 GiB with
    the default, 1.43 / 1.43 GiB with this threshold (docs/sharding.md). False where there is no
    glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak resident bytes so far (Linux VmHWM), None where /proc has none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_bytes(device: torch.device) -> int:
    """A GPU's memory."""
    return torch.cuda.get_device_properties(device).total_memory
