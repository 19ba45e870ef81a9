#!/usr/bin/env bash
# GPU smoke test (issue 6), for a machine with one or more CUDA GPUs. Steps 1-6 take several
# minutes on an H200 (a dozen Ray runs), step 7 up to its --budget-s: the whole script does not fit
# one 10-minute device call; run it in two (e.g. without step 7, then `--bench-only`).
#   bash scripts/gpu_smoke.sh
# 1. NCCL DDP + accumulation gradient vs one process, on the GPU (tests/test_dist.py logic, nccl),
#    also through each communication hook (fp16, bf16, PowerSGD's warm-up step).
# 2. elastic-train on Ray with 1 GPU worker: fp16 + GradScaler + adamw8bit, then bf16, then a crash
#    and resume (the resumed worker checks that the restored AdamW / 8-bit state lies on the GPU:
#    loop.check_state_device fails the run otherwise), then an 8-bit crash/resume and a model too
#    large for the GPU (refused with one message, within 60 s; alone: `--huge-only`); prints each
#    summary line. train.grad_reduce=auto
#    (the default) must choose exact on a GPU worker (docs/performance.md).
# 3. Throughput: a ~100M-parameter GPT (12 layers, d_model 768) in bf16 on 1 GPU worker, 60 steps:
#    steady tokens/s and MFU (log.peak_flops: H100/H200 dense bf16, 989e12; set PEAK_FLOPS for others).
# 7. (or alone: `bash scripts/gpu_smoke.sh --bench-only`, up to its --budget-s, 420 s: the cases
#    past the budget are skipped; name them with --cases in a second call) the GPU benchmark,
#    benchmarks/gpu.py: ~100M and ~1B GPT and a Llama-shaped model against a bare loop; its JSON
#    lines go to $OUT/gpu.jsonl (or gpu_bench_out/; copy them into benchmarks/results.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
if [ "${1:-}" = "--bench-only" ]; then
  shift
  exec $PY benchmarks/gpu.py "$@"
fi
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.cuda.get_device_name())"
STORE=$(mktemp -d)
COMMON=(scaling.use_gpu=true scaling.min_workers=1 scaling.max_workers=1 "run.storage_path=$STORE"
        train.max_steps=40 checkpoint.every_steps=10 log.progress=lines)
refuse_huge() {
  HUGE_START=$(date +%s)
  if .venv/bin/elastic-train train "${COMMON[@]}" run.name=huge model.n_layer=48 model.d_model=8192 \
      model.n_head=64 train.max_steps=2 2>&1 | tee "$STORE/huge.log"; then echo "huge model was not refused"; exit 1; fi
  HUGE_S=$(( $(date +%s) - HUGE_START ))
  # refused from its meta shapes before anything is allocated (training/memory.py): one line, in seconds
  grep -q "^error: .*does not fit: .*GiB.*what would fit" "$STORE/huge.log"
  [ "$(grep -c '^error:' "$STORE/huge.log")" = 1 ] || { echo "more than one error line"; exit 1; }
  [ "$HUGE_S" -lt 60 ] || { echo "huge model refused after ${HUGE_S} s, not within 60"; exit 1; }
  echo "huge model refused in ${HUGE_S} s"
}
if [ "${1:-}" = "--huge-only" ]; then refuse_huge; exit 0; fi
NGPU=$($PY -c "import torch; print(min(torch.cuda.device_count(), 2))")
$PY scripts/gpu_ddp_check.py "$NGPU"
.venv/bin/elastic-train train "${COMMON[@]}" run.name=fp16 train.precision=fp16 optim.name=adamw8bit
.venv/bin/elastic-train train "${COMMON[@]}" run.name=bf16 train.precision=bf16
.venv/bin/elastic-train train "${COMMON[@]}" run.name=crash train.precision=bf16 fault.crash_at_step=15
.venv/bin/elastic-train train "${COMMON[@]}" run.name=crash8 optim.name=adamw8bit fault.crash_at_step=15
refuse_huge
$PY - "$STORE" <<'PY'
import json, sys, pathlib
for run in ("fp16", "bf16", "crash", "crash8"):
    s = json.loads((pathlib.Path(sys.argv[1]) / run / "summary.json").read_text())
    print(run, {k: s[k] for k in ("status", "steps", "first_loss", "final_loss", "restarts", "skipped_steps",
                                  "grad_reduce", "grad_reduce_reason")})
    assert (s["grad_reduce"], s["grad_reduce_reason"]) in (
        ("exact", "auto: GPU workers"), ("exact", "auto: kept from the run's checkpoint (chosen at its first start)")), s
PY
PEAK=${PEAK_FLOPS:-989e12}
.venv/bin/elastic-train train "${COMMON[@]}" run.name=gpt100m train.precision=bf16 train.max_steps=60 \
    checkpoint.every_steps=0 model.n_layer=12 model.d_model=768 model.n_head=12 data.max_seq_len=1024 \
    data.micro_batch_tokens=16384 data.global_batch_tokens=65536 "log.peak_flops=$PEAK"
$PY - "$STORE/gpt100m" <<'PY'
import json, statistics, sys, pathlib
run = pathlib.Path(sys.argv[1])
steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"eval_loss"' not in x]
steady = steps[10:]  # past compilation, allocator warm-up
print("gpt100m bf16: %.0f tokens/s, MFU %.3f, step %.1f ms, host overhead %.2f ms/step" % (
    statistics.median(r["tokens_per_s"] for r in steady), statistics.median(r["mfu"] for r in steady),
    1e3 * statistics.median(r["step_time_s"] for r in steady), 1e3 * statistics.median(r["host_s"] for r in steady)))
PY
# 4. train.sharding=fsdp (issue 29) on NCCL: a bf16 run with a crash and resume (the checkpoint of
#    each rank's rows resharded on load), then the ~100M GPT beside sharding=none: tokens/s, MFU and
#    the device's allocated bytes per parameter (fsdp, fp32 master, bf16 compute).
.venv/bin/elastic-train train "${COMMON[@]}" run.name=fsdp train.sharding=fsdp train.precision=bf16 \
    fault.crash_at_step=15
.venv/bin/elastic-train train "${COMMON[@]}" run.name=gpt100m_fsdp train.sharding=fsdp train.precision=bf16 \
    train.max_steps=60 checkpoint.every_steps=0 model.n_layer=12 model.d_model=768 model.n_head=12 \
    data.max_seq_len=1024 data.micro_batch_tokens=16384 data.global_batch_tokens=65536 "log.peak_flops=$PEAK"
$PY - "$STORE" <<'PY'
import json, statistics, sys, pathlib
params = 12 * 12 * 768 ** 2 + (256 + 1024) * 768  # the GPT's matmul weights and embeddings (approx.)
for run in ("gpt100m", "gpt100m_fsdp"):
    steps = [json.loads(x) for x in (pathlib.Path(sys.argv[1]) / run / "metrics.jsonl").read_text().splitlines()
             if '"eval_loss"' not in x][10:]
    print("%s: %.0f tokens/s, MFU %.3f, %.1f allocated bytes per parameter" % (
        run, statistics.median(r["tokens_per_s"] for r in steps), statistics.median(r["mfu"] for r in steps),
        statistics.median(r["cuda_allocated_bytes"] for r in steps) / params))
s = json.loads((pathlib.Path(sys.argv[1]) / "fsdp" / "summary.json").read_text())
assert s["status"] == "finished" and s["restarts"] == 1, s
PY
# 5. QLoRA (issue 30): a tiny Llama saved from a config (QLoRA quantises a pretrained base, so the
#    folder holds weights), LoRA r=8 on its bitsandbytes 4-bit NF4 base, bf16 compute, on the byte
#    corpus, a crash at step 15 and resume from step 10; prints the summary and the adapter
#    checkpoint's size (adapters and the base's hash only), then exports the adapters and a merged
#    model (both on the base unquantised: export.load_trained) and samples from the run.
LLAMA="$STORE/tiny-llama"
$PY - "$LLAMA" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4,
                             max_position_embeddings=1024)).save_pretrained(sys.argv[1])
PY
.venv/bin/elastic-train train "${COMMON[@]}" run.name=qlora model.name=hf "model.path=$LLAMA" \
    model.lora.r=8 model.lora.alpha=16 "model.lora.target_modules=[q_proj, k_proj, v_proj, o_proj]" \
    model.lora.load_in_4bit=true train.precision=bf16 fault.crash_at_step=15
$PY - "$STORE/qlora" "$LLAMA" <<'PY'
import json, sys, pathlib
from elastic_train.training.checkpoint import read_shards
from elastic_train.training.lora import BASE_KEY
run, base = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
s = json.loads((run / "summary.json").read_text())
print("qlora", {k: s[k] for k in ("status", "steps", "first_loss", "final_loss", "restarts", "world_sizes",
                                  "grad_reduce")})
assert s["status"] == "finished" and s["restarts"] == 1 and s["final_loss"] < s["first_loss"], s
ckpt = sorted(p for p in run.glob("checkpoint_*") if p.is_dir())[-1]
saved = read_shards(ckpt, "model")
assert saved and all("lora_" in n or n == BASE_KEY for n in saved), sorted(saved)[:5]
print("qlora checkpoint %s: %d adapter tensors, %d parameters, model files %d bytes (base weights %d bytes)" % (
    ckpt.name, len(saved) - 1, sum(t.numel() for n, t in saved.items() if n != BASE_KEY),
    sum(p.stat().st_size for p in ckpt.glob("model*")), sum(p.stat().st_size for p in base.glob("*.safetensors"))))
PY
.venv/bin/elastic-train export "$STORE/qlora" --output "$STORE/qlora-adapter"
.venv/bin/elastic-train export "$STORE/qlora" --output "$STORE/qlora-merged" --merge
test -f "$STORE/qlora-adapter/adapter_config.json" && test -f "$STORE/qlora-merged/config.json"
.venv/bin/elastic-train sample "$STORE/qlora" --prompt "def " --max-new-tokens 20
# 6. train.compile (issue 31): the ~100M GPT compiled block by block (bf16) beside eager (step 3's
#    gpt100m): steady tokens/s, first step (Inductor + Triton), then the same run again in a new
#    process: its first step loads the run's compile cache (the summary's compile_loaded/compiled).
for run in gpt100m_compile gpt100m_compile_warm; do
  .venv/bin/elastic-train train "${COMMON[@]}" run.name=$run train.precision=bf16 train.max_steps=60 \
      checkpoint.every_steps=0 model.n_layer=12 model.d_model=768 model.n_head=12 data.max_seq_len=1024 \
      data.micro_batch_tokens=16384 data.global_batch_tokens=65536 "log.peak_flops=$PEAK" \
      train.compile=true "train.compile_modules=[Block]" \
      "train.compile_cache_dir=$STORE/inductor-cache"
done
$PY - "$STORE" <<'PY'
import json, statistics, sys, pathlib
store = pathlib.Path(sys.argv[1])
def steps(run):
    return [json.loads(x) for x in (store / run / "metrics.jsonl").read_text().splitlines() if '"eval_loss"' not in x]
eager = statistics.median(r["tokens_per_s"] for r in steps("gpt100m")[10:])
for run in ("gpt100m_compile", "gpt100m_compile_warm"):
    s = json.loads((store / run / "summary.json").read_text())
    rs = steps(run)
    tps = statistics.median(r["tokens_per_s"] for r in rs[10:])
    print("%s: %.0f tokens/s (eager %.0f, x%.3f), first step %.1f s, graphs %s, loaded %s, compiled %s" % (
        run, tps, eager, tps / eager, rs[0]["step_time_s"], s["compiled_graphs"], s["compile_loaded"],
        s["compile_compiled"]))
    assert s["status"] == "finished" and s["compiled_graphs"] <= 4, s
    if run.endswith("warm"):
        assert s["compile_compiled"] == 0 and s["compile_loaded"] > 0, s
PY
# 7. The GPU benchmark (issue 36): figures per case, ours against a bare loop.
$PY benchmarks/gpu.py
