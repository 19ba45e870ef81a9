"""train.sharding=fsdp on a real local Ray cluster: a run that shrinks to one worker and grows
back, the same to the bit as a run that was never interrupted (checkpoints of each rank's rows,
resharded on load: sharding.py, shardfiles.py); a NaN in one rank's rows; a Llama's export."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_models import bpe_dataset, llama_folder  # noqa: F401 - fixtures
from test_train_ray import assert_same_training, read_events, run

from elastic_train.api import TrainingFailed
from elastic_train.training.checkpoint import read_shards

pytestmark = pytest.mark.ray

FSDP = ["train.sharding=fsdp", "train.max_steps=14"]


@pytest.fixture(scope="module")
def reference(ray_cluster, small_dataset, tmp_path_factory):
    """2 fsdp workers, never interrupted."""
    result = run(tmp_path_factory.mktemp("ref"), small_dataset, "ref", *FSDP)
    assert result.summary["status"] == "finished" and result.summary["world_sizes"] == [2]
    return result


def test_fsdp_shrinks_to_one_worker_and_grows_back_to_the_uninterrupted_run(reference, small_dataset,
                                                                            tmp_path):
    """Two recoveries in a row at other world sizes, each from a checkpoint written after the one
    before: 2 workers until rank 0 dies with no restart left; resumed on 1 worker, which reshards
    the 2 ranks' rows into one and dies at step 11 (its step-8 checkpoint committed); resumed on
    2 workers, each taking its rows from the 1-worker checkpoint's one file. The run ends as the
    uninterrupted one, to the bit. (A crash and resume at the same size: the seeded fsdp schedule
    of tests/test_repeated_faults.py; the chaos tier's grow through add_node restarts the same way,
    from the latest checkpoint at the new size.)"""
    schedule = "fault.schedule=[6:crash:0, 11:crash:0]"  # each fault fires once in the run
    with pytest.raises(TrainingFailed):
        run(tmp_path, small_dataset, "resize", *FSDP, schedule, "scaling.max_failures=0")
    with pytest.raises(TrainingFailed):
        run(tmp_path, small_dataset, "resize", *FSDP, schedule, "scaling.max_failures=0",
            "scaling.min_workers=1", "scaling.max_workers=1")
    resized = run(tmp_path, small_dataset, "resize", *FSDP, schedule)
    assert resized.summary["world_sizes"] == [2, 1, 2]
    starts = [e for e in read_events(resized) if e["event"] == "start" and e["rank"] == 0]
    assert [e["resumed_step"] for e in starts] == [0, 4, 8]
    assert_same_training(resized, reference)


def test_fsdp_nan_in_one_workers_rows_is_skipped_by_every_worker(ray_cluster, small_dataset,
                                                                  tmp_path):
    """fault.nan_at_step through the Ray worker's hook: rank 1's own rows of a sharded gradient
    go bad; the global norm makes rank 0 (whose records these are, its rows finite) skip too."""
    result = run(tmp_path, small_dataset, "nan", *FSDP, "fault.nan_at_step=5", "fault.nan_rank=1",
                 "checkpoint.every_steps=0")
    s = result.summary
    assert s["status"] == "finished" and s["restarts"] == 0 and s["skipped_steps"] == 1
    records = [json.loads(x) for x in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["skipped"]] == [5]
    assert all(math.isfinite(r["loss"]) for r in records)
    model = read_shards(result.checkpoint_path, "model")
    assert all(torch.isfinite(t).all() for t in model.values())


def test_an_fsdp_llama_exports_whole_and_loads_with_from_pretrained(ray_cluster, bpe_dataset,  # noqa: F811
                                                                      llama_folder, tmp_path):  # noqa: F811
    """A tiny Llama (decoder layers sharded as blocks, tied embeddings in the root) trained by 2
    fsdp workers; export assembles its rows into one model that transformers loads, with the
    same loss as the run's own model."""
    from test_models import SMALL
    from transformers import AutoModelForCausalLM

    from elastic_train import load_config
    from elastic_train.api import train
    from elastic_train.data.batches import make_batch
    from elastic_train.export import export, load_trained
    from elastic_train.training.losses import causal_lm_loss

    cfg = load_config(None, [*SMALL, "model.name=hf", f"model.path={llama_folder}",
                             f"data.path={bpe_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=llama", "train.sharding=fsdp", "train.max_steps=6"])
    result = train(cfg)
    assert result.summary["status"] == "finished" and result.summary["world_sizes"] == [2]
    exported = export(result.run_dir, tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(exported).eval()
    trained = load_trained(result.run_dir)
    ids = torch.arange(2, 40).unsqueeze(0)
    batch = make_batch(ids, torch.tensor([ids.shape[1]]))
    with torch.no_grad():
        assert torch.equal(causal_lm_loss(model, batch)[0], causal_lm_loss(trained.model, batch)[0])
    untrained = AutoModelForCausalLM.from_config(model.config)  # the export holds trained weights
    assert not torch.equal(untrained.lm_head.weight, model.lm_head.weight)
