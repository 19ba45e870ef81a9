"""LoRA fine-tuning of a tiny Llama on prompt/response data (issue 30), on a real local Ray cluster:
a crash and resume on a bf16 base ends with the adapters of one uninterrupted process, to the
bit; the checkpoint holds adapter tensors only; the exported adapters load with peft, and the
merged export with from_pretrained alone, both giving the run's eval loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from conftest import prepare_sft_pairs
from localenv import train_locally

from elastic_train import load_config
from elastic_train.api import train
from elastic_train.config import ConfigError, config_from_dict
from elastic_train.data.batches import MicroBatch
from elastic_train.export import export, generate, load_trained
from elastic_train.training.checkpoint import read_shards
from elastic_train.training.lora import BASE_KEY
from elastic_train.training.losses import causal_lm_loss

pytestmark = pytest.mark.ray
pytest.importorskip("peft")

LORA = ["model.name=hf", "model.lora.r=4", "model.lora.alpha=8",
        "model.lora.target_modules=[q_proj, v_proj]", "optim.lr=0.01",
        "data.micro_batch_tokens=512", "data.global_batch_tokens=2048",
        "log.progress=none", "scaling.health_check_interval_s=0.1", "checkpoint.every_steps=4",
        "checkpoint.keep_best=false", "eval.fraction=0.2", "train.max_steps=20",
        "scaling.max_failures=2", "fault.crash_at_step=5"]


@pytest.fixture(scope="module")
def sft_dataset(bpe_tokenizer, tmp_path_factory) -> str:
    """Prompt/response pairs: a line of textwrap.py and the line after it, 20% held out."""
    return prepare_sft_pairs(bpe_tokenizer, tmp_path_factory.mktemp("sft"), eval_fraction=0.2)


def lora_run(tmp_path: Path, base: str, data: str, name: str, workers: int, base_dtype: str):
    cfg = load_config(None, [*LORA, f"model.path={base}", f"data.path={data}",
                             f"model.base_dtype={base_dtype}",
                             f"run.storage_path={tmp_path}", f"run.name={name}",
                             f"scaling.min_workers={workers}", f"scaling.max_workers={workers}",
                             f"fault.crash_rank={workers - 1}"])
    return train(cfg)


def eval_loss(model: torch.nn.Module, data: str) -> float:
    """Loss per answer target over the held-out set, one row at a time."""
    total, targets = 0.0, 0
    table = pa.concat_tables([pq.read_table(p) for p in sorted(Path(data, "eval").glob("*.parquet"))])
    with torch.no_grad():
        for row in table.select(["id", "tokens", "loss_mask"]).to_pylist():
            tokens = np.array([row["tokens"]], dtype=np.int64)
            mb = MicroBatch(0, np.array([row["id"]]), tokens, np.array([tokens.shape[1]]),
                            {"loss_mask": np.array([row["loss_mask"]], dtype=np.int8)})
            loss_sum, n = causal_lm_loss(model, mb.to_batch(torch.device("cpu")))
            total, targets = total + float(loss_sum), targets + int(n)
    return total / targets


# an fp32 base through three recoveries: tests/test_repeated_faults.py's seeded LoRA schedule;
# one worker: the export test below
@pytest.mark.parametrize("workers, base_dtype", [(2, "bf16")])
def test_lora_crash_and_resume_equals_one_uninterrupted_process(
        ray_cluster, base_llama, sft_dataset, tmp_path, workers, base_dtype):
    """Crashed at step 5 and resumed from step 4: the adapters (fp32, on a bf16 base) and the
    final evaluation are those of one uninterrupted process, to the bit."""
    result = lora_run(tmp_path, base_llama, sft_dataset, f"lora{workers}", workers, base_dtype)
    summary = result.summary
    assert summary["status"] == "finished" and summary["restarts"] == 1
    assert summary["world_sizes"] == [workers, workers]
    run_dir = Path(result.run_dir)
    checkpoints = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
    saved = read_shards(checkpoints[-1], "model")
    assert saved and all("lora_" in name or name == BASE_KEY for name in saved)
    assert {t.dtype for name, t in saved.items() if name != BASE_KEY} == {torch.float32}
    resolved = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    reference = train_locally(resolved, extra_columns=("loss_mask",))
    assert summary["steps"] == len(reference.steps) > 5  # the crash at 5 was replayed
    want = reference.final["model"]
    assert saved.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(saved[name], tensor), name
    assert summary["final_eval_loss"] == reference.evals[-1]["eval_loss"]
    model_bytes = sum(p.stat().st_size for p in checkpoints[-1].glob("model*"))
    print(f"\nLoRA checkpoint model files: {model_bytes} bytes, {len(saved) - 1} adapter tensors, "
          f"{sum(t.numel() for n, t in saved.items() if n != BASE_KEY)} parameters")


def test_exports_load_with_peft_and_from_pretrained_and_give_the_eval_loss(
        ray_cluster, base_llama, sft_dataset, tmp_path):
    """A LoRA run keeping its best checkpoint: loaded, exported as adapters (peft) and merged
    (transformers alone), each gives the best evaluation's loss on the held-out examples. Then
    the same run resumed with model.path on other weights: refused before Ray starts, and its
    checkpoints are untouched."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = [*LORA, f"data.path={sft_dataset}", f"run.storage_path={tmp_path}", "run.name=ex",
              "fault.crash_at_step=null", "scaling.min_workers=1", "scaling.max_workers=1",
              "checkpoint.keep_best=true", "eval.every_steps=2"]
    result = train(load_config(None, [*common, f"model.path={base_llama}", "train.max_steps=4"]))
    run_loss = result.summary["best_eval_loss"]  # export and load_trained take the best checkpoint
    trained = load_trained(result.run_dir)
    assert trained.checkpoint.name.startswith("best_checkpoint_")
    assert eval_loss(trained.model, sft_dataset) == pytest.approx(run_loss, rel=1e-5)
    assert generate(trained, "Next line after: ", max_new_tokens=4, temperature=0) is not None

    export(result.run_dir, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_llama)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    assert eval_loss(adapted, sft_dataset) == pytest.approx(run_loss, rel=1e-5)

    export(result.run_dir, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert eval_loss(merged, sft_dataset) == pytest.approx(run_loss, rel=1e-5)

    other = tmp_path / "other_base"
    model = AutoModelForCausalLM.from_pretrained(base_llama)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    model.save_pretrained(other)
    before = {p.name: p.stat().st_mtime_ns for p in Path(result.run_dir).rglob("*")
              if "checkpoint_" in str(p) and p.is_file()}
    with pytest.raises(ConfigError, match="trained on another base model"):  # before Ray starts
        train(load_config(None, [*common, f"model.path={other}", "train.max_steps=8"]))
    assert {p.name: p.stat().st_mtime_ns for p in Path(result.run_dir).rglob("*")
            if "checkpoint_" in str(p) and p.is_file()} == before
