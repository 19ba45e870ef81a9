"""Compile benchmark: eager against `train.compile` on CPU, and the compile cache's worth.

For the embedded GPT (default config) and a tiny Llama (a transformers LlamaConfig, 2 layers,
d=128), each in a fresh process (a restarted worker's situation), on the embedded corpus's
bucketed micro-batches (micro_batch_tokens 2048), world size 1, one torch thread:
- eager: first step seconds and steady real tokens/s;
- compiled, cold cache: first step seconds (Inductor compiles), steady tokens/s;
- compiled, warm cache: a new process with the cache the cold one left (a restart on the same
  node, or a new node seeded from the run folder): first step seconds.
Steady: the steps after `--warmup` (by then the single-row graph is compiled too), timed alike.
The compiled model goes through `elastic_train.training.compile.compile_model`, the loop's path.

Not measured here: recovery time (death -> next step) with compile on under Ray; run
`benchmarks/recovery.py` with `train.compile=true` for that (not done yet, see BENCHMARKS.md).

Run: flock /tmp/et_ray.lock .venv/bin/python benchmarks/compile.py [--steps 12] [--warmup 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

MICRO_BATCH_TOKENS = 2048


def _run(model_kind: str, mode: str, cache: str, steps: int, warmup: int, out: str) -> None:
    """One process: `steps` optimizer steps of one micro-batch each; writes its figures."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import torch

    from elastic_train.config import ModelConfig, OptimConfig, load_config
    from elastic_train.data.blocks import iter_rank_steps, make_reader
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.data.plan import StreamSpec
    from elastic_train.data.prepare import default_corpus_dir
    from elastic_train.preflight.inputs import data_tables
    from elastic_train.training.compile import compile_model
    from elastic_train.training.losses import LossModule
    from elastic_train.training.model import build_model
    from elastic_train.training.optim import build_optimizer

    torch.set_num_threads(1)
    cfg = load_config(None, [f"data.micro_batch_tokens={MICRO_BATCH_TOKENS}"])
    info = inspect_dataset(str(default_corpus_dir()))
    cfg.data.path = info.path
    torch.manual_seed(0)
    if model_kind == "gpt":
        model = build_model(cfg.model, info.max_length)
    else:
        from transformers import LlamaConfig

        folder = Path(cache).parent / "tiny-llama"
        LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=info.max_length).save_pretrained(folder)
        model = build_model(ModelConfig(name="hf", path=str(folder)), info.max_length)
    loss = LossModule(model)
    if mode != "eager":
        compile_model(model, [])
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    spec = StreamSpec(8, MICRO_BATCH_TOKENS, cfg.data.shuffle_window, 0, True)
    reader = make_reader("pyarrow", data_tables(cfg, info).train)
    stream = iter_rank_steps(reader, spec, partitions=list(range(8)), epoch=0)
    times, tokens = [], []
    for micro_batches, _ in stream:
        for mb in micro_batches:
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_sum, n = loss(mb.to_batch(torch.device("cpu")))
            (loss_sum / max(n, 1)).backward()
            optimizer.step()
            times.append(time.perf_counter() - t0)
            tokens.append(mb.real_tokens)
            if len(times) == steps:
                break
        if len(times) == steps:
            break
    reader.close()
    steady = sum(tokens[warmup:]) / sum(times[warmup:])
    Path(out).write_text(json.dumps({"first_step_s": times[0], "tokens_per_s": steady}))


def measure(model_kind: str, mode: str, cache: str, steps: int, warmup: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    p = mp.get_context("spawn").Process(target=_run, args=(model_kind, mode, cache, steps, warmup, out))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{model_kind} {mode}: exit {p.exitcode}")
    return json.loads(Path(out).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    figures = {"benchmark": "compile", "steps": args.steps, "warmup": args.warmup,
               "load_avg_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="et-compile-bench-") as tmp:
        for kind in ("gpt", "llama"):
            cache = str(Path(tmp, kind, "inductor"))
            for mode in ("eager", "cold", "warm"):
                got = measure(kind, mode, cache, args.steps, args.warmup)
                print(f"{kind:6s} {mode:6s} first step {got['first_step_s']:7.2f} s  "
                      f"steady {got['tokens_per_s']:8.0f} tokens/s", flush=True)
                for key, value in got.items():
                    figures[f"{kind}_{mode}_{key}"] = round(value, 3)
            figures[f"{kind}_compiled_speedup"] = round(
                figures[f"{kind}_cold_tokens_per_s"] / figures[f"{kind}_eager_tokens_per_s"], 3)
    figures["load_avg_1m_end"] = os.getloadavg()[0]
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
