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

With train.sharding=fsdp (`shard_frozen_base`): the frozen base is what is large, so it alone is
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
whole adapters. Each rank keeps its own rows of the base it built, so the ranks' base hashes are
compared before sharding (`check_same_base`).

QLoRA (`model.lora.load_in_4bit`, GPU only): transformers loads the folder's weights quantised
to 4-bit NF4 by bitsandbytes (`qlora_load_kwargs`, on this worker's GPU), peft's
`prepare_model_for_kbit_training` freezes the base and casts what is not 4-bit to fp32, and
the adapters (fp32) are added as on the CPU path; the base's hash is of the folder's weights
before quantisation. Refused on CPU (bitsandbytes' 4-bit training kernels need CUDA), with
fsdp (validate.py: 4-bit weights cannot be cut into row shards), and on a folder without
weights (nothing to quantise).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.config import ConfigError, ModelConfig
from elastic_train.training.basehash import folder_hash, state_dict_hash
from elastic_train.training.collectives import is_distributed, timed_all_reduce
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.sharding import ShardedReduce

BASE_KEY = "lora_base_sha256"  # the base's hash, a uint8 tensor of 32 bytes in the state dict
LORA_EXTRA_HINT = "pip install 'elastic_train[lora]'"


def require_peft() -> Any:
    """The peft module; ValueError naming the extra when it is missing."""
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

    `forward(tokens)` returns the peft model's output (logits in `.logits`); `peft` is the
    `PeftModel` itself (export saves or merges it)."""

    def __init__(self, peft_model: nn.Module, digest: bytes) -> None:
        super().__init__()
        self.peft = peft_model
        self.register_buffer(BASE_KEY, torch.tensor(list(digest), dtype=torch.uint8))

    def forward(self, tokens: torch.Tensor, **kwargs: Any) -> Any:
        return self.peft(input_ids=tokens, use_cache=False, **kwargs)

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
            raise ConfigError(
                "the checkpoint's LoRA adapters were trained on another base model (base sha256 "
                f"{bytes(saved.tolist()).hex()[:16]}..., this one's {bytes(ours.tolist()).hex()[:16]}"
                "...): resume on the base model.path it was trained on")
        missing, unexpected = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [name for name in missing if name in self._kept()]
        if strict and (missing or unexpected):
            raise RuntimeError(f"LoRA state dict: missing {missing[:5]}, unexpected "
                               f"{list(unexpected)[:5]}")
        return missing, unexpected


def apply_lora(model: nn.Module, model_cfg: ModelConfig) -> LoraModel:
    """`model` frozen (hashed, then cast to `model.base_dtype`, or prepared for k-bit training
    when QLoRA loaded it in 4 bits) with LoRA adapters of `model.lora` on it. ValueError naming
    the key for a missing peft, no module matching `target_modules`, or QLoRA without a GPU or
    without weights to quantise."""
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
        raise ValueError(f"model.lora.target_modules: {' '.join(str(exc).split())[:300]}") from None
    for _, p in wrapped.named_parameters():  # adapters in fp32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
    return LoraModel(wrapped, digest)


def qlora_load_kwargs(model_cfg: ModelConfig) -> dict[str, Any]:
    """What `from_pretrained` adds for QLoRA (hf.build_hf_model): the weights quantised to NF4
    with double quantisation (QLoRA's recipe), computing in bf16, loaded onto this process's
    GPU (Ray Train sets it) rather than first into host memory whole."""
    if not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit "
                         "kernels do not train on CPU")
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    return {"quantization_config": quantization, "dtype": torch.bfloat16,
            "device_map": {"": torch.cuda.current_device()}}


def check_qlora(model: nn.Module, model_cfg: ModelConfig) -> None:
    """QLoRA's base must have come out of from_pretrained in 4 bits (ValueError naming why not)."""
    if not torch.cuda.is_available():
        raise ValueError("model.lora.load_in_4bit (QLoRA) needs a CUDA GPU: bitsandbytes' 4-bit "
                         "kernels do not train on CPU")
    if not getattr(model, "is_loaded_in_4bit", False):
        raise ValueError(f"model.lora.load_in_4bit: model.path '{model_cfg.path}' holds no weights "
                         "to quantise (QLoRA fine-tunes a pretrained base; a base built from its "
                         "config would be random numbers rounded to 4 bits)")


def is_lora(model: nn.Module) -> bool:
    return isinstance(model, LoraModel)


def shard_frozen_base(root: nn.Module, model: LoraModel, *, exact: bool, reshard_after_forward: bool,
                      shard_modules: list[str], device: torch.device) -> LoraShardedReduce:
    """`train.sharding=fsdp` with LoRA: the frozen base sharded by FSDP2 in its own dtype, the
    adapters left whole on every rank (module docstring, "With train.sharding=fsdp")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from elastic_train.training.sharding import ensure_process_group, find_blocks

    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    adapters = [p for p in model.parameters() if p.requires_grad]  # a list: the same order on every rank
    for p in adapters:  # FSDP moves what it manages; the adapters are not
        p.data = p.data.to(device)
    check_same_base(model, device)
    for p in adapters:  # every rank starts from rank 0's adapters (the base is checked above)
        dist.broadcast(p.data, src=0)
    policy = MixedPrecisionPolicy()  # no cast: each block gathered in the base's own dtype
    base = model.peft.get_base_model()
    for block in reversed(find_blocks(base, shard_modules)):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=set(adapters))
    fully_shard(root, mesh=mesh, mp_policy=policy, ignored_params=set(adapters))
    return LoraShardedReduce(root, model, exact, device)


def check_same_base(model: LoraModel, device: torch.device) -> None:
    """Every rank built the same base (each keeps its own rows of it, so a rank that loaded other
    weights would silently train a mixture): their hashes compared, ConfigError on every rank."""
    ours = getattr(model, BASE_KEY).to(device)
    first = ours.clone()
    dist.broadcast(first, src=0)
    differs = torch.tensor([0 if torch.equal(first, ours) else 1], device=device)
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    if int(differs):
        raise ConfigError("model.path: the ranks built different base models (base sha256 "
                          f"{bytes(first.tolist()).hex()[:16]}... on rank 0, "
                          f"{bytes(ours.tolist()).hex()[:16]}... here): every node must see "
                          "the same weights")


class LoraShardedReduce(ShardedReduce):
    """The step's reduction for LoRA on a sharded base: FSDP reduces nothing (the base has no
    gradient), the whole adapters' gradients are reduced as without sharding: `exact`, each
    backward's gradient moved into `ExactGradSum`'s float64 sum as soon as it is accumulated (a
    hook: the step's sharded path calls no add_grads) and all-reduced once; `ddp`, summed in
    fp32 over this rank's backwards and all-reduced once. `rounds` (every rank runs as many
    forwards, each gathers the base's blocks) is sharding's."""

    def __init__(self, root: nn.Module, model: nn.Module, exact: bool, device: torch.device) -> None:
        super().__init__(root, model, exact, device)
        self.sum = ExactGradSum(model, device) if exact else None
        if self.sum is not None:
            for p, acc in zip(self.sum.params, self.sum.views, strict=True):
                p.register_post_accumulate_grad_hook(_moves_into(acc))

    def set_sync(self, last: bool) -> None:
        """Nothing to sync per backward: the base has no gradient, the adapters' is reduced in
        `finish`."""

    def finish(self) -> None:
        if self.sum is not None:
            self.sum.finish()
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if is_distributed():
            timed_all_reduce(flat)
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def grad_norm(self) -> float:
        return float(torch.nn.utils.get_total_norm([p.grad for p in self.params]))

    def clip_(self, max_norm: float) -> float:
        """As the unsharded step clips: every rank holds the same whole gradient."""
        return float(torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm > 0 else float("inf")))


def _moves_into(acc: torch.Tensor):
    def hook(p: torch.Tensor) -> None:
        acc.add_(p.grad)
        p.grad = None
    return hook
