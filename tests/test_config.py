"""Config loading, overrides and validation; the CLI's one-line errors."""

from __future__ import annotations

import re
import subprocess

import pytest
import torch
import yaml

from elastic_train.config import ConfigError, load_config, num_partitions

pytestmark = pytest.mark.unit


def test_default_loads_and_round_trips(tmp_path):
    cfg = load_config()
    assert cfg.scaling.min_workers == 2 and cfg.data.path is None
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


def test_dotted_overrides_typed():
    cfg = load_config(None, ["optim.lr=1e-3", "scaling.resources_per_worker={slot: 1}",
                             "train.max_steps=7", "data.path=/x", "scaling.cpus_per_worker=2"])
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 7
    assert cfg.scaling.resources_per_worker == {"slot": 1.0}
    assert cfg.scaling.cpus_per_worker == 2.0 and cfg.data.path == "/x"


@pytest.mark.parametrize("override, culprit", [
    ("optim.lrr=1", "optim.lrr"),
    ("nosection.x=1", "nosection"),
    ("train.max_steps=abc", "train.max_steps"),
    ("train.max_steps=1.5", "train.max_steps"),
    ("scaling.use_gpu=3", "scaling.use_gpu"),
    ("scaling.min_workers=3", "scaling.min_workers"),
    ("scaling.max_workers=0", "scaling.max_workers"),
    ("scaling.min_workers=0", "scaling.min_workers"),
    ("data.micro_batch_tokens=0", "data.micro_batch_tokens"),
    ("data.global_batch_tokens=-1", "data.global_batch_tokens"),
    ("train.precision=fp8", "train.precision"),
    ("train.precision=fp16", "train.precision=fp16"),
    ("optim.name=sgd", "optim.name"),
    ("scaling.slow_step_factor=1", "scaling.slow_step_factor"),
    ("fault.hang_at_step=0", "fault.hang_at_step"),
    ("fault.hang_rank=2", "fault.hang_rank"),
    ("fault.slow_rank=5", "fault.slow_rank"),
    ("fault.slow_step_s=-1", "fault.slow_step_s"),
    ("fault.slow_rank=1", "fault.slow_rank"),  # without a sleep
    ("fault.slow_step_s=0.5", "fault.slow_rank"),  # without a rank
])
def test_bad_values_name_the_key(override, culprit):
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        load_config(None, [override])


@pytest.mark.parametrize("overrides, culprit", [
    (["data.micro_batch_tokens=100", "data.global_batch_tokens=16384"], "data.global_batch_tokens"),
    (["data.micro_batch_tokens=2048", "data.global_batch_tokens=5000"], "data.global_batch_tokens"),
    (["data.max_seq_len=512", "data.micro_batch_tokens=256"], "data.micro_batch_tokens"),
])
def test_batch_sizes_set_together_are_checked_at_load(overrides, culprit):
    with pytest.raises(ConfigError, match=culprit.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize("override, culprit", [
    ("model.kwargs.num_hidden_layers=1", "model.kwargs (num_hidden_layers) with model.name=hf"),
    ("model.vocab_size=1000", "model.vocab_size=1000 with model.name=hf"),
])
def test_hf_keys_that_would_be_ignored_are_refused(override, culprit):
    """The hf model is model.path's config.json: model.kwargs and model.vocab_size were accepted
    and ignored (a 2-layer model trained where 1 was asked)."""
    with pytest.raises(ConfigError, match=re.escape(culprit)):
        load_config(None, ["model.name=hf", "model.path=/some/model", override])


def test_budget_that_cannot_be_split_among_max_workers():
    with pytest.raises(ConfigError, match="cannot be split among scaling.max_workers"):
        load_config(None, ["scaling.max_workers=16", *BUDGET])  # 8 micro-batches per step
    assert num_partitions(load_config(None, ["scaling.max_workers=8", *BUDGET])) == 8


BUDGET = ["data.micro_batch_tokens=2048", "data.global_batch_tokens=16384"]


def test_unknown_key_in_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_stepz": 3}}))
    with pytest.raises(ConfigError, match=r"train\.max_stepz"):
        load_config(path)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """`elastic-train ARGS` in this process (the console script's own exit status and stderr:
    tests/test_bad_input.py), with a tripwire where Ray would start: each case here is refused
    before."""
    import contextlib
    import io
    from unittest import mock

    import elastic_train.api
    from elastic_train.cli import main

    def tripwire(cfg):
        raise AssertionError("the input was accepted: Ray would start now")

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.object(elastic_train.api, "init_ray", tripwire), \
            contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("args, culprit", [
    (["train.max_stepz=3"], "train.max_stepz"),
    (["train.max_steps=many"], "train.max_steps"),
    (["data.path=/nonexistent/data"], "/nonexistent/data"),
])
def test_cli_fails_with_one_error_line_before_any_worker(tmp_path, args, culprit):
    cfg = tmp_path / "x.yaml"
    cfg.write_text("run:\n  name: bad\n")
    proc = _cli("train", "--config", str(cfg), f"run.storage_path={tmp_path}", *args)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and culprit in lines[0], proc.stderr
    assert not (tmp_path / "bad").exists()  # nothing started, nothing written


def test_cli_empty_and_columnless_datasets(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty"
    empty.mkdir()
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "tokens": pa.array([], pa.list_(pa.int32())),
                             "length": pa.array([], pa.int32())}), empty / "p.parquet")
    proc = _cli("train", f"data.path={empty}", f"run.storage_path={tmp_path}")
    assert proc.returncode != 0 and "empty" in proc.stderr and str(empty) in proc.stderr
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    pq.write_table(pa.table({"text": ["a"]}), wrong / "p.parquet")
    proc = _cli("train", f"data.path={wrong}", f"run.storage_path={tmp_path}")
    assert proc.returncode != 0 and "tokens" in proc.stderr and proc.stderr.startswith("error: ")


# small_dataset holds out no documents (prepare without --eval-fraction): no evaluation
NO_EVAL = ["eval.fraction=0", "checkpoint.keep_best=false"]


def test_cli_refuses_a_run_whose_checkpoint_is_of_another_model(tmp_path, small_dataset):
    """The newest complete checkpoint is checked on the driver, before Ray starts; an incomplete
    newer one (no manifest) is skipped, as Ray never registered it; nothing is written."""
    from dataclasses import asdict

    from elastic_train.config import ModelConfig
    from elastic_train.training.checkpoint import snapshot, write_checkpoint
    from elastic_train.training.model import build_model
    from elastic_train.training.step import TrainState

    model = build_model(ModelConfig(n_layer=1, d_model=32, n_head=2), 128)
    optimizer = torch.optim.AdamW(model.parameters())
    snap = snapshot(model, optimizer, None, asdict(TrainState(step=4)), {}, world_size=2)
    run = tmp_path / "old"
    write_checkpoint(snap, run / "checkpoint_000000004")
    (run / "checkpoint_000000008").mkdir()  # a crash mid-write: no manifest
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = _cli("train", f"run.storage_path={tmp_path}", "run.name=old", f"data.path={small_dataset}",
                "model.n_layer=1", "model.d_model=64", "model.n_head=2", "data.max_seq_len=128",
                "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096", *NO_EVAL)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: run old: its latest checkpoint checkpoint_000000004 does not "
                               "fit the configured model: parameter 'blocks.0.attn.proj.weight' "
                               "has shape [32, 32] in the checkpoint and [64, 64]"), lines[0]
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_every_float_key_refuses_inf_and_nan():
    """No float setting can usefully be infinite or nan: each is refused by its dotted name."""
    import dataclasses

    cfg = load_config()
    floats = [f"{section.name}.{f.name}" for section in dataclasses.fields(cfg)
              for f in dataclasses.fields(getattr(cfg, section.name))
              if isinstance(getattr(getattr(cfg, section.name), f.name), float)]
    assert "optim.lr" in floats and len(floats) >= 12
    for key in floats:
        for value in (".inf", "-.inf", ".nan"):
            with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')} must be"):
                load_config(None, [f"{key}={value}"])


@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\\b", " x", "", "x\x00y"])
def test_run_name_is_a_plain_folder_name(name):
    with pytest.raises(ConfigError, match="run.name must be a plain folder name"):
        load_config(None, {"run.name": name})
    assert load_config(None, {"run.name": "my-run_2.v1"}).run.name == "my-run_2.v1"


def test_config_file_not_utf8_or_a_folder_is_named(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"config file '{path}' is not UTF-8 text"):
        load_config(path)
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a folder"):
        load_config(tmp_path)


def test_empty_section_in_a_file_takes_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\ntrain:\n")
    assert load_config(path, ["run.name=x"]).run.name == "x"


def test_collective_timeout_reaches_the_process_group(small_dataset, tmp_path):
    """scaling.collective_timeout_s is the process group's timeout (not torch's 30 minutes)."""
    from elastic_train.cluster.driver import build_trainer
    from elastic_train.preflight.inputs import check_inputs

    cfg = load_config(None, [f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "data.max_seq_len=128", "data.micro_batch_tokens=1024",
                             "data.global_batch_tokens=4096", "scaling.collective_timeout_s=42",
                             *NO_EVAL])
    trainer = build_trainer(cfg, check_inputs(cfg), runlog=None)
    torch_config = trainer.backend_config  # Ray 2.60: the TorchConfig given to TorchTrainer
    assert (torch_config.backend, torch_config.timeout_s) == ("gloo", 42)


def test_the_trainer_leaves_out_what_a_run_does_not_use(small_dataset, tmp_path):
    """No Ray Train datasets (the workers read their own shards): no DatasetManager actor per
    worker group; without the state API (a local run without dashboard): no placement-group
    cleaner. Ray 2.60's callback names: if Ray renames them, this fails."""
    from ray.train.torch import TorchTrainer

    from elastic_train.cluster.driver import build_trainer
    from elastic_train.preflight.inputs import check_inputs

    cfg = load_config(None, [f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "data.max_seq_len=128", "data.micro_batch_tokens=1024",
                             "data.global_batch_tokens=4096", *NO_EVAL])
    info = check_inputs(cfg)
    trainers = {pg: build_trainer(cfg, info, runlog=None, pg_cleaner=pg) for pg in (True, False)}
    names = {pg: {type(c).__name__ for c in t._create_default_callbacks()} for pg, t in trainers.items()}
    rays = {type(c).__name__ for c in TorchTrainer._create_default_callbacks(trainers[True])}
    assert {"DatasetsCallback", "PlacementGroupCleanerCallback"} <= rays  # the names left out exist
    assert "BackendSetupCallback" in names[True] and "DatasetsCallback" not in names[True]
    assert "PlacementGroupCleanerCallback" in names[True]
    assert "PlacementGroupCleanerCallback" not in names[False]
    assert names[True] - names[False] == {"PlacementGroupCleanerCallback"}


@pytest.mark.parametrize("entry, culprit", [("25:boom", "'25:boom'"), ("0:crash", "'0:crash'"),
                                            ("x:kill:1", "'x:kill:1'"), ("5:kill:7", "rank 7"),
                                            ("9:join:1", "'9:join:1'")])
def test_a_malformed_fault_schedule_entry_is_named(entry, culprit):
    with pytest.raises(ConfigError, match=f"fault.schedule: {culprit}"):
        load_config(None, [f"fault.schedule=[{entry}]"])


def test_a_node_fault_in_the_schedule_is_a_hook_of_restart_mode():
    cfg = load_config(None, ["fault.schedule=[9:lose, 20:join:0, 30:drain]"])
    assert cfg.fault.schedule == ["9:lose", "20:join:0", "30:drain"]
    with pytest.raises(ConfigError, match="fault.schedule: 9:lose is a test hook of fault.recovery=restart"):
        load_config(None, ["fault.recovery=in_place", "fault.schedule=[9:lose]"])


def test_a_fault_schedule_is_read_from_the_command_line_and_drawn_from_a_seed():
    from elastic_train.config import fault_schedule
    from elastic_train.recovery.chaos import draw_fault_schedule

    cfg = load_config(None, ["fault.schedule=[25:crash:1, 45:kill, 68:stop]"])
    assert fault_schedule(cfg.fault.schedule) == [(25, "crash", 1), (45, "kill", 0), (68, "stop", 0)]
    drawn = draw_fault_schedule(3, 44, ("crash", "kill", "stop"), world_size=2)
    assert drawn == draw_fault_schedule(3, 44, ("crash", "kill", "stop"), world_size=2)
    steps = [step for step, _, _ in fault_schedule(drawn)]
    assert len(steps) == 3 and 4 < steps[0] and steps[-1] <= 40
    assert all(b - a >= 8 for a, b in zip(steps, steps[1:], strict=False))


# ---- what users type: the command line's order, text keys, flow values --------------------------

def test_overrides_on_both_sides_of_an_option_are_all_read(tmp_path):
    """`train run.name=x --config f.yaml optim.lr=1e-3` (and --verbose between overrides): every
    override is read; argparse's plain parse_args refused the ones after an option."""
    cfg = tmp_path / "x.yaml"
    cfg.write_text("run:\n  name: bad\n")
    proc = _cli("train", f"run.storage_path={tmp_path}", "--config", str(cfg), "--verbose",
                "train.max_stepz=3")
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and lines == [lines[0]] and "train.max_stepz" in lines[0], proc.stderr
    from elastic_train.cli import parse_args

    args = parse_args(["prepare", "a.txt", "--output", "o", "b.txt", "--seed", "3"])
    assert (args.inputs, args.output, args.seed) == (["a.txt", "b.txt"], "o", 3)


def test_examples_driver_reads_intermixed_overrides_and_names_a_missing_file(monkeypatch, capsys):
    """examples/driver.py parses as the command line does, and a FileNotFoundError from the run
    is one `error:` line (exit 2) there too."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "driver.py"
    spec = importlib.util.spec_from_file_location("example_driver", path)
    driver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(driver)
    assert driver.main(["run.name=x", "--config", str(driver.REPO / "jobs" / "configs" / "smoke.yaml"),
                        "optim.lrr=1"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown config key 'optim.lrr'")

    def missing(cfg):
        raise FileNotFoundError("no such file: /nope/tokenizer.json")

    monkeypatch.setattr(driver, "train", missing)
    assert driver.main(["run.name=x"]) == 2
    assert capsys.readouterr().err == "error: no such file: /nope/tokenizer.json\n"


@pytest.mark.parametrize("text", ["2024", "2024-05-01", "yes", "1:30", "off", "0x10", "null"])
def test_a_text_key_keeps_its_override_as_typed(text):
    """A key whose type is text takes the override's text, not what YAML reads it as (an int, a
    date, True, 90 for 1:30); YAML's null still means None for a key that may be None."""
    cfg = load_config(None, [f"run.name={text}", f"log.wandb={text}", f"data.path={text}",
                             f"train.compile_cache_dir={text}", "eval.fraction=0",
                             "checkpoint.keep_best=false"])
    assert (cfg.run.name, cfg.train.compile_cache_dir) == (text, text)
    expected = None if text == "null" else text
    assert (cfg.log.wandb, cfg.data.path) == (expected, expected)


def test_a_text_key_override_quoted_or_empty():
    assert load_config(None, ["run.name='a:b'"]).run.name == "a:b"  # YAML's quotes still unquote
    cfg = load_config(None, ["data.path=~", "log.mlflow=", "train.compile_cache_dir="])
    assert (cfg.data.path, cfg.log.mlflow, cfg.train.compile_cache_dir) == (None, None, "")


@pytest.mark.parametrize("value, kind", [("2024", "an integer"), ("2024-05-01", "a date"),
                                         ("yes", "a boolean"), ("1:30", "an integer")])
@pytest.mark.parametrize("section, key", [("run", "name"), ("data", "path")])  # str, str | None
def test_a_text_key_in_a_file_is_refused_saying_how_to_quote_it(tmp_path, value, kind, section, key):
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=f"^{section}.{key}: expected str.*, got .* \\(YAML reads "
                                          f"this unquoted value as {kind}: put it in quotes"):
        load_config(path)
    path.write_text(f"{section}:\n  {key}: \"{value}\"\n")
    assert getattr(getattr(load_config(path), section), key) == value


@pytest.mark.parametrize("override, fixed", [
    ("scaling.resources_per_worker={tcp_gpu:1}", "{tcp_gpu: 1}"),
    ("model.kwargs={hidden:512}", "{hidden: 512}"),
])
def test_a_flow_mapping_without_a_space_after_the_colon_says_so(override, fixed):
    """YAML reads {tcp_gpu:1} as {"tcp_gpu:1": None}: the message says what to write instead of
    `scaling.resources_per_worker.tcp_gpu:1: expected float, got None`."""
    with pytest.raises(ConfigError, match=re.escape(f"needs a space after the colon, {fixed}")):
        load_config(None, [override])


def test_eval_path_beside_the_embedded_eval_fraction_says_what_to_add():
    with pytest.raises(ConfigError, match="both set: add eval.fraction=0 to evaluate on eval.path alone"):
        load_config(None, ["eval.path=/x"])
    assert load_config(None, ["eval.path=/x", "eval.fraction=0"]).eval.path == "/x"
