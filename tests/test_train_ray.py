"""Training on a real local Ray cluster: exactly-once, world-size invariance, crash and resume."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TINY
from test_report import LEDGER_PARTS, check_png

from elastic_train import load_config
from elastic_train.api import TrainingFailed, train
from elastic_train.cluster.raycompat import committed_checkpoint_step
from elastic_train.config import ConfigError
from elastic_train.observe.report import make_report
from elastic_train.training.checkpoint import STAGING_PREFIX, read_shards

pytestmark = pytest.mark.ray


def test_the_driver_starts_the_coordinator_ray_train_then_finds(ray_cluster):
    """`train` starts Ray Train's autoscaling coordinator before the controller asks for it (it is on
    the path to the first step): the one actor Ray Train's own client then finds. The module's
    first test, so on a cluster where no run has created it yet."""
    import ray
    from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
        TrainAutoscalingCoordinatorClient,
    )

    from elastic_train.cluster.nodewatch import COORDINATOR, start_coordinator

    assert start_coordinator()
    ours = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    theirs = TrainAutoscalingCoordinatorClient("test")._autoscaling_coordinator
    assert theirs._actor_id == ours._actor_id
    assert not ray.get(theirs.get_reserved_resources.remote("test"), timeout=60)  # it answers


def run(tmp_path, data, name, *extra, storage=None):
    cfg = load_config(None, [*TINY, f"data.path={data}", f"run.storage_path={storage or tmp_path}",
                             f"run.name={name}", "data.record_ids=true", "checkpoint.every_steps=4",
                             "scaling.max_failures=2", *extra])
    return train(cfg)


def metrics(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_events(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.run_dir) / "events.jsonl").read_text().splitlines()]


def crash_event(result) -> dict:
    """The fault hook's `crash_injected` event: the step it killed and the step then committed."""
    crashes = [e for e in read_events(result) if e["event"] == "crash_injected"]
    assert len(crashes) == 1, crashes
    assert not crashes[0].get("commit_wait_timed_out"), crashes[0]
    return crashes[0]


def effective_ids(result) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> ids over all ranks, from the latest attempt that trained that step."""
    lines = [json.loads(line) for f in sorted((Path(result.run_dir) / "consumed").glob("*.jsonl"))
             for line in f.read_text().splitlines()]
    latest = {}
    for line in lines:
        latest[line["step"]] = max(latest.get(line["step"], -1), line["attempt"])
    steps: dict[tuple[int, int], list[int]] = {}
    for line in lines:
        if line["attempt"] == latest[line["step"]]:
            steps.setdefault((line["epoch"], line["step"]), []).extend(line["ids"])
    return {k: sorted(v) for k, v in steps.items()}


def losses(result) -> dict[int, float]:
    out = {}
    for rec in metrics(result):  # later attempts overwrite replayed steps
        if "eval_loss" not in rec:  # not an evaluation's record
            out[rec["step"]] = rec["loss"]
    return out


def assert_same_training(result, reference) -> None:
    """The same ids at every step, the same loss curve and the same final model as `reference`.

    With train.grad_reduce=exact (what the default, auto, chooses on CPU workers) a step's
    gradient is the same to the bit at any world size, so a resized or restarted run is held to
    the bit, not to a tolerance: the loss differs at most by the float64 summation of the logged
    loss, the weights not at all.
    """
    assert effective_ids(result) == effective_ids(reference)
    ref, got = losses(reference), losses(result)
    assert ref.keys() == got.keys()
    rel = {s: abs(got[s] - ref[s]) / ref[s] for s in ref}
    assert max(rel.values()) < 1e-12, rel
    final_ref = read_shards(reference.checkpoint_path, "model")
    final = read_shards(result.checkpoint_path, "model")
    assert final_ref.keys() == final.keys()
    for name, t in final_ref.items():
        assert torch.equal(final[name], t), (name, float((final[name] - t).abs().max()))


@pytest.fixture(scope="module")
def reference(ray_cluster, small_dataset, tmp_path_factory):
    """2 workers, 2 epochs, never interrupted."""
    return run(tmp_path_factory.mktemp("ref"), small_dataset, "ref", "train.epochs=2",
               "train.max_steps=1000")


def test_two_worker_run_trains_every_id_once_per_epoch(reference, small_dataset):
    s = reference.summary
    assert s["status"] == "finished" and s["restarts"] == 0 and s["world_sizes"] == [2]
    assert s["final_loss"] < 0.8 * s["first_loss"]
    assert s["padding_efficiency"] > 0.9
    # Sharded reads: each rank read only its partitions' blocks, each row once per epoch.
    assert s["read_amplification"] == 1.0 and len(s["reads_per_rank"]) == 2
    assert 1.0 <= s["partition_balance"] < 1.2 and s["utilisation_by_world_size"] == {"2": 1.0}
    assert all(0.3 < r["rows_read"] / s["rows_read"] < 0.7 for r in s["reads_per_rank"])
    # Ray's own record of the committed checkpoint (raycompat) names the final one.
    assert committed_checkpoint_step(reference.run_dir) == s["steps"]
    assert 7.99 < s["optimizer_state_bytes_per_param"] < 8.01  # AdamW: two fp32 moments
    run_dir = Path(reference.run_dir)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "summary.json").is_file()
    rec = metrics(reference)[0]
    for key in ("step", "epoch", "loss", "lr", "world_size", "real_tokens", "padded_tokens",
                "step_time_s", "data_wait_s", "attempt"):
        assert key in rec
    from elastic_train.data.dataset import inspect_dataset

    rows = inspect_dataset(small_dataset).rows
    per_epoch = Counter()
    seen = {0: Counter(), 1: Counter()}
    for (epoch, _), ids in effective_ids(reference).items():
        seen[epoch].update(ids)
        per_epoch[epoch] += len(ids)
    for epoch in (0, 1):
        assert len(seen[epoch]) == rows and set(seen[epoch].values()) == {1}
    assert s["steps"] == len(effective_ids(reference))


def test_hard_crash_resumes_exactly_once_with_the_same_loss(reference, small_dataset, tmp_path):
    crashed = run(tmp_path, small_dataset, "crash", "train.epochs=2", "train.max_steps=1000",
                  "fault.crash_at_step=10", "fault.crash_rank=1")
    s = crashed.summary
    assert s["status"] == "finished" and s["restarts"] == 1 and s["world_sizes"] == [2, 2]
    first_of_attempt1 = min(r["step"] for r in metrics(crashed) if r["attempt"] == 1)
    # A crash loses exactly the steps since the last committed checkpoint. The hook waits until
    # the step-8 checkpoint (written in the background) is committed before killing rank 1.
    crash = crash_event(crashed)
    assert (crash["step"], crash["rank"], crash["saved_step"]) == (10, 1, 8), crash
    assert crash["committed_step"] == 8, crash
    assert first_of_attempt1 == crash["committed_step"] + 1
    # Both ranks wrote their shares into the checkpoint, and the restart's two ranks read it in
    # the run's folder: local storage is read where it lies, no temporary copy left behind.
    manifests = sorted(p.name for p in Path(crashed.checkpoint_path).glob("manifest*.json"))
    assert manifests == ["manifest.json", "manifest.shard001.json"]
    restores = [e for e in read_events(crashed) if e["event"] == "restore"]
    assert sorted(e["rank"] for e in restores) == [0, 1]
    assert restores[0]["checkpoint"] == f"checkpoint_{crash['committed_step']:09d}"
    restored = Path(crashed.checkpoint_path).parent / restores[0]["checkpoint"]
    assert {Path(e["local_dir"]) for e in restores} == {restored}
    assert_same_training(crashed, reference)
    # `auto` chose the exact reduction on CPU workers, and the restart kept the run's choice.
    chosen = [(e["chosen"], e["reason"]) for e in read_events(crashed) if e["event"] == "grad_reduce"]
    assert chosen == [("exact", "auto: CPU workers"),
                      ("exact", "auto: kept from the run's checkpoint (chosen at its first start)")]
    assert (s["grad_reduce"], s["grad_compression"]) == ("exact", "none")
    # The run's time ledger and `elastic-train report` on a real restarted run.
    assert s["replayed_steps"] == 10 - (first_of_attempt1 - 1)
    # The restart read its partitions from their cursors: at most one window each again.
    rows = s["rows_read"] / s["read_amplification"]
    assert 1.0 < s["read_amplification"] and s["rows_read"] - rows <= 4 * 1024
    lg = s["ledger"]
    assert 0 < s["goodput"] < 1
    assert sum(lg[p] for p in LEDGER_PARTS) == pytest.approx(lg["wall_s"], rel=0.02)
    assert all(lg[p] >= -0.01 * lg["wall_s"] for p in LEDGER_PARTS), lg
    assert lg["recovery_s"] > 0 and lg["replayed_s"] > 0 and lg["checkpoint_s"] > 0
    assert lg["other_s"] < 0.1 * lg["wall_s"], lg
    report = make_report(Path(crashed.run_dir))
    assert sorted({r["attempt"] for r in report.run.records}) == [0, 1]
    assert [(m.kind, m.attempt, m.step) for m in report.loss_marks] == [
        ("restart", 1, first_of_attempt1 - 1)]
    assert len(report.throughput_marks) == 1
    check_png(report.loss_png)
    check_png(report.throughput_png)


def test_same_run_name_continues_as_a_resume_and_refuses_another_model(ray_cluster, small_dataset, tmp_path):
    first = run(tmp_path, small_dataset, "again", "train.max_steps=6")
    assert first.summary["steps"] == 6
    second = run(tmp_path, small_dataset, "again", "train.max_steps=10")
    recs = metrics(second)
    new_attempt = [r for r in recs if r["attempt"] == 1]
    assert new_attempt and new_attempt[0]["step"] == 7  # from the step-6 checkpoint, not step 1
    assert second.summary["steps"] == 10 and second.note is None
    # the user's resume is counted as one, not as a restart (a failure)
    assert (second.summary["restarts"], second.summary["resumes"]) == (0, 1)
    causes = [a["cause"] for a in json.loads((tmp_path / "again" / "attempts.json").read_text())]
    assert causes == ["start", "resume"]
    # Another model on the same run: refused before any worker starts, the run folder untouched.
    before = {p: p.read_bytes() for p in (tmp_path / "again").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="checkpoint_000000010 does not fit the configured model"):
        run(tmp_path, small_dataset, "again", "train.max_steps=14", "model.d_model=64")
    after = {p: p.read_bytes() for p in (tmp_path / "again").rglob("*") if p.is_file()}
    assert after == before


def test_a_crash_in_a_checkpoint_then_one_worker_through_ray_data_follows_the_same_curve(
        reference, small_dataset, tmp_path):
    """2 workers until rank 0 dies writing step 8's checkpoint, with no restart left: that
    checkpoint never counts. The same run resumed on 1 worker reading through the other reader
    (Ray Data read tasks) from step 4's: the same ids, losses and weights as the uninterrupted
    2-worker run, to the bit. No local copy of a checkpoint is left on the node, the killed
    writer's half-written one included. Then a crash after the epoch's last step, resumed from
    its checkpoint: every partition of the epoch is done, so Ray Data gets nothing to read (it used
    to fail building a dataset of 0 blocks, on every restart)."""
    crash = ["train.epochs=2", "train.max_steps=1000", "fault.crash_at_step=8",
             "fault.crash_in_checkpoint=true"]
    epoch_end = max(r["step"] for r in metrics(reference) if "loss" in r and r["epoch"] == 0)
    staged = set(Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*"))
    with pytest.raises(TrainingFailed):
        run(tmp_path, small_dataset, "resize", *crash, "scaling.max_failures=0")
    resized = run(tmp_path, small_dataset, "resize", *crash, "scaling.min_workers=1",
                  "scaling.max_workers=1", "data.reader=ray_data",
                  f"checkpoint.every_steps={epoch_end}", f"fault.schedule=[{epoch_end + 1}:crash]")
    crash, at_end = [e for e in read_events(resized) if e["event"] == "crash_injected"]
    # rank 0 died writing step 8's files, step 4's being committed
    assert (crash["step"], crash["in_checkpoint"], crash["committed_step"]) == (8, True, 4), crash
    assert (at_end["step"], at_end["committed_step"]) == (epoch_end + 1, epoch_end), at_end
    resumed = [r for r in metrics(resized) if r["attempt"] == 1]
    assert resumed and resumed[0]["step"] == 5  # the step-8 checkpoint never counted
    after_epoch = [r for r in metrics(resized) if r["attempt"] == 2 and "loss" in r]
    assert after_epoch and after_epoch[0]["step"] == epoch_end + 1 and after_epoch[0]["epoch"] == 1
    s = resized.summary
    assert s["world_sizes"][:2] == [2, 1] and set(s["world_sizes"][2:]) <= {1}
    assert s["status"] == "finished" and s["restarts"] == 1
    assert s["read_amplification"] > 1.0  # steps 5-8 read again
    assert_same_training(resized, reference)
    # this run's workers' folders only: another session's runs may be staging theirs right now
    pids = {str(e["pid"]) for e in read_events(resized) if e["event"] == "start"}
    assert len(pids) == 4  # attempt 0's two workers, the two resumed ones
    left = {path for path in set(Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*")) - staged
            if path.name[len(STAGING_PREFIX):].split(".")[0] in pids}
    assert not left, sorted(left)
