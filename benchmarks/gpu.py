"""GPU benchmark (issue 36): elastic-train against a bare PyTorch loop on the same model and shapes.

One command, sized for one device call (about 6 minutes on an H200, Ray's starts included):
    python benchmarks/gpu.py [--out DIR] [--budget-s 420] [--cases a,b,...]
    python benchmarks/gpu.py --cpu-smoke        # tiny shapes on CPU (automatic without CUDA)

Models: `gpt100m` (the embedded GPT: 12 layers, d_model 768, 12 heads), `gpt1b` (20 layers,
d_model 2048, 16 heads: 1.0B matmul weights), `llama` (a Llama-shaped `model.name=hf` model built
from a transformers LlamaConfig, no download: 16 layers, hidden 1024, GQA 16/8 heads, vocab 32000).
Data: synthetic packed rows of `seq` tokens (1024), so every micro-batch is [micro/seq, seq] in
both loops; 16k-token micro-batches, 64k-token steps, bf16 autocast, fused AdamW, grad clip 1.0.

Each case runs in its own process under its own time limit (`timeout` in the case table, and
never past the budget left), and writes its JSON line as soon as it ends:
- `bare`: plain torch, no Ray and no elastic_train loop (the model is built by the project's
  builder so that it is the same module): the ceiling;
- `ours`: `elastic-train train` (the real command line, a local Ray cluster, 1 worker, GPU if
  any), reading the run's metrics.jsonl (the step breakdown) and events.jsonl (the profile of
  `log.profile_steps`, rank 0).
Every line holds tokens/s (real tokens, steady window: past the warm-up, before the profiled
steps), MFU = flops_per_token x tokens/s / peak, with flops_per_token the project's
`model_flops_per_token` (6 N + 12 L d T, T = seq, one convention for the GPT and the hf
model since 2026-12-07: the hf lines measured before were 6 N of all its parameters), the peak
allocated bytes per parameter, and a torch.profiler summary (top kernels by CUDA time, the
fraction of the step the GPU idles, the host call sites that synchronise). A last `pairs` line
gives ours/bare per model and mode. Lines go to OUT/gpu.jsonl and (not a CPU smoke's)
are appended to benchmarks/results.jsonl, each with the device's name.

Peak FLOPs: dense bf16 of the device (H100/H200 989e12, A100 312e12), or PEAK_FLOPS; on CPU the
MFU figure means nothing (1e12).
"""

# run_all: skip  (a device's benchmark: one call of its own on a GPU machine)
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.jsonl"

GPU_SHAPES = {"seq": 1024, "micro": 16384, "global": 65536}
CPU_SHAPES = {"seq": 128, "micro": 512, "global": 1024}
GPU_MODELS = {
    "gpt100m": {"n_layer": 12, "d_model": 768, "n_head": 12},
    "gpt1b": {"n_layer": 20, "d_model": 2048, "n_head": 16},
    "llama": {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000},
}
CPU_MODELS = {
    "gpt100m": {"n_layer": 2, "d_model": 64, "n_head": 2},
    "gpt1b": {"n_layer": 2, "d_model": 128, "n_head": 4},
    "llama": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
}
# (name, kind, model, compile, reduce, steps, timeout_s[, micro-batch tokens]), most wanted first:
# a short budget drops the last ones (`--cases` runs the named ones in its own order). steps:
# warm-up, steady window, then 2 profiled steps. A `_m64k` case takes the whole 64k-token step as
# one micro-batch: does the 100M GPT's MFU rise with fewer, larger micro-batches (the GPU default
# of data.micro_batch_tokens is at most 16384, config/devices.py)?
CASES = [
    ("bare_gpt100m_eager", "bare", "gpt100m", False, "-", 30, 60),
    ("ours_gpt100m_eager_ddp", "ours", "gpt100m", False, "ddp", 30, 90),
    ("ours_gpt100m_eager_exact", "ours", "gpt100m", False, "exact", 30, 90),
    ("bare_gpt1b_eager", "bare", "gpt1b", False, "-", 16, 90),
    ("ours_gpt1b_eager_ddp", "ours", "gpt1b", False, "ddp", 16, 120),
    ("bare_gpt100m_compile", "bare", "gpt100m", True, "-", 30, 120),
    ("ours_gpt100m_compile_ddp", "ours", "gpt100m", True, "ddp", 30, 150),
    ("ours_gpt1b_eager_exact", "ours", "gpt1b", False, "exact", 16, 120),
    ("bare_llama_eager", "bare", "llama", False, "-", 16, 60),
    ("ours_llama_eager_ddp", "ours", "llama", False, "ddp", 16, 180),
    ("bare_gpt100m_eager_m64k", "bare", "gpt100m", False, "-", 30, 60, 65536),
    ("ours_gpt100m_eager_exact_m64k", "ours", "gpt100m", False, "exact", 30, 90, 65536),
    ("bare_gpt100m_compile_m64k", "bare", "gpt100m", True, "-", 30, 120, 65536),
    ("ours_gpt100m_compile_exact_m64k", "ours", "gpt100m", True, "exact", 30, 150, 65536),
]


def case_shapes(args: argparse.Namespace, case: dict) -> dict:
    """The case's seq, micro-batch and step tokens: the device's shapes, its own micro-batch
    (a CPU smoke scales it: the whole step)."""
    shapes = dict(CPU_SHAPES if args.cpu_smoke else GPU_SHAPES)
    if case.get("micro"):
        shapes["micro"] = shapes["global"] if args.cpu_smoke else case["micro"]
    return shapes


def windows(steps: int) -> tuple[int, int, list[int]]:
    """(first steady step, last steady step, [first, last] profiled step), 1-based."""
    warmup = max(2, steps // 3)
    return warmup + 1, steps - 2, [steps - 1, steps]


def peak_flops(device_name: str) -> float:
    if os.environ.get("PEAK_FLOPS"):
        return float(os.environ["PEAK_FLOPS"])
    name = device_name.upper()
    for marks, flops in ((("H100", "H200", "H800", "GH200"), 989e12), (("A100", "A800"), 312e12),
                         (("L40S",), 362e12), (("L4",), 121e12), (("4090",), 165e12)):
        if any(m in name for m in marks):
            return flops
    return 1e12


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# ---- data and models, shared by both loops ---------------------------------------------------

def write_data(folder: Path, seq: int, rows: int, vocab: int = 256) -> Path:
    """Packed rows of `seq` random tokens (the prepare contract: id, tokens, length), in several
    shards of small row groups so every data partition gets blocks."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    per_file = max(rows // 4, 1)
    for f in range(4):
        tokens = rng.integers(0, vocab, size=(per_file, seq), dtype=np.int32)
        table = pa.table({
            "id": pa.array(np.arange(f * per_file, (f + 1) * per_file, dtype=np.int64)),
            "tokens": pa.array(list(tokens), type=pa.list_(pa.int32())),
            "length": pa.array(np.full(per_file, seq, dtype=np.int32)),
        })
        pq.write_table(table, folder / f"part-{f:03d}.parquet", row_group_size=16)
    return folder


def llama_folder(folder: Path, shape: dict, seq: int) -> Path:
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=seq, **shape).save_pretrained(folder)
    return folder


def model_config(model: str, shape: dict, work: Path, seq: int):
    from elastic_train.config import ModelConfig

    if model == "llama":
        return ModelConfig(name="hf", path=str(llama_folder(work / "llama", shape, seq)))
    return ModelConfig(name="gpt", **shape)


# ---- the bare loop ---------------------------------------------------------------------------

def run_bare(args: argparse.Namespace, case: dict) -> dict:
    """Plain torch: the model, fused AdamW, bf16 autocast, K micro-batches of [rows, seq] summed
    into one step (loss sum / targets), clip, step. No Ray, no elastic_train loop."""
    import torch
    import torch.nn.functional as F

    from elastic_train.observe.profile import make_profiler, step_mark, summarize
    from elastic_train.training.model import build_model, count_parameters, model_flops_per_token

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # as a CPU worker does
    shapes = case_shapes(args, case)
    seq, k = shapes["seq"], shapes["global"] // shapes["micro"]
    rows = shapes["micro"] // seq
    torch.manual_seed(0)
    mcfg = model_config(case["model"], case["shape"], Path(args.work), seq)
    model = build_model(mcfg, seq).to(device)
    if case["compile"]:
        for module in model.modules():
            if type(module).__name__ in ("Block", "LlamaDecoderLayer"):
                module.compile(dynamic=False)
    hf = mcfg.name == "hf"
    vocab = case["shape"].get("vocab_size", 256)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda or None)
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [torch.randint(0, min(vocab, 256), (rows, seq), device=device) for _ in range(k)]
    targets = k * rows * (seq - 1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for tokens in batches:
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                out = model(input_ids=tokens).logits if hf else model(tokens)
                loss = F.cross_entropy(out[:, :-1].float().reshape(-1, out.shape[-1]),
                                       tokens[:, 1:].reshape(-1), reduction="sum")
            (loss / targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    first, last, profiled = windows(case["steps"])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_first = time.perf_counter()
    for _ in range(first - 1):
        step()
    sync()
    warmup_s = time.perf_counter() - t_first
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(last - first + 1):
        step()
    sync()
    steady_s = (time.perf_counter() - t0) / (last - first + 1)
    prof = make_profiler(device)
    with prof:
        for _ in profiled:
            with step_mark():
                step()
        sync()
    n = count_parameters(model)
    fpt = model_flops_per_token(mcfg, seq, model)
    tps = k * rows * seq / steady_s
    return {"step_s": steady_s, "tokens_per_s": tps, "mfu": fpt * tps / args.peak,
            "flops_per_token": fpt, "parameters": n, "warmup_s": warmup_s,
            "peak_allocated_bytes_per_param": torch.cuda.max_memory_allocated() / n if cuda else None,
            "profile": summarize(prof)}


# ---- elastic-train through its command line ------------------------------------------------

def wall_rate(records: list[dict]) -> float:
    """Real tokens per second of consecutive step records by their wall clock: the tokens of all
    but the first over the time from the first record to the last."""
    return sum(r["real_tokens"] for r in records[1:]) / (records[-1]["time"] - records[0]["time"])


def run_ours(args: argparse.Namespace, case: dict) -> dict:
    """`elastic-train train` on a local Ray cluster, 1 worker; figures from the run folder."""
    import torch

    from elastic_train.training.model import build_model, count_parameters, model_flops_per_token

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    shapes = case_shapes(args, case)
    seq = shapes["seq"]
    work = Path(args.work)
    mcfg = model_config(case["model"], case["shape"], work, seq)
    first, last, profiled = windows(case["steps"])
    store = work / "runs"
    overrides = [
        f"run.name={case['name']}", f"run.storage_path={store}", "scaling.min_workers=1",
        "scaling.max_workers=1", f"scaling.use_gpu={str(cuda).lower()}", f"data.path={args.data}",
        f"data.max_seq_len={seq}", f"data.micro_batch_tokens={shapes['micro']}",
        f"data.global_batch_tokens={shapes['global']}", f"train.max_steps={case['steps']}",
        f"train.precision={'bf16' if cuda else 'fp32'}", f"train.grad_reduce={case['reduce']}",
        "checkpoint.every_steps=0", "checkpoint.keep_best=false", "eval.fraction=0",
        "eval.every_steps=0", f"log.peak_flops={args.peak}", "log.progress=lines",
        f"log.profile_steps=[{profiled[0]}, {profiled[1]}]",
    ]
    if mcfg.name == "hf":
        overrides += ["model.name=hf", f"model.path={mcfg.path}"]
    else:
        overrides += [f"model.{k}={v}" for k, v in case["shape"].items()]
    if case["compile"]:
        overrides += ["train.compile=true", "train.compile_modules=[Block]"]
    cmd = [sys.executable, "-m", "elastic_train.cli", "train", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall_s = time.perf_counter() - t0
    run = store / case["name"]
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-2000:], "wall_s": wall_s}
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "eval_loss" not in r]
    steady = [r for r in steps if first <= r["step"] <= last]
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    with torch.device("meta"):
        meta = build_model(mcfg, seq)
    n = count_parameters(meta)
    fpt = model_flops_per_token(mcfg, seq, meta)
    # by the records' wall clock, as the bare loop's clock runs: a step's step_time_s stops before
    # its record is written and its hooks run (that tail is host_s), so rates from it ran ~1% high
    step_s = (steady[-1]["time"] - steady[0]["time"]) / (len(steady) - 1)
    tps = wall_rate(steady)
    width = max(2, (len(steady) - 1) // 3)  # steps a window: three of them, at least 2 steps each
    windows_tps = [wall_rate(steady[i:i + width + 1]) for i in range(0, len(steady) - width, width)]
    breakdown = {f: statistics.median(r.get(f, 0.0) for r in steady) * 1e3 for f in
                 ("step_time_s", "data_wait_s", "forward_backward_s", "optimizer_s", "host_s")}
    peak = max((r.get("cuda_peak_allocated_bytes", 0) for r in steps), default=0)
    profile = next((e for e in events if e.get("event") == "profile"), {})
    return {
        "step_s": step_s, "tokens_per_s": tps, "mfu": fpt * tps / args.peak, "flops_per_token": fpt,
        "parameters": n, "wall_s": wall_s, "first_step_s": steps[0]["step_time_s"],
        "window_tokens_per_s": windows_tps,
        "window_spread": (max(windows_tps) / min(windows_tps) - 1) if windows_tps else None,
        "breakdown_ms": breakdown, "padding_efficiency": summary.get("padding_efficiency"),
        "peak_allocated_bytes_per_param": peak / n if peak else None,
        "grad_reduce": summary.get("grad_reduce"), "precision": summary.get("precision"),
        "micro_batch_tokens": shapes["micro"], "startup": summary.get("startup"),
        "profile": {k: v for k, v in profile.items() if k not in ("event", "time")},
    }


# ---- the driver: one process per case, each under its own time limit ------------------------

def run_case(args: argparse.Namespace, case: dict, timeout_s: float) -> dict:
    """`case` in a child process (its own session, killed whole past `timeout_s`)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json", dir=args.work, delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, __file__, "--one", json.dumps(case), "--result", result_path,
           "--work", args.work, "--data", args.data, "--peak", str(args.peak)]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        return {"error": f"timed out after {timeout_s:.0f} s"}
    text = Path(result_path).read_text()
    if proc.returncode != 0 or not text:
        return {"error": f"exit {proc.returncode}", "seconds": time.perf_counter() - t0}
    return json.loads(text)


def one(args: argparse.Namespace) -> None:
    case = json.loads(args.one)
    result = (run_bare if case["kind"] == "bare" else run_ours)(args, case)
    Path(args.result).write_text(json.dumps(result))


def emit(line: dict, out: Path) -> None:
    text = json.dumps(line)
    print(text, flush=True)
    with open(out / "gpu.jsonl", "a") as f:
        f.write(text + "\n")
    if not line.get("cpu_smoke"):  # a smoke's figures are no result
        with open(RESULTS, "a") as f:
            f.write(text + "\n")


def pairs(results: dict[str, tuple[dict, dict]]) -> list[dict]:
    """ours/bare tokens/s for every ours case whose bare one (same model, compile and
    micro-batch) ran: {name: (case, result)}."""
    def key(case: dict) -> tuple:
        return case["model"], case["compile"], case.get("micro")

    bares = {key(c): r for c, r in results.values() if c["kind"] == "bare"}
    out = []
    for name, (case, r) in results.items():
        if case["kind"] != "ours" or "tokens_per_s" not in r:
            continue
        bare = bares.get(key(case), {})
        if "tokens_per_s" in bare:
            out.append({"case": name, "ours_over_bare": r["tokens_per_s"] / bare["tokens_per_s"],
                        "mfu": r["mfu"], "bare_mfu": bare["mfu"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "gpu_bench_out"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="all cases together")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--peak", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.one:
        return one(args)
    import torch

    args.cpu_smoke = args.cpu_smoke or not torch.cuda.is_available()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.work = tempfile.mkdtemp(prefix="gpu_bench_", dir=os.environ.get("TMPDIR"))
    name = device_name()
    args.peak = peak_flops(name) if not args.cpu_smoke else 1e12
    shapes = CPU_SHAPES if args.cpu_smoke else GPU_SHAPES
    models = CPU_MODELS if args.cpu_smoke else GPU_MODELS
    most_steps = max(c[5] for c in CASES)
    args.data = str(write_data(Path(args.work) / "data", shapes["seq"],
                               2 * most_steps * shapes["global"] // shapes["seq"]))
    by_name = {c[0]: c for c in CASES}
    unknown = [n for n in args.cases.split(",") if n and n not in by_name]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(by_name)})")
    chosen = [by_name[n] for n in args.cases.split(",") if n] or list(CASES)
    if args.cpu_smoke and not args.cases:  # compile on CPU takes minutes: left out of the smoke
        chosen = [c for c in chosen if not c[3]]
    head = {"benchmark": "gpu", "device": name, "torch": torch.__version__, "cpu_smoke": args.cpu_smoke,
            "peak_flops": args.peak, "shapes": shapes, "time": time.time()}
    emit({**head, "event": "start", "cases": [c[0] for c in chosen]}, out)
    results: dict[str, tuple[dict, dict]] = {}
    for case_name, kind, model, compiled, reduce, steps, timeout_s, *micro in chosen:
        left = args.budget_s - (time.perf_counter() - started)
        if left < min(timeout_s, 45):
            emit({**head, "case": case_name, "skipped": f"budget: {left:.0f} s left"}, out)
            continue
        if args.cpu_smoke:
            steps = 8
        case = {"name": case_name, "kind": kind, "model": model, "compile": compiled,
                "reduce": reduce, "steps": steps, "shape": models[model],
                "micro": micro[0] if micro else None}
        t0 = time.perf_counter()
        result = run_case(args, case, min(timeout_s * (3 if args.cpu_smoke else 1), left))
        results[case_name] = (case, result)
        emit({**head, "case": case_name, "kind": kind, "model": model, "compile": compiled,
              "grad_reduce": reduce, "steps": steps, "micro_batch_tokens": case_shapes(args, case)["micro"],
              "seconds": time.perf_counter() - t0, **result}, out)
    emit({**head, "event": "pairs", "pairs": pairs(results),
          "seconds": time.perf_counter() - started}, out)


if __name__ == "__main__":
    main()
