"""A pretrained base read by shard: each rank's peak memory with LoRA on a ~1.1B bf16 Llama,
train.sharding=fsdp on 2 gloo ranks (issue 37).

Writes a Llama base into a scratch folder (hidden 2048, 22 layers, vocab 32000: TinyLlama's
shape, 1.1B parameters, bf16 safetensors, random values streamed to the file one tensor at a time)
and a tiny one of the same vocabulary. For each base, 2 real gloo processes (spawned) run what a
worker runs for LoRA (r=8, q_proj and v_proj, `model.base_dtype=bf16`): the meta build
(`build_meta_model`), then `build._shard` (the frozen base sharded on meta, each rank reading its
rows of every tensor from the files: hfshards.py), AdamW on the adapters and `--steps`
`train_step`s (default 0: the build alone) of one 32-token row per rank. Figures per rank:
VmHWM right after the build and after the steps;
the issue's measure is the big base's peak minus the tiny base's, over the base's bytes (1.0 would
be one whole base per rank; 2.95 before issue 37). With `--unsharded` the same for
train.sharding=none (every rank loads the whole base). Prints a table, then one JSON line.

Run: .venv/bin/python benchmarks/sharding_pretrained.py [--layers 22] [--steps 0] [--unsharded] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _gloo import gather_and_finish, vm_hwm_bytes

GiB = 1 << 30


def llama_config(hidden: int, layers: int, intermediate: int, heads: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4,
                       max_position_embeddings=2048, tie_word_embeddings=False)


def write_base(folder: Path, config) -> int:
    """config.json and model.safetensors in bf16, values N(0, 0.02) written one tensor at a
    time (a header, then each tensor's bytes): never the whole model in memory. Returns bytes."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()
                  if "rotary" not in n}
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator().manual_seed(0)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            values = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            f.write(values.view(torch.uint8).numpy().tobytes())
    return (folder / "model.safetensors").stat().st_size


def _rank(rank: int, world_size: int, init: str, base: str, sharding: str, steps: int,
          out: str) -> None:
    from elastic_train.config import load_config
    from elastic_train.data.batches import pad_rows
    from elastic_train.training.build import _shard
    from elastic_train.training.losses import LossModule
    from elastic_train.training.memory import return_large_frees_to_os
    from elastic_train.training.model import build_meta_model, build_model, can_materialize
    from elastic_train.training.optim import build_optimizer
    from elastic_train.training.reduce import ExactGradSum
    from elastic_train.training.step import StepSetup, train_step

    torch.set_num_threads(1)
    if sharding == "fsdp":  # as a worker's fsdp build on CPU (build.build_training)
        return_large_frees_to_os()
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world_size)
    cfg = load_config(None, ["model.name=hf", f"model.path={base}", "model.lora.r=8",
                             "model.lora.alpha=16", "model.lora.target_modules=[q_proj, v_proj]",
                             "model.base_dtype=bf16", f"train.sharding={sharding}",
                             "train.grad_reduce=exact", "data.max_seq_len=64"])
    torch.manual_seed(0)
    if sharding == "fsdp":
        model = build_meta_model(cfg.model, 64)
        assert can_materialize(model)
        root = LossModule(model)
        sharded, reducer = _shard(root, model, cfg, torch.device("cpu"), exact=True), None
    else:
        model = build_model(cfg.model, 64)
        root, sharded = LossModule(model), None
        reducer = ExactGradSum(model, torch.device("cpu"))
    built = vm_hwm_bytes()
    optimizer = build_optimizer(model, cfg.optim, use_gpu=False)
    setup = StepSetup(device=torch.device("cpu"), world_size=world_size, exact=reducer, sharded=sharded)
    rng = np.random.default_rng(0)
    mbs = [pad_rows([(p * 10, rng.integers(0, 32000, 32))], p) for p in range(world_size)]
    for step in range(steps):
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        train_step(root, model, optimizer, mine, setup=setup,
                   data_targets=sum(mb.targets for mb in mbs), step=step, lr=1e-4)
    figures = {"built": built, "peak": vm_hwm_bytes()}
    gather_and_finish(figures, out)


def measure(base: Path, sharding: str, steps: int, tmp: Path) -> list[dict]:
    out = tmp / f"out-{base.name}-{sharding}.json"
    mp.start_processes(_rank, args=(2, str(tmp / f"init-{base.name}-{sharding}"), str(base), sharding,
                                    steps, str(out)), nprocs=2, start_method="spawn")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--steps", type=int, default=0, help="train steps after the build (0: the "
                        "build alone; bf16 on a loaded 2-core CPU takes minutes a step)")
    parser.add_argument("--unsharded", action="store_true", help="also train.sharding=none")
    parser.add_argument("--keep", help="write the bases here and keep them (else a scratch folder)")
    args = parser.parse_args()
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="sharding-pretrained-"))
    os.environ["ELASTIC_TRAIN_CACHE"] = str(tmp / "cache")  # the base hash computed, not cached
    try:
        big = tmp / "big"
        big_bytes = (big / "model.safetensors").stat().st_size if (big / "model.safetensors").exists() \
            else write_base(big, llama_config(2048, args.layers, 5632, 32))
        tiny = tmp / "tiny"
        tiny_bytes = write_base(tiny, llama_config(64, 2, 128, 4))
        rows = []
        for sharding in ("fsdp", "none") if args.unsharded else ("fsdp",):
            small = measure(tiny, sharding, args.steps, tmp)
            large = measure(big, sharding, args.steps, tmp)
            for rank in range(2):
                row = {"sharding": sharding, "rank": rank, "base_bytes": big_bytes,
                       "tiny_base_bytes": tiny_bytes, "tiny_peak": small[rank]["peak"],
                       "built": large[rank]["built"], "peak": large[rank]["peak"],
                       "peak_minus_tiny_over_base": (large[rank]["peak"] - small[rank]["peak"]) / big_bytes}
                rows.append(row)
                print(f"{sharding:5} rank {rank}: base {big_bytes / GiB:.2f} GiB, tiny run peak "
                      f"{row['tiny_peak'] / GiB:.2f} GiB, built {row['built'] / GiB:.2f} GiB, peak "
                      f"{row['peak'] / GiB:.2f} GiB: (peak - tiny) / base = "
                      f"{row['peak_minus_tiny_over_base']:.2f}")
        print(json.dumps({"benchmark": "sharding_pretrained", "layers": args.layers,
                          "steps": args.steps, "rows": rows}))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
