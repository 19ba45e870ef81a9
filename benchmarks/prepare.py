"""Prepare benchmark: tokens/s of `prepare` as a Ray Data pipeline on 1 vs 2 CPUs, and of the
single-process `prepare`, on the embedded corpus's source files (`prepare.stdlib_source_files()`,
taken on up to `--corpus-mb` 16 MB, all there is: about 8.4 MB on Python 3.11; on the embedded
4 MB alone the fixed costs of three Ray Data executions hide the second CPU).

    flock /tmp/et_ray.lock .venv/bin/python benchmarks/prepare.py [--max-seq-len 512] [--corpus-mb 16]
                                                                 [--repeat 2]

For bytes and for a byte-level BPE tokenizer (vocabulary 4096, trained here on a few modules):
the single-process prepare, then `prepare_ray` on a fresh local Ray cluster of 1 CPU and one of 2
CPUs: `cold` is the first run on a new cluster (its worker processes start and import), `warm`
(the unsuffixed figures) the best of `--repeat` runs after it, what a long-lived cluster gives;
the local figure is the best of `--repeat` too. Cluster start-up is not counted (`ray_start_s`).
On a shared machine, other processes' load shows in every figure (`load_average_1m` is
recorded): compare figures of one run. Every output is checked to hold the same shards. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from elastic_train.cluster.prepare_ray import prepare_ray  # noqa: E402
from elastic_train.data.prepare import prepare, stdlib_source_files  # noqa: E402


def train_bpe(folder: Path, vocab_size: int = 4096) -> str:
    """A byte-level BPE tokenizer.json trained on a few standard-library modules."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([str(stdlib / name) for name in ("argparse.py", "typing.py", "inspect.py")],
                    trainer)
    path = folder / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


def digest(folder: Path) -> str:
    """A hash of the shards' contents (the files' bytes, in name order)."""
    sha = hashlib.sha256()
    for path in sorted(folder.glob("*.parquet")):
        sha.update(path.read_bytes())
    return sha.hexdigest()[:16]


def timed(run, out: Path, repeat: int) -> tuple[float, dict, str]:
    """The best of `repeat` runs of `run(out)`: seconds, its stats, and the shards' digest."""
    best = None
    for attempt in range(repeat):
        folder = out.with_name(f"{out.name}-{attempt}")
        t0 = time.perf_counter()
        stats = run(folder)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[0]:
            best = (seconds, stats, digest(folder))
        shutil.rmtree(folder)
    return best


def ray_runs(files: list[Path], work: Path, tokenizers: dict, max_seq_len: int, num_cpus: int,
             repeat: int) -> tuple[float, dict]:
    """Start a local cluster of `num_cpus` CPUs; time prepare_ray for each tokenizer on it: the
    first run (cold), then the best of `repeat` (warm)."""
    import ray

    started = time.perf_counter()
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    start_s = time.perf_counter() - started
    results = {}
    try:
        for name, tokenizer in tokenizers.items():
            def run(out: Path, tokenizer=tokenizer) -> dict:
                return prepare_ray(files, out, tokenizer=tokenizer, max_seq_len=max_seq_len,
                                   progress=False)

            results[f"{name}-cold"] = timed(run, work / f"ray{num_cpus}-{name}-cold", 1)
            results[f"{name}-warm"] = timed(run, work / f"ray{num_cpus}-{name}-warm", repeat)
    finally:
        ray.shutdown()
    return start_s, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--corpus-mb", type=float, default=16.0,
                        help="MB of standard-library source (the embedded corpus takes the first 4)")
    parser.add_argument("--repeat", type=int, default=2, help="warm runs; the best one counts")
    args = parser.parse_args()
    files = stdlib_source_files(int(args.corpus_mb * 1e6))
    corpus_bytes = sum(file.stat().st_size for file in files)
    work = Path(tempfile.mkdtemp(prefix="elastic_train-bench-prepare-"))
    try:
        tokenizers = {"bytes": None, "bpe": train_bpe(work)}
        local = {}
        for name, tokenizer in tokenizers.items():
            def run(out: Path, tokenizer=tokenizer) -> dict:
                return prepare(files, out, tokenizer=tokenizer, max_seq_len=args.max_seq_len)

            local[name] = timed(run, work / f"local-{name}", args.repeat)
        start1, ray1 = ray_runs(files, work, tokenizers, args.max_seq_len, 1, args.repeat)
        start2, ray2 = ray_runs(files, work, tokenizers, args.max_seq_len, 2, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record = {"benchmark": "prepare", "files": len(files), "corpus_bytes": corpus_bytes,
              "max_seq_len": args.max_seq_len, "cpu_count": os.cpu_count(), "repeat": args.repeat,
              "load_average_1m": round(os.getloadavg()[0], 2),
              "ray_start_s": {"1cpu": round(start1, 2), "2cpu": round(start2, 2)}}
    print(f"{len(files)} files, {corpus_bytes} bytes; Ray start-up {start1:.1f} s (1 CPU), "
          f"{start2:.1f} s (2 CPUs), not counted below")
    for name in tokenizers:
        runs = {"local": local[name], "ray_1cpu": ray1[f"{name}-warm"], "ray_2cpu": ray2[f"{name}-warm"],
                "ray_1cpu_cold": ray1[f"{name}-cold"], "ray_2cpu_cold": ray2[f"{name}-cold"]}
        tokens = local[name][1]["tokens"]
        rates = {key: tokens / seconds for key, (seconds, _, _) in runs.items()}
        same = len({run[2] for run in runs.values()}) == 1
        for key, (seconds, _, _) in runs.items():
            print(f"{name:5s} {key:13s} {seconds:7.2f} s {rates[key]:10.0f} tokens/s")
        record[name] = {"tokens": tokens, "rows": local[name][1]["rows"],
                        **{f"{key}_s": round(run[0], 2) for key, run in runs.items()},
                        **{f"{key}_tokens_per_s": round(rate) for key, rate in rates.items()},
                        "ray_2cpu_over_1cpu": round(rates["ray_2cpu"] / rates["ray_1cpu"], 3),
                        "ray_2cpu_over_local": round(rates["ray_2cpu"] / rates["local"], 3),
                        "identical_shards": same}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
