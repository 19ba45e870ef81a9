"""Base-hash benchmark: what identifying a LoRA run's frozen base costs at a worker's start.

For Llama models built from a config (~100M and ~1B parameters), in bf16 and in fp32, saved
with `save_pretrained` (safetensors) to a temporary folder, this measures:
- `state_dict_hash`: hashing the model's state dict in memory (the definition for bases built
  from a seed; the one every start used before the folder hash);
- `files_hash` of the saved weights on 1 and on 4 threads (page cache warm: the file was just
  written; a cold read adds the disk's time);
- `folder_hash` twice: the first computes and caches (per node), the second reads the cache.
Each as seconds and GB/s, with a projection to a 7B base (14 GB of bf16) at the files_hash rates.
Prints a table, then one JSON line of figures (the last line of stdout).

Run: .venv/bin/python benchmarks/base_hash.py [--sizes 100m,1b] [--dtypes bf16,fp32]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from elastic_train.training.basehash import files_hash, folder_hash, state_dict_hash, weight_files

SIZES = {  # hidden, intermediate, layers, heads, vocab
    "100m": (768, 2048, 12, 12, 32000),
    "1b": (2048, 5504, 18, 16, 32000),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(size: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, vocab = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():  # values that are not all zeros, quickly (init would take minutes here)
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    return model


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(size: str, dtype_name: str, scratch: Path) -> dict:
    model = build(size, DTYPES[dtype_name])
    params = sum(p.numel() for p in model.parameters())
    folder = scratch / f"{size}-{dtype_name}"
    model.save_pretrained(folder)
    files = weight_files(folder)
    nbytes = sum(f.stat().st_size for f in files)
    row = {"size": size, "dtype": dtype_name, "params": params, "bytes": nbytes}
    t0 = time.perf_counter()
    state_dict_hash(model)
    row["state_dict_s"] = time.perf_counter() - t0
    del model
    row["files_1t_s"], one = timed(lambda: files_hash(files, threads=1))
    row["files_4t_s"], four = timed(lambda: files_hash(files, threads=4))
    assert one == four
    os.environ["ELASTIC_TRAIN_CACHE"] = str(scratch / "cache")
    row["folder_first_s"], first = timed(lambda: folder_hash(folder))
    row["folder_cached_s"], cached = timed(lambda: folder_hash(folder))
    assert first == cached == one
    for key in ("state_dict", "files_1t", "files_4t", "folder_first"):
        row[f"{key}_gb_per_s"] = nbytes / 1e9 / row[f"{key}_s"]
    row["projected_7b_bf16_s"] = 14e9 / 1e9 / max(row["files_1t_gb_per_s"], row["files_4t_gb_per_s"])
    shutil.rmtree(folder)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100m,1b")
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="base-hash-") as tmp:
        for size in args.sizes.split(","):
            for dtype_name in args.dtypes.split(","):
                rows.append(measure(size, dtype_name, Path(tmp)))
                r = rows[-1]
                print(f"{size:>5} {dtype_name:>4} {r['params'] / 1e6:7.0f}M {r['bytes'] / 1e9:5.2f} GB"
                      f"  state_dict {r['state_dict_s']:6.2f} s ({r['state_dict_gb_per_s']:.2f} GB/s)"
                      f"  files 1t {r['files_1t_s']:6.2f} s ({r['files_1t_gb_per_s']:.2f} GB/s)"
                      f"  4t {r['files_4t_s']:6.2f} s ({r['files_4t_gb_per_s']:.2f} GB/s)"
                      f"  cached {r['folder_cached_s'] * 1e3:.1f} ms", flush=True)
    print(json.dumps({"benchmark": "base_hash", "cpus": os.cpu_count(),
                      "load_1min": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
