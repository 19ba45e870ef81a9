"""`train.sharding=fsdp`: FSDP2 on each block and the root, and the guarantees kept with it.

`shard_model` applies `torch.distributed.fsdp.fully_shard` to each block (`find_blocks`) and then
to the root, the `LossModule` (so that a loss which calls parts of the model, a Hugging Face
`base_model` and its head apart, still finds every weight gathered). Each rank then holds rows
[start, end) of dim 0 of every parameter (`shardfiles.row_range`), their gradients and their
optimizer state: 1/W of each. On CPU the mesh is explicit (without one FSDP2 picks CUDA where a GPU
exists); a one-process run makes itself a one-rank gloo group, since FSDP2 needs one.

Exact (`train.grad_reduce=exact`), why it stays the same to the bit at any world size:
- the parameters are float64 master shards, and `MixedPrecisionPolicy(param_dtype=float32,
  reduce_dtype=float64)` gathers them as float32 for forward and backward: a float32 copy of a
  float64 that came from float32 is exact, so step one computes what the unsharded model does.
- every micro-batch's float32 gradient is reduce-scattered in float64, summed (no division by W),
  into float64 gradient shards that accumulate in float64: `ExactGradSum`'s argument (a float64 sum
  of float32 numbers is exact, or off by 2**-53 relative) with the buffer sharded. With fp32
  parameters the trap is that FSDP2 casts each reduced micro-batch back to fp32, and the
  accumulation then rounds differently with W; float64 parameters keep the sharded gradient in
  float64. Each reduce-scatter is a collective, so every rank runs as many backwards as the rank
  with the most micro-batches (`rounds`), the others adding dry micro-batches (loss times 0).
- the summed gradient is rounded to float32 values (`finish`), as `ExactGradSum` rounds its sum:
  what order-dependent float64 round-off is left disappears in that rounding, as there.
- the global gradient norm for clipping is summed in an order that does not depend on W: each
  rank computes a float64 sum of squares per row of dim 0 (a row lies whole on one rank, at any
  W), puts it in that row's slot of a vector of every parameter's rows, the vector is all-reduced
  (one value per slot: exact) and summed the same way on every rank (`grad_norm`).
- AdamW is elementwise: a shard updates the same whichever rank holds it.
Memory with AdamW: float64 master and gradient, two float32 moments, 24 bytes a parameter over
W ranks.

`ddp` (GPU speed): float32 parameters, gradients reduce-scattered in fp32 (bf16 parameters for
compute with `train.precision=bf16`), synced on a step's last micro-batch only
(`set_requires_gradient_sync`): 16 bytes a parameter over W, plus the unsharded gradient of the
micro-batches before the last. Every forward gathers blocks from all ranks, so here too each rank
runs as many micro-batches as the rank with the most (`rounds`), the extra ones dry.

Checkpoints: each rank copies its own rows (`sharded_snapshot`) and writes them in parallel, in
the usual files and manifests (checkpoint.py); `load_sharded_checkpoint` takes this rank's rows
from a checkpoint of any world size and either sharding (shardfiles.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.training.checkpoint import (
    FORMAT_VERSION,
    _parameter_names,
    _to_cpu,
    check_compatible,
    load_checkpoint,
    model_signature,
    read_shards,
    read_state,
    rng_state,
    set_rng_state,
    snapshot,
)
from elastic_train.training.collectives import is_distributed, timed_all_reduce
from elastic_train.training.model import can_materialize, materialize, missing_module_classes
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.shardfiles import ShardedFiles, is_dtensor, row_range, sharding_of

if TYPE_CHECKING:  # loaded by the runs that shard (shard_model): ~0.8 s of CPU a process
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor


def ensure_process_group(device: torch.device) -> None:
    """FSDP2 needs a process group: a one-process run (no launcher) gets a one-rank one."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)


def find_blocks(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The modules sharded as blocks (each gathered whole for its forward): those of the classes
    `names` (model.shard_modules), else of a transformers model's `_no_split_modules` (its decoder
    layers), else the children of the model's largest nn.ModuleList (the GPT's blocks); none
    (only the root is sharded) when the model has no ModuleList."""
    missing = missing_module_classes(model, names)
    if missing:
        raise ValueError(missing)
    wanted = list(names) or list(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _to_float64(module: nn.Module) -> None:
    """The module's float parameters not yet sharded become float64 (the exact path's master)."""
    for p in module.parameters():
        if not is_dtensor(p) and p.is_floating_point():
            p.data = p.data.to(torch.float64)


def shard_model(root: nn.Module, model: nn.Module, *, exact: bool, precision: str,
                reshard_after_forward: bool, shard_modules: list[str],
                device: torch.device) -> ShardedReduce:
    """fully_shard each block of `model`, then `root` (the LossModule around it), on a mesh of
    every rank; the parameters move to `device` one block at a time. Every rank starts from
    rank 0's weights, as DDP's constructor makes them. A model built on the meta device (one that
    can `materialize`, as the embedded GPT) is sharded there, and then each rank creates only its
    rows, equal to the bit to an unsharded build's (model.materialize). (LoRA: lorashard.py,
    from build.py.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    ensure_process_group(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if exact:
        policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                                      reduce_dtype=torch.float32)
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and not can_materialize(model):
        raise ValueError(f"{type(model).__name__} was built on the meta device but has no "
                         "initial_value(name, shape) to materialize its shards with")
    if not on_meta:
        ExactGradSum.broadcast_parameters(model)
    shard_units(root, model, find_blocks(model, shard_modules), mesh=mesh, policy=policy,
                reshard_after_forward=reshard_after_forward, device=device,
                prepare=_to_float64 if exact else None)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum: the loss is scaled by 1/global targets
            module.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    if on_meta:  # this rank's rows only, one whole parameter at a time
        materialize(root, device, model)
    return ShardedReduce(root, model, exact, device)


def loose_leaves(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The embeddings and linear layers outside every block with at least a quarter of the
    largest block's parameters (a vocabulary's embedding, an untied output head) that share no
    parameter with another module (a tied head stays in the root's unit with its embedding).
    Each becomes a unit of its own, as torchtitan shards its token embeddings and output: in the
    root's unit they were held gathered from the first block's forward to the backward's end."""
    inside = {id(m) for block in blocks for m in block.modules()}
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    largest = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    return [m for m in model.modules()
            if isinstance(m, (nn.Embedding, nn.Linear)) and id(m) not in inside
            and 4 * sum(p.numel() for p in m.parameters(recurse=False)) >= largest > 0
            and all(users[id(p)] == 1 for p in m.parameters(recurse=False))]


def shard_units(root: nn.Module, model: nn.Module, blocks: list[nn.Module], *, mesh,
                policy: MixedPrecisionPolicy, reshard_after_forward: bool, device: torch.device,
                prepare=None, ignored: set[nn.Parameter] | None = None) -> None:
    """fully_shard each block (inner ones first), each of `loose_leaves`, then the root.
    `prepare(module)` runs on each before it is sharded (the exact path's float64 master);
    `ignored`: parameters left whole (LoRA's adapters). An output head is not resharded after its
    forward (its backward follows at once). On CPU each unit gathers and reduce-scatters a slice
    at a time (ChunkedAllGather, ChunkedReduceScatter), with no backward prefetch."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = {"mesh": mesh, "mp_policy": policy, "ignored_params": ignored}
    units = [(block, reshard_after_forward) for block in reversed(blocks)]
    units += [(leaf, reshard_after_forward and isinstance(leaf, nn.Embedding))
              for leaf in loose_leaves(model, blocks)]
    for module, reshard in units:
        if prepare is not None:
            prepare(module)
        fully_shard(module, reshard_after_forward=reshard, **kwargs)
    if prepare is not None:
        prepare(root)
    fully_shard(root, **kwargs)
    if device.type != "cpu":
        return
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(ChunkedAllGather(module))
            module.set_custom_reduce_scatter(ChunkedReduceScatter())
            # No backward prefetch: FSDP2 gathers the next block during a block's backward to
            # overlap the two on a GPU's streams; gloo's collectives block the CPU, so it only
            # held a second gathered block at the peak. A module prefetching itself (a no-op:
            # gathered by then) replaces that implicit prefetch.
            module.set_modules_to_backward_prefetch([module])


class _PlainAllocation:
    """FSDP2's `Comm.allocate` for the chunked collectives: plain buffers of the device."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class ChunkedAllGather(_PlainAllocation):
    """FSDP2's all-gather of a unit's parameters on gloo, a slice of every rank's part at a
    time: gloo's all-gather stages a copy of its whole output (measured: 89 MB more resident for
    an 88 MB output), after the gathered unit itself the largest transient of a forward. The
    same bytes land in the same places. It returns a finished `Work`: FSDP2 then frees the
    gathered buffer as soon as it has copied the parameters out, where after a synchronous
    all-gather in forward it keeps it until the next unit's copy-out (to overlap the two on a
    GPU's streams; on gloo nothing overlaps). FSDP2's `AllGather` interface
    (`FSDPModule.set_custom_all_gather`), CPU only: NCCL needs no staging.

    A unit of one parameter (an embedding, an untied head: `loose_leaves`) gathers straight into
    that parameter's unsharded buffer, whose layout is the gathered one (rows, rank by rank):
    FSDP2 allocates a buffer to gather into and then copies it into the parameter's, so the
    largest table of a model was held twice for that copy (2 x 131 MB for a 1.1B Llama's head in
    bf16). Its copy-out is then a copy onto itself."""

    CHUNK = 1 << 18  # elements of one rank's part per call: 1 MiB in float32

    def __init__(self, module: nn.Module | None = None) -> None:
        group = module._get_fsdp_state()._fsdp_param_group if module is not None else None
        params = group.fsdp_params if group is not None else []
        self.param = params[0] if len(params) == 1 and params[0].fsdp_placement.dim == 0 else None

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.param is None:
            return super().allocate(size, dtype=dtype, device=device)
        world_size = self.param.mesh_info.shard_mesh_size
        self.param.init_all_gather_outputs([size[0] // world_size], [dtype], world_size, device)
        buffer = self.param.all_gather_outputs[0]
        if buffer.dtype != dtype or buffer.numel() != size[0]:  # not the layout assumed
            return super().allocate(size, dtype=dtype, device=device)
        self.param.alloc_all_gather_outputs()
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work:
        parts = output_tensor.view(group.size(), -1)
        for start in range(0, parts.shape[1], self.CHUNK):
            piece = input_tensor[start:start + self.CHUNK]
            staged = torch.empty(group.size() * piece.numel(), dtype=piece.dtype, device=piece.device)
            dist.all_gather_into_tensor(staged, piece, group=group)
            parts[:, start:start + piece.numel()].copy_(staged.view(group.size(), -1))
        return _Done()


class _Done(dist.Work):
    """A collective already finished (ChunkedAllGather)."""

    def wait(self, timeout=None) -> bool:
        return True


class ChunkedReduceScatter(_PlainAllocation):
    """FSDP2's reduce-scatter of a block's gradients on gloo, a slice of every rank's part at a
    time. gloo's reduce-scatter stages as much again as its whole input (measured: 48 MB more
    resident for a 46 MB float64 input; none for an in-place all-reduce): for the exact path's
    float64 copy of a block's gradient, the largest transient of a backward. Slices of CHUNK
    elements of each rank's part, copied side by side and reduce-scattered, keep it to about
    12 MB and send the same bytes; each element is still the sum of the same W values
    (tests/test_sharding.py). FSDP2's `ReduceScatter` interface (torch 2.13:
    `FSDPModule.set_custom_reduce_scatter`), CPU only: NCCL's reduce-scatter needs no staging."""

    CHUNK = 1 << 17  # elements of one rank's part per call: 1 MiB in float64

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        parts = input_tensor.view(group.size(), -1)
        for start in range(0, parts.shape[1], self.CHUNK):
            piece = parts[:, start:start + self.CHUNK]
            dist.reduce_scatter_single(output_tensor[start:start + piece.shape[1]],
                                       piece.contiguous().view(-1), op=op, group=group)


class ShardedReduce:
    """What a step does differently with sharding: how many backwards, when they sync, the
    rounding of the summed gradient and the W-independent gradient norm (module docstring)."""

    def __init__(self, root: nn.Module, model: nn.Module, exact: bool, device: torch.device) -> None:
        self.root, self.exact, self.device = root, exact, device
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1

    def rounds(self, local: int) -> int:
        """How many forwards and backwards this rank runs for its `local` micro-batches: the
        most any rank has. Each forward all-gathers its blocks from every rank (a collective,
        whether or not its backward syncs), so every rank runs as many, the extra ones dry;
        exact reduce-scatters after every backward, ddp after the last."""
        count = torch.tensor([local], dtype=torch.int64, device=self.device)
        if is_distributed():
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def set_sync(self, last: bool) -> None:
        """Reduce-scatter after this backward: always in exact mode, on the last in ddp mode."""
        self.root.set_requires_gradient_sync(self.exact or last)

    def finish(self) -> None:
        """After the step's last backward: a zero gradient for a parameter no micro-batch reached
        (as ExactGradSum leaves it), and in exact mode the float64 sums rounded to float32."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif self.exact:
                    local = p.grad.to_local()
                    local.copy_(local.to(torch.float32))

    def grad_norm(self) -> float:
        """The global gradient norm, summed in the same order at any world size (docstring)."""
        return float(row_norm(self.params, self.rank, self.world_size, self.device))

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm` (0: no clipping), as
        `clip_rows` does unsharded; returns the norm."""
        return clip_rows(self.params, max_norm, self.rank, self.world_size, self.device)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step: exact, AdamW computed in float32 on the float64 master
        (`adamw_step_in_float32`), so that the update is the unsharded one's to the bit."""
        if self.exact:
            adamw_step_in_float32(optimizer)
        else:
            optimizer.step()


def row_norm(params: list[torch.Tensor], rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """The gradient norm of `params` in an order that does not depend on W: each rank computes a
    float64 sum of squares per row of dim 0 of its rows (a row lies whole on one rank), puts it in
    that row's slot of a vector of every parameter's rows (a parameter without a gradient leaves
    zeros), the vector is all-reduced (one value per slot: exact) and summed alike on every rank.
    Unsharded (rank 0 of 1) the same vector, so the same norm to the bit. A float64 scalar on the
    device: the step reads it with the loss, in one wait (step._read_together)."""
    total = sum(p.shape[0] if p.dim() else 1 for p in params)
    squares = torch.zeros(total, dtype=torch.float64, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            rows_of_p = p.shape[0] if p.dim() else 1
            start, end = 0, rows_of_p  # a whole gradient's rows
            local = p.grad
            if is_dtensor(local):  # this rank's rows of it
                local = local.to_local()
                start, end = row_range(p.shape[0], rank, world_size) if p.dim() else (0, 1)
            if local is not None and local.numel():
                rows = local.to(torch.float64).reshape(end - start, -1)
                squares[offset + start:offset + end] = rows.square().sum(dim=1)
            offset += rows_of_p
    if is_distributed() and world_size > 1:
        timed_all_reduce(squares)
    return squares.sum().sqrt()


def clip_rows(params: list[torch.Tensor], max_norm: float, rank: int, world_size: int,
              device: torch.device) -> torch.Tensor:
    """Scale the gradients to a norm (`row_norm`) of at most `max_norm` (0: no clipping), with
    torch's clip_grad_norm_ coefficient max_norm / (norm + 1e-6), clamped to 1 and computed on the
    device (no wait for the host), applied in float32 to float32 values (a float64 gradient holding
    them, exact fsdp, is multiplied as float32 and stored back): the same products sharded or not
    (a coefficient of 1 leaves every value as it was). Returns the norm (a device scalar)."""
    norm = row_norm(params, rank, world_size, device)
    if max_norm > 0:
        coef32 = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
        with torch.no_grad():
            for p in params:
                if p.grad is None:
                    continue
                local = p.grad.to_local() if is_dtensor(p.grad) else p.grad
                if local.dtype == torch.float32:
                    local.mul_(coef32)
                else:
                    local.copy_(local.to(torch.float32).mul_(coef32))
    return norm


@torch.no_grad()
def adamw_step_in_float32(optimizer: torch.optim.Optimizer) -> None:
    """torch's AdamW step on float32 copies of float64 shards that hold float32 values (exact
    fsdp's master, gradient and moments), written back: each element gets the float32 arithmetic
    of the unsharded model's AdamW, op for op, so the run stays the unsharded one to the bit (a
    float64 update would round differently: the fsdp and unsharded losses then parted in the 6th
    digit within a few steps). The moments are float32 shards: they only ever hold float32
    values, so float64 ones (as before, and as `Optimizer.load_state_dict` casts restored ones to
    the float64 master's dtype) are turned into float32 at their first step; 8 bytes a parameter
    over W less than float64 moments, and the checkpoints load across sharding modes as before
    (a moment is cast to the dtype of the parameter it is loaded for)."""
    from torch.optim.adam import adam

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:  # as torch.optim.Adam._init_group
                fused_or_capturable = group.get("fused") or group.get("capturable")
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device)
                                 if fused_or_capturable else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq"):
                if state[key].dtype != torch.float32:  # restored in the master's dtype
                    state[key] = state[key].to(torch.float32)
            local = [t.to_local() if is_dtensor(t) else t
                     for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            p32, g32, m32, v32 = (t.to(torch.float32) for t in local)
            adam([p32], [g32], [m32], [v32], [], [state["step"]], foreach=group.get("foreach"),
                 capturable=bool(group.get("capturable")), differentiable=False,
                 fused=group.get("fused"), has_complex=False, decoupled_weight_decay=True,
                 amsgrad=bool(group.get("amsgrad")), beta1=group["betas"][0],
                 beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"],
                 eps=group["eps"], maximize=bool(group.get("maximize")))
            for target, value in zip((local[0], local[2], local[3]), (p32, m32, v32), strict=True):
                target.copy_(value)


def sharded_bytes_per_param(grad_reduce: str, world_size: int) -> float:
    """Bytes per parameter on each rank with AdamW (module docstring), before activations."""
    return (24.0 if grad_reduce == "exact" else 16.0) / world_size


def _local_rows(t: DTensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's rows of a sharded tensor, checked against the rule a reader will assume."""
    local = t.to_local()
    start, end = row_range(t.shape[0], rank, world_size)
    if local.shape[0] != end - start:
        raise RuntimeError(f"FSDP gave rank {rank} {local.shape[0]} rows of a tensor of shape "
                           f"{list(t.shape)}; shardfiles.row_range expects {end - start}")
    return local


def sharded_snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any],
                     config: dict[str, Any], *, shard: int, shards: int,
                     provenance: dict[str, Any] | None = None, copy: bool = True) -> dict[str, Any]:
    """An in-memory CPU copy of this rank's rows of the model and of its optimizer state (keyed by
    parameter name), in `checkpoint.snapshot`'s form: `write_checkpoint` writes it as any other.
    `copy=False` (a final or synchronous save, written before training goes on): on the CPU the
    rows themselves, not a copy. A copy is 12 bytes a parameter over W (24 exact), which a model
    sized to fit by sharding on CPU may not have to spare."""
    if not _holds_rows(model):  # LoRA: whole adapters, saved as any replicated model's
        return snapshot(model, optimizer, None, train_state, config, shards, provenance,
                        shard=shard, shards=shards)
    names = _parameter_names(model, optimizer)
    part, row_sharded = {}, []
    for name, t in model.state_dict().items():
        if is_dtensor(t):
            part[name] = _local_rows(t, shard, shards)
            row_sharded.append(name)
        elif shard == 0:
            part[name] = t
    optim = optimizer.state_dict()
    state = {names[i]: {k: _local_rows(v, shard, shards) if is_dtensor(v) else v
                        for k, v in entry.items()}
             for i, entry in optim["state"].items()}
    opt_part: dict[str, Any] = {"state": state}
    if shard == 0:
        opt_part["param_groups"] = optim["param_groups"]
    snap = {"shard": shard, "shards": shards, "model": _to_cpu(part, copy),
            "optimizer": _to_cpu(opt_part, copy), "comm_hook": None}
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the asynchronous copies to pinned memory have landed
    if shard == 0:
        snap["extra"] = {"scaler": None, "rng": _to_cpu(rng_state())}
        snap["state"] = {"format_version": FORMAT_VERSION, "train_state": dict(train_state),
                         "world_size": shards, "shards": shards, "config": config,
                         "model_signature": model_signature(model), "provenance": provenance or {},
                         "sharding": "fsdp", "row_sharded": row_sharded}
    return snap


def _holds_rows(model: nn.Module) -> bool:
    """Whether the model's state dict holds sharded tensors: not LoRA's, whose state dict is
    its whole adapters (the sharded base is never saved)."""
    return any(is_dtensor(t) for t in model.state_dict().values())


def _as_local(value: torch.Tensor, p: DTensor) -> DTensor:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value.to(p.device), p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def load_sharded_checkpoint(directory: str | Path, model: nn.Module,
                            optimizer: torch.optim.Optimizer, restore_rng: bool = True) -> dict[str, Any]:
    """Restore this rank's rows of the model and optimizer from a checkpoint written at any world
    size, sharded or not; the RNG as `load_checkpoint` does. Returns the saved train state."""
    if not _holds_rows(model):  # LoRA: whole adapters (and the base's hash, checked)
        return load_checkpoint(directory, model, optimizer, restore_rng=restore_rng)
    state = read_state(directory)
    check_compatible(directory, state, model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    sharded = sharding_of(state) == "fsdp"
    files = ShardedFiles(directory, "model", state) if sharded else None
    whole = None if sharded else read_shards(directory, "model")
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if is_dtensor(t):
                start, end = row_range(t.shape[0], rank, world_size)
                rows = files.rows(name, start, end) if files else whole[name][start:end]
                t.to_local().copy_(rows)
            else:
                t.copy_(files.full(name) if files else whole[name])
    optimizer.load_state_dict(_optimizer_rows(directory, state, model, optimizer, rank, world_size))
    extra = torch.load(Path(directory) / "extra.pt", map_location="cpu", weights_only=True)
    if restore_rng:
        set_rng_state(extra["rng"])
    return state["train_state"]


def _optimizer_rows(directory: str | Path, state: dict[str, Any], model: nn.Module,
                    optimizer: torch.optim.Optimizer, rank: int, world_size: int) -> dict[str, Any]:
    """The optimizer's state dict with this rank's rows of every per-element state, as DTensors
    (load_state_dict casts them to the parameters' dtype)."""
    names = _parameter_names(model, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if sharding_of(state) == "fsdp":
        files = ShardedFiles(directory, "optimizer", state)
        saved, groups = files.file(0)["state"], files.file(0)["param_groups"]
    else:
        files, whole = None, read_shards(directory, "optimizer")
        saved, groups = {names[i]: v for i, v in whole["state"].items()}, whole["param_groups"]
    out = {}
    for i, p in enumerate(params):
        if names[i] not in saved:
            continue
        entry = {}
        for key, value in saved[names[i]].items():
            per_element = isinstance(value, torch.Tensor) and value.dim() > 0 and is_dtensor(p)
            if not per_element:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            start, end = row_range(p.shape[0], rank, world_size)
            rows = files.rows(names[i], start, end, key) if files else value[start:end]
            entry[key] = _as_local(rows, p)
        out[i] = entry
    return {"state": out, "param_groups": groups}
