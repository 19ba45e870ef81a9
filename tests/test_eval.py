"""Held-out evaluation: which blocks are held out, the eval loss at any world size and across
crashes, its place in the summary, ledger and report, and the best checkpoint that export picks."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import TINY
from localenv import train_locally
from ranks import run_ranks

from elastic_train.api import train
from elastic_train.config import ConfigError, ModelConfig, batch_tokens, load_config
from elastic_train.data.blocks import BlockReader
from elastic_train.data.dataset import dataset_blocks, inspect_dataset
from elastic_train.data.plan import StreamSpec
from elastic_train.data.rowgroups import build_block_table, hold_out
from elastic_train.export import default_checkpoint, load_trained
from elastic_train.observe.report import load_run, make_report
from elastic_train.observe.summary import build_summary, eval_figures, ledger
from elastic_train.preflight.inputs import data_tables
from elastic_train.training.checkpoint import BEST_POINTER, read_best_pointer, write_best
from elastic_train.training.evaluate import evaluate
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.step import StepSetup

EVAL = [*TINY, "eval.fraction=0.1", "eval.every_steps=10"]


def block_ids(table, blocks) -> set[int]:
    """The sample ids of `blocks` of a block table."""
    reader = BlockReader(table)
    return {int(i) for i in reader.read(np.asarray(blocks))["id"]}


# -- which blocks are held out ------------------------------------------------------------------
def without_doc(dataset: str, folder: Path) -> str:
    """A copy of a prepared data set's shards without the `doc` column (as another tool makes
    them): eval.fraction holds out its row groups."""
    folder.mkdir()
    for path in sorted(Path(dataset).glob("*.parquet")):
        pq.write_table(pq.read_table(path).drop_columns(["doc"]), folder / path.name,
                       row_group_size=32)
    return str(folder)


@pytest.mark.unit
def test_held_out_blocks_are_whole_row_groups_picked_by_what_they_are(small_dataset, tmp_path):
    """For data without a `doc` column (tests/test_heldout.py: with one, prepare holds out whole
    documents)."""
    small_dataset = without_doc(small_dataset, tmp_path / "no_doc")
    info = inspect_dataset(small_dataset)
    table = dataset_blocks(info)
    train_part, held = hold_out(table, 0.1)
    assert len(held) == round(0.1 * len(table)) and len(train_part) + len(held) == len(table)
    pairs = lambda t: {(t.files[f].rsplit("/", 1)[-1], int(g))  # noqa: E731
                       for f, g in zip(t.file_index, t.row_group, strict=True)}
    assert pairs(train_part).isdisjoint(pairs(held))
    assert pairs(train_part) | pairs(held) == pairs(table)
    # The same blocks when the shards are listed in another order (a hash of file and row group,
    # not of the position in the table), and at least one block for a tiny fraction.
    files = list(reversed(info.files))
    reordered = build_block_table(pafs.LocalFileSystem(), files, files)
    assert pairs(hold_out(reordered, 0.1)[1]) == pairs(held)
    assert len(hold_out(table, 1e-6)[1]) == 1
    # The data seed does not enter: a config with another seed holds out the same rows.
    a = data_tables(load_config(None, [*EVAL, f"data.path={small_dataset}"]), info)
    b = data_tables(load_config(None, [*EVAL, f"data.path={small_dataset}", "data.seed=7"]), info)
    assert pairs(a.eval) == pairs(b.eval) == pairs(held)


@pytest.mark.unit
@pytest.mark.parametrize(("override", "message"), [
    (["eval.fraction=0.5"], "eval.fraction must be in [0, 0.5)"),
    (["eval.fraction=-0.1"], "eval.fraction must be in [0, 0.5)"),
    (["eval.fraction=0.1", "eval.path=/x"], "both set"),
    (["eval.every_steps=-1"], "eval.every_steps must be >= 0"),
    (["eval.max_batches=0"], "eval.max_batches must be >= 1"),
    (["eval.fraction=0", "checkpoint.keep_best=true"], "checkpoint.keep_best needs an evaluation"),
])
def test_bad_eval_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        load_config(None, override)


@pytest.mark.unit
def test_an_eval_path_of_another_tokenizer_or_missing_is_refused(small_dataset, bpe_tokenizer, tmp_path):
    from elastic_train.data.prepare import prepare
    from elastic_train.preflight.inputs import check_inputs

    base = [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path / 'runs'}"]
    with pytest.raises(ConfigError, match="eval.path: .*nope"):
        check_inputs(load_config(None, [*base, f"eval.path={tmp_path / 'nope'}"]))
    other = tmp_path / "bpe"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare([stdlib / "keyword.py"], other, max_seq_len=128, tokenizer=bpe_tokenizer)
    with pytest.raises(ConfigError, match="eval.path: .*another tokenizer"):
        check_inputs(load_config(None, [*base, f"eval.path={other}"]))


# -- the eval loss is the same at any world size ------------------------------------------------
MODEL = ModelConfig(n_layer=1, d_model=32, n_head=2, dropout=0.1, vocab_size=256)


def _eval_worker(rank: int, world_size: int, data: str, out: str) -> None:
    torch.manual_seed(0)
    module = LossModule(build_model(MODEL, 128))
    cfg = load_config(None, [*EVAL, f"data.path={data}"])
    held = data_tables(cfg, inspect_dataset(data)).eval
    spec = StreamSpec(4, batch_tokens(cfg)[0], cfg.data.shuffle_window, 0)
    setup = StepSetup(device=torch.device("cpu"), world_size=world_size)
    results = [evaluate(module, BlockReader(held), spec, list(range(rank, 4, world_size)),
                        setup=setup, max_batches=m) for m in (None, 1)]
    torch.save([(r.loss, r.targets, r.micro_batches) for r in results], f"{out}.{world_size}.{rank}")


@pytest.mark.dist
def test_eval_loss_is_bitwise_the_same_on_1_2_and_3_processes(held_out_dataset, tmp_path):
    out = str(tmp_path / "eval")
    _eval_worker(0, 1, held_out_dataset, out)
    for world_size in (2, 3):
        run_ranks(_eval_worker, world_size, tmp_path, held_out_dataset, out, start_method="forkserver")
    (whole, first), = [torch.load(f"{out}.1.0")]
    assert whole[2] > first[2] >= 1 and whole[1] > first[1]  # max_batches bounds it
    assert math.isfinite(whole[0]) and whole[0] > 0
    for world_size in (2, 3):
        for rank in range(world_size):
            # == on floats: the same to the bit (dropout is off in evaluation, sums are exact)
            assert torch.load(f"{out}.{world_size}.{rank}") == [whole, first], (world_size, rank)


@pytest.mark.unit
def test_evaluation_leaves_each_module_in_the_mode_it_found(held_out_dataset):
    """A model whose part is in eval mode (a frozen encoder's dropout, set so by its factory)
    trains that way before an evaluation and after it: evaluation puts back each module's own
    mode, not train() on all (which turned the frozen dropout on after the first evaluation, and
    a resume, rebuilding the model as its factory returns it, trained otherwise)."""
    torch.manual_seed(0)
    module = LossModule(build_model(MODEL, 128))
    frozen = [m for m in module.modules() if isinstance(m, torch.nn.Dropout)][:2]
    for m in frozen:
        m.eval()
    before = [m.training for m in module.modules()]
    assert False in before and True in before
    cfg = load_config(None, [*EVAL, f"data.path={held_out_dataset}"])
    held = data_tables(cfg, inspect_dataset(held_out_dataset)).eval
    spec = StreamSpec(4, batch_tokens(cfg)[0], cfg.data.shuffle_window, 0)
    evaluate(module, BlockReader(held), spec, [0], setup=StepSetup(device=torch.device("cpu"),
                                                                   world_size=1), max_batches=1)
    assert [m.training for m in module.modules()] == before


@pytest.mark.unit
def test_the_last_checkpoint_holds_the_final_evaluation_when_a_periodic_one_falls_on_it(
        held_out_dataset, tmp_path):
    """checkpoint.every_steps dividing train.max_steps: the periodic save of the last step is
    left to the final save, which comes after the final evaluation (the final save of that step
    was skipped, so the run's last checkpoint said its last evaluation was at step 15, not 16,
    and a run trained on from it compared its evaluations with a stale best)."""
    cfg = load_config(None, [*EVAL, f"data.path={held_out_dataset}", "eval.every_steps=5",
                             "train.max_steps=16", "checkpoint.every_steps=8",
                             "eval.max_batches=1"])
    env = train_locally(cfg, folder=str(tmp_path))
    assert [e["step"] for e in env.evals] == [5, 10, 15, 16]
    saved = env.final["state"]["train_state"]
    best = min(env.evals, key=lambda e: e["eval_loss"])
    assert saved["step"] == saved["eval_step"] == 16
    assert (saved["best_step"], saved["best_eval_loss"]) == (best["step"], best["eval_loss"])


@pytest.mark.unit
def test_a_resumed_state_takes_the_best_evaluated_after_its_checkpoint(tmp_path):
    """The pointer names a best evaluated after the checkpoint was written, at a step no later
    than the checkpoint's: the resumed state takes it; one of a later step (a rollback will
    evaluate it again) or a worse loss it leaves alone."""
    from elastic_train.training.checkpoint import BestCheckpointWriter
    from elastic_train.training.step import TrainState

    fs = pafs.LocalFileSystem()
    writer = BestCheckpointWriter(fs, str(tmp_path))

    def resumed(pointer: dict) -> tuple:
        (tmp_path / BEST_POINTER).write_text(json.dumps({"checkpoint": "b", **pointer}))
        state = TrainState(step=16, eval_step=15, best_eval_loss=4.19, best_step=15)
        writer.adopt(state)
        return state.best_eval_loss, state.best_step

    assert resumed({"step": 16, "eval_loss": 4.18}) == (4.18, 16)
    assert resumed({"step": 20, "eval_loss": 4.0}) == (4.19, 15)  # after the checkpoint's step
    assert resumed({"step": 16, "eval_loss": 4.5}) == (4.19, 15)  # not better
    assert resumed({"step": 15, "eval_loss": 4.0}) == (4.19, 15)  # the state's own evaluation


# -- summary, ledger, report --------------------------------------------------------------------
def _eval_record(step: int, attempt: int, loss: float, time: float, eval_s: float = 1.0) -> dict:
    return {"step": step, "epoch": 0, "attempt": attempt, "time": time, "eval_loss": loss,
            "eval_perplexity": math.exp(loss), "eval_s": eval_s}


def _step_record(step: int, attempt: int, time: float) -> dict:
    return {"step": step, "epoch": 0, "attempt": attempt, "time": time, "loss": 5.0 - step / 10,
            "lr": 1e-3, "world_size": 2, "real_tokens": 100, "padded_tokens": 110,
            "step_time_s": 1.0, "data_wait_s": 0.0, "tokens_per_s": 100.0, "skipped_steps": 0}


@pytest.mark.unit
def test_summary_counts_each_evaluated_step_once_and_the_ledger_has_an_eval_line(tmp_path):
    # attempt 0 evaluates at 2, then crashes after step 3; attempt 1 replays 3, evaluates 4
    # (better), 6 (worse) and at the end.
    steps = [_step_record(s, 0, 10.0 + s) for s in (1, 2, 3)]
    evals = [_eval_record(2, 0, 4.0, 12.5, 0.4)]
    steps += [_step_record(s, 1, 20.0 + s + (s > 4)) for s in (3, 4, 5, 6)]
    evals += [_eval_record(4, 1, 3.5, 24.5, 0.5), _eval_record(6, 1, 3.7, 27.5, 0.3)]
    figures = eval_figures(evals + [_eval_record(2, 1, 4.0, 30.0)])
    assert figures["final_eval_loss"] == 3.7 and figures["best_eval_loss"] == 3.5
    assert figures["best_step"] == 4 and figures["eval_steps"] == [2, 4, 6]
    assert eval_figures([]) == {  # a run that ended before its first evaluation: keys all there
        "final_eval_loss": None, "final_eval_epoch": None, "final_eval_perplexity": None,
        "best_eval_loss": None, "best_step": None, "eval_steps": []}
    lg = ledger(steps, [], 0.0, 30.0, evals)
    assert lg["eval_s"] == pytest.approx(1.2)
    assert lg["shutdown_s"] == pytest.approx(30.0 - 27.0 - 0.3)  # the final eval is not shutdown
    assert sum(lg[k] for k in lg if k.endswith("_s") and k != "wall_s") == pytest.approx(30.0)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps + evals))
    summary = build_summary(tmp_path, start_time=0.0)
    assert (summary["final_eval_loss"], summary["best_eval_loss"], summary["best_step"]) == (3.7, 3.5, 4)
    assert summary["steps"] == 6 and summary["replayed_steps"] == 1  # eval records are not steps


# -- the best checkpoint ------------------------------------------------------------------------
@pytest.mark.unit
def test_the_best_checkpoint_replaces_the_one_before_and_a_half_written_one_is_never_picked(tmp_path):
    torch.manual_seed(0)
    model = build_model(MODEL, 128)
    snap = {"model": model.state_dict(), "optimizer": {}, "extra": {},
            "state": {"format_version": 1, "train_state": {"step": 4}, "model_signature": {}}}
    fs = pafs.LocalFileSystem()
    write_best(snap, fs, str(tmp_path), 4, 3.0)
    write_best(snap, fs, str(tmp_path), 8, 2.5)
    assert read_best_pointer(fs, str(tmp_path)) == {"checkpoint": "best_checkpoint_000000008",
                                                   "step": 8, "eval_loss": 2.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_POINTER, "best_checkpoint_000000008"]
    # A crash after the folder of a new best but before the pointer: the pointer still names
    # the complete one; with no complete best, export falls back to the newest checkpoint.
    (tmp_path / "best_checkpoint_000000012").mkdir()
    assert default_checkpoint(tmp_path).name == "best_checkpoint_000000008"
    (tmp_path / "best_checkpoint_000000008" / "manifest.json").unlink()
    (tmp_path / "checkpoint_000000010").mkdir()
    (tmp_path / "checkpoint_000000010" / "manifest.json").write_text('{"files": {}}')
    assert default_checkpoint(tmp_path).name == "checkpoint_000000010"


@pytest.mark.unit
def test_a_step_trained_again_never_writes_into_the_best_folder_the_pointer_names(tmp_path, monkeypatch):
    """After a restart the steps since the restored checkpoint are trained again and their
    evaluations are bests again. Step 4's best trained again to the same loss (to the bit) is
    kept as it was; to another loss (a changed config, a reduction not exact) it goes to a new
    folder, and a crash before the pointer moves leaves the pointer naming the old, whole one."""
    from elastic_train.training import checkpoint

    torch.manual_seed(0)
    snap = {"model": build_model(MODEL, 128).state_dict(), "optimizer": {}, "extra": {},
            "state": {"format_version": 1, "train_state": {"step": 4}, "model_signature": {}}}
    fs, run = pafs.LocalFileSystem(), str(tmp_path)
    manifest = tmp_path / "best_checkpoint_000000004" / "manifest.json"
    assert write_best(snap, fs, run, 4, 3.0) == "best_checkpoint_000000004"
    written = manifest.stat().st_mtime_ns
    assert write_best(snap, fs, run, 4, 3.0) == "best_checkpoint_000000004"  # the same, again
    assert manifest.stat().st_mtime_ns == written

    def crash(*args):
        raise OSError("the node died")

    monkeypatch.setattr(checkpoint, "commit_best", crash)
    with pytest.raises(OSError):
        write_best(snap, fs, run, 4, 2.9)
    assert read_best_pointer(fs, run)["eval_loss"] == 3.0 and default_checkpoint(tmp_path) == manifest.parent
    assert manifest.stat().st_mtime_ns == written
    monkeypatch.undo()
    assert write_best(snap, fs, run, 4, 2.9) == "best_checkpoint_000000004.1"
    assert write_best(snap, fs, run, 4, 2.8) == "best_checkpoint_000000004.2"
    assert read_best_pointer(fs, run) == {"checkpoint": "best_checkpoint_000000004.2", "step": 4,
                                         "eval_loss": 2.8}
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_POINTER, "best_checkpoint_000000004.2"]
    assert default_checkpoint(tmp_path).name == "best_checkpoint_000000004.2"


@pytest.mark.unit
def test_a_local_run_keeps_its_best_evaluation_and_export_loads_it(held_out_dataset, tmp_path):
    cfg = load_config(None, [*EVAL, f"data.path={held_out_dataset}", "eval.every_steps=4",
                             "train.max_steps=9", "checkpoint.keep_best=true", "eval.max_batches=2"])
    env = train_locally(cfg, folder=str(tmp_path))
    assert [e["step"] for e in env.evals] == [4, 8, 9]
    assert all(e["eval_micro_batches"] <= 2 * 4 for e in env.evals)
    best = min(env.evals, key=lambda e: e["eval_loss"])
    assert env.evals[-1]["best_step"] == best["step"]
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    trained = load_trained(tmp_path)
    assert trained.checkpoint.name == f"best_checkpoint_{best['step']:09d}"
    saved = json.loads((trained.checkpoint / "state.json").read_text())["train_state"]
    assert saved["step"] == best["step"] and saved["best_eval_loss"] == best["eval_loss"]


# -- through Ray: 1 and 2 workers, and crashes ---------------------------------------------------
def _run(tmp_path, data, name, *extra):
    cfg = load_config(None, [*EVAL, f"data.path={data}", f"run.storage_path={tmp_path}",
                             f"run.name={name}", "train.epochs=2", "train.max_steps=1000",
                             "checkpoint.every_steps=4", "checkpoint.keep_best=true",
                             "data.record_ids=true", "scaling.max_failures=2", *extra])
    result = train(cfg)
    lines = [json.loads(x) for x in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    return result, lines


def _effective_evals(lines: list[dict]) -> dict[int, float]:
    latest: dict[int, dict] = {}
    for r in lines:
        if "eval_loss" in r and (r["step"] not in latest or r["attempt"] >= latest[r["step"]]["attempt"]):
            latest[r["step"]] = r
    return {s: r["eval_loss"] for s, r in sorted(latest.items())}


@pytest.mark.ray
def test_eval_is_the_same_on_1_and_2_workers_and_across_crashes(ray_cluster, held_out_dataset,
                                                                tmp_path):
    small_dataset = held_out_dataset  # its eval/: the held-out documents
    two, two_lines = _run(tmp_path, small_dataset, "two")
    evals = _effective_evals(two_lines)
    steps = two.summary["steps"]
    assert list(evals) == [*range(10, steps + 1, 10), *([steps] if steps % 10 else [])]
    assert two.summary["best_eval_loss"] == min(evals.values())
    assert two.summary["final_eval_loss"] == evals[steps]
    assert evals[two.summary["best_step"]] == two.summary["best_eval_loss"]
    # train.epochs ends the run long before train.max_steps: its cosine ends with it, and the
    # last step trains near the floor (with the end at train.max_steps it stayed near the peak)
    assert two.summary["ended_by"] == "train.epochs" and steps < 1000
    optim = load_config(None, EVAL).optim
    lrs = {r["step"]: r["lr"] for r in two_lines if "lr" in r}
    floor = optim.min_lr_ratio * optim.lr
    assert lrs[steps] == pytest.approx(floor + 0.5 * (1 + math.cos(
        math.pi * (steps - 1 - optim.warmup_steps) / (steps - optim.warmup_steps))) * (optim.lr - floor))
    assert lrs[steps] < floor + 0.05 * (optim.lr - floor)
    # Exactly once, held out never trained: every trained id is outside the held-out blocks,
    # and each epoch trains all the others once.
    info = inspect_dataset(small_dataset)
    tables = data_tables(load_config(None, [*EVAL, f"data.path={small_dataset}"]), info)
    held_ids = block_ids(tables.eval, np.arange(len(tables.eval)))
    all_ids = {int(i) for f in info.files for i in pq.read_table(f, columns=["id"])["id"].to_pylist()}
    per_epoch: dict[int, list[int]] = {}
    for f in sorted((Path(two.run_dir) / "consumed").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            per_epoch.setdefault(rec["epoch"], []).extend(rec["ids"])
    assert sorted(per_epoch) == [0, 1]
    for ids in per_epoch.values():
        assert sorted(ids) == sorted(all_ids - held_ids)

    # 1 worker, crashing between evaluations; 2 workers, crashing in the middle of one.
    one, one_lines = _run(tmp_path, small_dataset, "one", "scaling.min_workers=1",
                          "scaling.max_workers=1", "fault.crash_at_step=15")
    two_crash, crash_lines = _run(tmp_path, small_dataset, "crash", "fault.crash_at_step=20",
                                  "fault.crash_in_eval=true")
    assert one.summary["restarts"] == 1 and two_crash.summary["restarts"] == 1
    assert _effective_evals(one_lines) == evals  # == on floats: to the bit
    assert _effective_evals(crash_lines) == evals
    assert not [r for r in crash_lines if "eval_loss" in r and r["step"] == 20 and r["attempt"] == 0]
    for result in (one, two_crash):
        for key in ("final_eval_loss", "best_eval_loss", "best_step"):
            assert result.summary[key] == two.summary[key], key
        assert result.summary["ledger"]["eval_s"] > 0

    # The report draws the eval curve and skips no line; export picks the best checkpoint.
    report = make_report(two.run_dir)
    assert not report.run.skipped and len(load_run(two.run_dir).evals) == len(evals)
    best = json.loads((Path(two.run_dir) / BEST_POINTER).read_text())
    assert best["step"] == two.summary["best_step"] and best["eval_loss"] == two.summary["best_eval_loss"]
    assert default_checkpoint(Path(two.run_dir)).name == best["checkpoint"]


@pytest.mark.ray
def test_an_eval_data_set_of_its_own(ray_cluster, small_dataset, tmp_path):
    """eval.path: another prepared data set, evaluated at the end; all of data.path is trained."""
    from elastic_train.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held = tmp_path / "held"
    prepare([stdlib / "string.py", stdlib / "keyword.py"], held, max_seq_len=128, rows_per_block=32)
    result, lines = _run(tmp_path, small_dataset, "path", "eval.fraction=0", f"eval.path={held}",
                         "train.max_steps=12", "eval.every_steps=0", "checkpoint.keep_best=false")
    evals = _effective_evals(lines)
    assert list(evals) == [12] and result.summary["final_eval_loss"] == evals[12]
    targets = sum(length - 1 for length in pq.read_table(held, columns=["length"])["length"].to_pylist())
    assert next(r for r in lines if "eval_loss" in r)["eval_targets"] == targets  # all of it
    assert not (Path(result.run_dir) / BEST_POINTER).exists()
    # What ran is recorded: in summary.json, provenance.json and every checkpoint's state.json.
    from elastic_train.observe.provenance import data_hash

    record = result.summary["provenance"]
    assert record["data_hash"] == data_hash(inspect_dataset(small_dataset))
    assert record["eval_data_hash"] == data_hash(inspect_dataset(str(held)))
    assert record["versions"]["torch"] in (torch.__version__, torch.__version__.split("+")[0])
    assert json.loads((Path(result.run_dir) / "provenance.json").read_text()) == record
    # And how long it took to start, phase by phase (summary.json's `startup`).
    startup = result.summary["startup"]
    phases = [v for k, v in startup.items() if k.endswith("_s") and k != "total_s"]
    assert min(phases) >= 0 and sum(phases) == pytest.approx(startup["total_s"], abs=0.01)  # rounded
    assert startup["worker_init_s"] > 0 and startup["first_step_s"] > 0
    state = json.loads((Path(result.checkpoint_path) / "state.json").read_text())
    assert state["provenance"]["data_hash"] == record["data_hash"]
    assert state["provenance"]["versions"]["ray"] == record["versions"]["ray"]
