"""Values for a transformers model built on the meta device (`model.name=hf`), one tensor at a
time, each rank keeping only its rows under `train.sharding=fsdp` (issue 37).

`hf.build_hf_model` builds every hf model on the meta device (QLoRA aside) and marks where its
values come from (`SOURCE_ATTR`): the safetensors files of `model.path`, or its config. Then
`model.materialize` gives it memory, whole on CPU or as FSDP's row shards, and `fill_hf` writes:

- **From the files** (`fill_from_files`): each parameter's rows [start, end) of dim 0
  (`shardfiles.row_range`, FSDP's cut) are one contiguous byte range of its tensor in the file,
  read with plain reads straight into the rank's shard when the dtypes agree (a LoRA base in
  bf16), else into a buffer of those rows in the stored dtype and cast. No mmap: pages of a
  mapped file count in the process's resident memory while mapped (a whole-file mapping added the
  file's size to every rank's peak), a read does not. So a rank holds its rows and at most one
  tensor's rows more; an unsharded build streams the same way, the model and one tensor, never a
  second copy of the model. Tensors whose names the files do not cover (renamed checkpoints) are
  loaded as before (`from_pretrained`, whole): `missing_from_files` decides at build time.
- **From the config** (`fill_from_config`): transformers' own initialisation, `_init_weights`
  per module in the order `PreTrainedModel.initialize_weights` visits them (children before
  their parent, each sub-model with its own `_init_weights`), with the module's own parameters
  swapped for whole fp32 tensors while it runs, then their rows kept. Both builds, sharded or not,
  run exactly this from the same seeded global RNG, one module's parameters whole at a time, so a
  rank's rows equal the unsharded build's to the bit and the peak is the largest module, not the
  model. (The unsharded build used to be `from_config` on CPU, whose constructors drew torch's
  default initial values first, overwritten by `_init_weights` but consuming the stream: values
  are transformers' same distributions, drawn from another position of the stream.) The exact
  path's float64 master is filled from fp32 draws, as the GPT's (`model.fill_initial_values`).

Buffers (rotary frequencies) are not in the files and were built on the meta device: the same
`_init_weights` writes them, as transformers' own meta-device loading does for what it did not
load (`_initialize_missing_keys`); loaded parameters are flagged `_is_hf_initialized`, which its
init functions respect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

SOURCE_ATTR = "elastic_values_from"  # on a meta-built hf model: the weights folder, or "" (config)
STORED_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                 "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                 "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lies in a safetensors file: its dtype, shape and first byte."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int


def stored_tensors(folder: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's safetensors files, from their headers ({} for .bin files)."""
    from elastic_train.training.basehash import _safetensors_entries, weight_files

    out = {}
    for path in weight_files(Path(folder)):
        if path.suffix != ".safetensors":
            return {}
        for name, dtype, shape, file, start, _end in _safetensors_entries(path):
            if dtype in STORED_DTYPES:
                out[name] = StoredTensor(file, STORED_DTYPES[dtype], tuple(shape), start)
    return out


def file_name(name: str) -> str:
    """A parameter's name as stored: LoRA's wrapped layers hold the weight as `base_layer`."""
    return name.replace(".base_layer.", ".")


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def missing_from_files(model: nn.Module, stored: dict[str, StoredTensor]) -> list[str]:
    """The model's parameters (adapters aside) that no stored tensor of the same shape holds,
    counting a tied parameter as held when any of its names is: [] when the files cover it."""
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not _is_adapter(name):
            names.setdefault(id(p), []).append(file_name(name))
            shapes[id(p)] = tuple(p.shape)
    return [aliases[0] for key, aliases in names.items()
            if not any(a in stored and stored[a].shape == shapes[key] for a in aliases)]


def read_rows(stored: StoredTensor, start: int, end: int, out: torch.Tensor) -> None:
    """Rows [start, end) of dim 0 of `stored` into `out` (cast to its dtype), by plain reads."""
    shape = stored.shape or (1,)
    row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
    direct = out.dtype == stored.dtype and out.device.type == "cpu" and out.is_contiguous()
    buf = out if direct else torch.empty((end - start, *shape[1:]), dtype=stored.dtype)
    view = memoryview(buf.view(torch.uint8).reshape(-1).numpy()) if buf.numel() else memoryview(b"")
    with open(stored.path, "rb", buffering=0) as f:
        f.seek(stored.offset + start * row_bytes)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise OSError(f"{stored.path}: ends inside a tensor")
            done += got
    if not direct:
        out.copy_(buf.reshape(out.shape))


def _keep_rows(p: torch.Tensor, whole: torch.Tensor | None, stored: StoredTensor | None = None) -> None:
    """This rank's rows of `p` (all of them unsharded) from `whole`, or from the file."""
    from elastic_train.training.shardfiles import is_dtensor, row_range

    local, start, end = p, 0, (p.shape[0] if p.dim() else 1)
    if is_dtensor(p):
        local = p.to_local()
        mesh = p.device_mesh
        start, end = row_range(p.shape[0], mesh.get_local_rank(), mesh.size())
    if stored is not None:
        read_rows(stored, start, end, local.data)
    else:
        local.data.copy_(whole[start:end] if p.dim() else whole)


@torch.no_grad()
def fill_from_files(model: nn.Module, folder: str | Path) -> None:
    """Every parameter (LoRA adapters aside) read from the files, this rank's rows of it; then
    the buffers from transformers' init (module docstring)."""
    stored = stored_tensors(folder)
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not _is_adapter(name):
            groups.setdefault(id(p), (p, []))[1].append(file_name(name))
    for p, aliases in groups.values():
        held = next((a for a in aliases if a in stored), None)
        if held is None:
            raise KeyError(f"{folder}: no stored tensor for {aliases[0]}")
        _keep_rows(p, None, stored[held])
        p._is_hf_initialized = True
    for name, b in model.named_buffers():
        if name in stored and tuple(b.shape) == stored[name].shape:
            read_rows(stored[name], 0, b.shape[0] if b.dim() else 1, b)
            b._is_hf_initialized = True
    _init_buffers(model)


def _init_order(model: nn.Module) -> list[tuple[nn.Module, object]]:
    """(module, the `_initialize_weights` that applies to it) in `initialize_weights` order."""
    from transformers import PreTrainedModel

    order: list[tuple[nn.Module, object]] = []

    def visit(module: nn.Module, fn: object) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else fn)
        order.append((module, fn))

    hf = _hf_model(model)
    visit(hf, hf._initialize_weights)
    return order


def _hf_model(model: nn.Module) -> nn.Module:
    from transformers import PreTrainedModel

    return next(m for m in model.modules() if isinstance(m, PreTrainedModel))


def _init_buffers(model: nn.Module) -> None:
    """`_init_weights` on each module with buffers of its own that were not loaded (its
    parameters, loaded, are flagged and left alone)."""
    from transformers import initialization

    custom = _hf_model(model).is_custom_code()
    with initialization.guard_torch_init_functions():
        for module, fn in _init_order(model):
            own = [b for b in module._buffers.values() if b is not None]
            if own and not all(getattr(b, "_is_hf_initialized", False) for b in own):
                fn(module, custom)


@torch.no_grad()
def fill_from_config(model: nn.Module) -> None:
    """transformers' initialisation, module by module, each module's own parameters whole in
    fp32 while its `_init_weights` runs, then this rank's rows of them kept (module docstring)."""
    from transformers import initialization

    custom = _hf_model(model).is_custom_code()
    with initialization.guard_torch_init_functions(), _OwnParametersOnly():
        for module, fn in _init_order(model):
            real = {name: p for name, p in module._parameters.items() if p is not None}
            whole = {name: torch.empty(p.shape, dtype=_draw_dtype(p.dtype)) for name, p in real.items()}
            for name, p in real.items():
                module._parameters[name] = nn.Parameter(whole[name], requires_grad=p.requires_grad)
            try:
                fn(module, custom)
            finally:
                for name, p in real.items():
                    module._parameters[name] = p
            for name, p in real.items():
                _keep_rows(p, whole[name])


class _OwnParametersOnly(TorchFunctionMode):
    """Refuses a value write into a row shard while `fill_from_config` runs: an `_init_weights`
    that writes another module's parameters would draw only this rank's rows of it, and the
    build would silently differ from the unsharded one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from elastic_train.training.shardfiles import is_dtensor

        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        name = getattr(func, "__name__", "")
        in_place = name.endswith("_") and not name.startswith("__")  # normal_, init.xavier_uniform_
        if in_place and is_dtensor(target):
            raise ValueError("model.name=hf with train.sharding=fsdp: this model's _init_weights "
                             "writes parameters of modules other than the one it initialises, so "
                             "its rows cannot be created rank by rank equal to an unsharded build")
        return func(*args, **kwargs)


def _draw_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the unsharded build draws in: float64 is only ever exact fsdp's master of fp32."""
    return torch.float32 if dtype == torch.float64 else dtype


def fill_adapters(model: nn.Module) -> None:
    """peft's initialisation of every LoRA adapter (A as nn.Linear's default, B zeros), in the
    model's module order: the same draws sharded or not (the adapters are whole on every rank)."""
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and callable(getattr(module, "reset_lora_parameters", None)):
            for adapter in lora_a:
                module.reset_lora_parameters(adapter, True)


def fill_hf(model: nn.Module) -> None:
    """The values of a meta-built hf model, given memory by `model.materialize`: from its files
    or its config (module docstring). LoRA on such a base: lora.fill_lora."""
    source = getattr(model, SOURCE_ATTR)
    if source:
        fill_from_files(model, source)
    else:
        fill_from_config(model)


def values_source(model: nn.Module) -> str | None:
    """Where `fill_hf` takes a model's values from (a folder, "" for its config), or None when
    it cannot: not a meta-built hf model."""
    return getattr(model, SOURCE_ATTR, None)
