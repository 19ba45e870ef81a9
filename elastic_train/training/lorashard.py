"""LoRA with `train.sharding=fsdp`: the frozen base alone sharded, the adapters whole on every
rank (why, and what it keeps: lora.py's docstring and docs/finetuning.md).

build.py hands a `LoraModel` here instead of to `sharding.shard_model`. FSDP2 wraps each block
and the root with the adapters as `ignored_params` and a MixedPrecisionPolicy with no cast, so
each rank holds rows of every base tensor in the base's own dtype and gathers them in that dtype:
the forward and backward are the unsharded LoRA model's. The base has no gradient, so FSDP
reduces nothing; `LoraShardedReduce` reduces the adapters' gradients as the unsharded path does.
Checkpoints need nothing here: the LoRA state dict holds no sharded tensor, and sharding.py saves
and loads such a model as checkpoint.py does. A LoRA model built on the meta device (a base of
safetensors files) is sharded there, then each rank reads its rows of the base and draws the
whole adapters as the unsharded build does (hfshards.fill_hf).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.config import ConfigError
from elastic_train.training.collectives import is_distributed, timed_all_reduce
from elastic_train.training.lora import BASE_KEY, LoraModel
from elastic_train.training.model import materialize
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.sharding import (
    ShardedReduce,
    clip_rows,
    ensure_process_group,
    find_blocks,
    row_norm,
    shard_units,
)


def shard_frozen_base(root: nn.Module, model: LoraModel, *, exact: bool, reshard_after_forward: bool,
                      shard_modules: list[str], device: torch.device) -> LoraShardedReduce:
    """`train.sharding=fsdp` with LoRA: the frozen base sharded by FSDP2 in its own dtype, the
    adapters left whole on every rank (this module's docstring; lora.py's, "With
    train.sharding=fsdp", says why). Returns the step's reduction for the adapters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    adapters = [p for p in model.parameters() if p.requires_grad]  # a list: the same order on every rank
    on_meta = any(p.is_meta for p in model.parameters())  # built on meta: each rank reads its rows
    policy = MixedPrecisionPolicy()  # no cast: each block gathered in the base's own dtype
    base = model.peft.get_base_model()
    shard_units(root, base, find_blocks(base, shard_modules), mesh=mesh, policy=policy,
                reshard_after_forward=reshard_after_forward, device=device, ignored=set(adapters))
    if on_meta:  # the base's rows from its files, the adapters whole (hfshards.fill_hf)
        materialize(root, device, model)
        adapters = [p for p in model.parameters() if p.requires_grad]
    for p in adapters:  # FSDP moves what it manages; the adapters are not
        p.data = p.data.to(device)
    check_same_base(model, device)
    for p in adapters:  # every rank starts from rank 0's adapters (the base is checked above)
        dist.broadcast(p.data, src=0)
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
        if self.exact:
            return row_norm(self.params, 0, 1, self.device)
        return float(torch.nn.utils.get_total_norm([p.grad for p in self.params]))

    def clip_(self, max_norm: float) -> torch.Tensor | float:
        """As the unsharded step clips (exact: `clip_rows`, step.optimizer_step): every rank
        holds the same whole gradient."""
        if self.exact:
            return clip_rows(self.params, max_norm, 0, 1, self.device)
        return float(torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm > 0 else float("inf")))

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The adapters are whole fp32 tensors: the optimizer's own step, as unsharded."""
        optimizer.step()


def _moves_into(acc: torch.Tensor) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook: the gradient just accumulated into `acc` (float64), `.grad`
    emptied, as ExactGradSum.add_grads does after each backward."""

    def hook(p: torch.Tensor) -> None:
        acc.add_(p.grad)
        p.grad = None
    return hook
