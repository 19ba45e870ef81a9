"""Tests for elastic_train.cluster.prepare_ray: the Ray Data `prepare` gives the shards of the
single-process `prepare`, whatever the run and the parallelism."""

from __future__ import annotations

import json
import os
import sysconfig
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from elastic_train.cli import main as cli_main
from elastic_train.cluster import prepare_ray as prepare_ray_module
from elastic_train.cluster.prepare_ray import choose_engine, prepare_ray
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.prepare import prepare
from elastic_train.data.rowgroups import build_block_table
from elastic_train.data.sources import collect_input_files

STDLIB = Path(sysconfig.get_paths()["stdlib"])
ARGS = {"max_seq_len": 64, "rows_per_shard": 150, "rows_per_block": 16, "seed": 3}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """Python and prose text files, a JSONL and a Parquet file (with empty and null texts)."""
    root = tmp_path_factory.mktemp("inputs")
    texts = [f"Record {i}: " + "some words here " * (i % 7 + 1) for i in range(40)]
    (root / "notes.txt").write_text("\n\n".join(texts[:10]) + "\n")
    with open(root / "records.jsonl", "w") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"text": text if i % 9 else "", "n": i}) + "\n")
    column = [None if i % 11 == 0 else text[::-1] for i, text in enumerate(texts)]
    pq.write_table(pa.table({"text": column}), root / "records.parquet", row_group_size=8)
    return [str(STDLIB / "textwrap.py"), str(STDLIB / "shlex.py"), str(root)]


def shards(folder: Path) -> dict[str, pa.Table]:
    """Every shard of a prepared folder, by file name."""
    return {path.name: pq.read_table(path) for path in sorted(folder.glob("*.parquet"))}


def stats_of(folder: Path) -> dict:
    return json.loads((folder / "_prepare.json").read_text())


def assert_same_shards(left: Path, right: Path, min_shards: int = 2) -> None:
    """Same shard files, each with the same rows (all columns, same order), same stats; and
    the same held-out set in `eval/` when there is one."""
    a, b = shards(left), shards(right)
    assert list(a) == list(b) and len(a) >= min_shards
    for name in a:
        assert a[name].equals(b[name]), name
    assert {**stats_of(left), "engine": None} == {**stats_of(right), "engine": None}
    assert (left / "eval").exists() == (right / "eval").exists()
    if (left / "eval").exists():
        assert_same_shards(left / "eval", right / "eval", min_shards=1)
        assert (left / "eval" / "tokenizer").exists() == (left / "tokenizer").exists()


@contextmanager
def one_cpu_one_task_per_cpu(monkeypatch):
    """Ray Data limited to one CPU of the cluster (one task at a time), the JSONL and Parquet
    inputs cut into pieces of about 256 bytes, and the pieces grouped into one task per CPU
    instead of TASKS_PER_CPU: other parallelism, other pieces, other blocks."""
    import ray.data
    from ray.data import ExecutionResources

    context = ray.data.DataContext.get_current()
    saved = context.execution_options.resource_limits
    monkeypatch.setattr(prepare_ray_module, "TASKS_PER_CPU", 1)
    monkeypatch.setattr(prepare_ray_module, "PIECE_BYTES", 256)
    context.execution_options.resource_limits = ExecutionResources(cpu=1)
    try:
        yield
    finally:
        context.execution_options.resource_limits = saved
        monkeypatch.undo()


@pytest.mark.ray
def test_runs_on_one_or_two_cpus_give_the_shards_of_the_local_prepare(
        ray_cluster, inputs, tmp_path, bpe_tokenizer, monkeypatch):
    """With a BPE tokenizer and a held-out split: a run on both CPUs, a run on one CPU with other
    task groups (JSONL and Parquet files cut into pieces: documents numbered across pieces), and
    the single-process prepare write identical shards (ids, tokens, lengths, sources, offsets,
    documents), the same `eval/` and `_prepare.json` (but for "engine"); the tokenizer copy is
    there."""
    split = {**ARGS, "eval_fraction": 0.25}
    first = prepare_ray(inputs, tmp_path / "two", tokenizer=bpe_tokenizer, progress=False, **split)
    with one_cpu_one_task_per_cpu(monkeypatch):
        pieces = prepare_ray_module._list_pieces(collect_input_files(inputs))
        assert sorted({piece["kind"] for piece in pieces}) == ["file", "jsonl", "parquet"]
        assert len(pieces) > 10
        prepare_ray(inputs, tmp_path / "one", tokenizer=bpe_tokenizer, progress=False, **split)
    local = prepare(inputs, tmp_path / "local", tokenizer=bpe_tokenizer, **split)
    assert local["eval"]["documents"] > 0 and (tmp_path / "local" / "eval").exists()
    assert_same_shards(tmp_path / "two", tmp_path / "one")
    assert_same_shards(tmp_path / "two", tmp_path / "local")
    assert first == {**local, "engine": "ray"} and first["source_files"] == 5
    assert first["tokenizer"]["kind"] == "hf" and first["token_type"] == "int16"
    info = inspect_dataset(str(tmp_path / "two"))
    assert info.tokenizer_kind == "hf" and info.tokenizer_path is not None
    assert info.rows == first["rows"] and info.max_length <= ARGS["max_seq_len"]


@pytest.mark.ray
def test_cli_engine_ray_writes_blocks_of_rows_per_block_and_dense_ids(ray_cluster, inputs, tmp_path,
                                                                      capsys):
    """Bytes through `elastic-train prepare --engine ray` to a URI: the stats on stdout, the
    final line on stderr, the shards of the single-process prepare, row groups (training's
    blocks) of `--rows-per-block` rows, ids 0..N-1 each once."""
    argv = ["prepare", *inputs, "--output", f"file://{tmp_path}/ray", "--max-seq-len", "64",
            "--rows-per-block", "16", "--seed", "3", "--engine", "ray", "--eval-fraction", "0"]
    assert cli_main(argv) == 0
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert stats["engine"] == "ray" and stats == stats_of(tmp_path / "ray")
    assert (f"prepared {stats['rows']} rows, {stats['tokens']} tokens, {stats['shards']} shards in "
            in captured.err and "tokens/s)" in captured.err)
    prepare(inputs, tmp_path / "local", max_seq_len=64, rows_per_block=16, seed=3,
            rows_per_shard=20000)
    assert_same_shards(tmp_path / "ray", tmp_path / "local", min_shards=1)
    info = inspect_dataset(str(tmp_path / "ray"))
    table = build_block_table(pafs.LocalFileSystem(), info.files, info.files)
    rows = table.rows[table.file_index == 0]
    assert len(rows) > 4 and (rows[:-1] == 16).all() and 0 < rows[-1] <= 16
    ids = pq.read_table(info.files[0], columns=["id"]).column("id").to_numpy()
    assert np.array_equal(ids, np.arange(info.rows))


@pytest.mark.ray
def test_an_error_in_a_task_is_the_local_value_error_and_writes_nothing(ray_cluster, tmp_path,
                                                                        monkeypatch):
    """A bad line in a later piece of a JSONL file, a Parquet file cut into pieces without the
    text column: the message of the single-process prepare (the file as given, the line in the
    file), and no output folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(prepare_ray_module, "PIECE_BYTES", 64)
    Path("in").mkdir()
    Path("in", "a.txt").write_text("fine text\n")
    Path("in", "b.jsonl").write_text('{"text": "ok"}\n' * 30 + '{"text": "broken"\n')
    with pytest.raises(ValueError) as local:
        prepare(["in"], "local")
    with pytest.raises(ValueError) as ray_error:
        prepare_ray(["in"], "out", progress=False)
    assert str(ray_error.value) == str(local.value)
    assert str(local.value).startswith("'in/b.jsonl' line 31 is not valid JSON")
    assert not Path("out").exists()
    Path("in", "b.jsonl").unlink()
    pq.write_table(pa.table({"body": [f"text {i}" for i in range(40)]}), "in/c.parquet",
                   row_group_size=4)  # many row groups: many pieces
    with pytest.raises(ValueError, match="has no column 'text'") as local:
        prepare(["in"], "local")
    with pytest.raises(ValueError) as ray_error:
        prepare_ray(["in"], "out", progress=False)
    assert str(ray_error.value) == str(local.value) and not Path("out").exists()


@pytest.mark.unit
def test_bad_arguments_and_output_are_refused_before_ray_starts(tmp_path, monkeypatch):
    def no_ray(num_cpus):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(prepare_ray_module, "_ray_cluster", no_ray)
    (tmp_path / "full").mkdir()
    pq.write_table(pa.table({"x": [1]}), tmp_path / "full" / "x.parquet")
    (tmp_path / "a.txt").write_text("text\n")
    cases = [
        ({"output": tmp_path / "full"}, "already contains Parquet files"),
        ({"output": tmp_path / "o", "rows_per_block": 0}, "rows_per_block must be at least 1"),
        ({"output": tmp_path / "o", "inputs": [tmp_path / "missing"]}, "does not exist"),
        ({"output": tmp_path / "o", "tokenizer": tmp_path / "nope"}, "--tokenizer"),
    ]
    for kwargs, message in cases:
        call = {"inputs": [tmp_path / "a.txt"], **kwargs}
        with pytest.raises(ValueError, match=message):
            prepare_ray(call.pop("inputs"), call.pop("output"), **call)


@pytest.mark.unit
def test_auto_engine_is_ray_for_a_large_corpus_or_a_cluster_address(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("x" * 1000)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert choose_engine("auto", [tmp_path]) == "local"
    assert choose_engine("ray", [tmp_path]) == "ray"
    monkeypatch.setattr(prepare_ray_module, "AUTO_RAY_MIN_BYTES", 1000)
    assert choose_engine("auto", [tmp_path]) == "ray"
    monkeypatch.setattr(prepare_ray_module, "AUTO_RAY_MIN_BYTES", 1 << 40)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert choose_engine("auto", [tmp_path]) == "ray"
    assert os.environ["RAY_ADDRESS"] and choose_engine("local", [tmp_path]) == "local"
