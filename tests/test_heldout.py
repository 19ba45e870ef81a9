"""Held-out evaluation on whole documents: `prepare --eval-fraction` puts every row of a held-out
document into `eval/` and none into training, each row says which document it was cut from
(`doc`), and training evaluates on exactly that set (or refuses, or warns); data.max_seq_len left
unset is the data set's own."""

from __future__ import annotations

import json
import logging
import sysconfig
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import TINY

from elastic_train.cli import main as cli_main
from elastic_train.config import ConfigError, load_config
from elastic_train.data.blocks import BlockReader
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.heldout import held_documents, row_ids
from elastic_train.data.prepare import prepare
from elastic_train.data.rechunk import rechunk
from elastic_train.data.sources import document_spans
from elastic_train.preflight.inputs import check_inputs, data_tables

pytestmark = pytest.mark.unit

STDLIB = Path(sysconfig.get_paths()["stdlib"])
NO_SEQ_LEN = [key for key in TINY if not key.startswith("data.max_seq_len")]


def shard_table(folder: Path) -> pa.Table:
    """The rows of a prepared folder's own shards (not those of `eval/` inside it)."""
    return pa.concat_tables(pq.read_table(path) for path in sorted(folder.glob("part-*.parquet")))


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory) -> list[str]:
    """Documents of every kind, most cut into many rows at max_seq_len 48: 240 JSONL records of
    30 to 1,500 bytes, a prose file of 40 paragraphs (some long), a Python module (definitions)."""
    root = tmp_path_factory.mktemp("long_docs")
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa ".split()
    with open(root / "records.jsonl", "w") as handle:
        for i in range(240):
            text = f"Record {i}: " + " ".join(words[(i + k) % len(words)] for k in range(3 + (i * 37) % 250))
            handle.write(json.dumps({"text": text}) + "\n")
    paragraphs = [f"Paragraph {i}. " + "words of prose " * (1 + (i * 7) % 30) for i in range(40)]
    (root / "notes.txt").write_text("\n\n".join(paragraphs) + "\n")
    return [str(root / "records.jsonl"), str(root / "notes.txt"), str(STDLIB / "textwrap.py")]


@pytest.fixture(scope="module")
def split(long_docs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("split") / "out"
    prepare(long_docs, out, max_seq_len=48, rows_per_shard=500, rows_per_block=16, seed=5,
            eval_fraction=0.2)
    return out


def test_held_out_documents_are_whole_and_about_the_fraction_asked(long_docs, split):
    train, held = shard_table(split), shard_table(split / "eval")
    train_docs, held_docs = set(train["doc"].to_pylist()), set(held["doc"].to_pylist())
    assert not train_docs & held_docs  # no document has rows on both sides
    documents = len(train_docs | held_docs)
    assert train_docs | held_docs == set(range(documents))  # numbered 0..D-1, none lost
    definitions = len(document_spans(Path(long_docs[2]).read_bytes(), python=True, max_seq_len=48))
    assert documents == 240 + 40 + definitions and len(train) > 3 * documents  # many rows per document
    assert 0.15 < len(held_docs) / documents < 0.25
    # Ids: the training rows 0..N-1, the held-out rows N.., each once.
    assert sorted(train["id"].to_pylist()) == list(range(len(train)))
    assert sorted(held["id"].to_pylist()) == list(range(len(train), len(train) + len(held)))
    stats = json.loads((split / "_prepare.json").read_text())
    assert stats["rows"] == len(train) and stats["eval"] == {
        "path": "eval", "fraction": 0.2, "documents": len(held_docs), "rows": len(held),
        "tokens": sum(held["length"].to_pylist())}
    # The held-out set is a prepared data set of its own, which training reads.
    info = inspect_dataset(str(split / "eval"))
    assert info.rows == len(held) and info.columns == tuple(train.column_names)
    assert json.loads((split / "eval" / "_prepare.json").read_text())["held_out"] == {"fraction": 0.2}
    # Another seed holds out other documents.
    assert not np.array_equal(held_documents(documents, 0.2, 5), held_documents(documents, 0.2, 6))


def test_rows_of_a_document_are_consecutive_pieces_of_its_text(long_docs, split):
    """Joined in offset order, a document's rows are its text: a JSONL record, a paragraph, a
    Python definition; documents are numbered in input order (file, then place in the file)."""
    rows = pa.concat_tables([shard_table(split), shard_table(split / "eval")]).to_pylist()
    by_doc: dict[int, list[dict]] = defaultdict(list)
    for row in rows:
        by_doc[row["doc"]].append(row)
    starts = []
    texts: dict[str, list[bytes]] = defaultdict(list)
    for doc in sorted(by_doc):
        pieces = sorted(by_doc[doc], key=lambda row: row["offset"])
        assert len({row["source"] for row in pieces}) == 1
        ends = [row["offset"] + row["length"] for row in pieces]
        assert [row["offset"] for row in pieces[1:]] == ends[:-1]  # back to back
        starts.append((long_docs.index(pieces[0]["source"]), pieces[0]["offset"]))
        texts[pieces[0]["source"]].append(b"".join(bytes(row["tokens"]) for row in pieces))
    assert starts == sorted(starts)  # doc order is input order
    records = [json.loads(line)["text"].encode() for line in open(long_docs[0])]
    assert texts[long_docs[0]] == records  # one document per record, whole
    notes = Path(long_docs[1]).read_bytes()
    assert len(texts[long_docs[1]]) == 40 and b"".join(texts[long_docs[1]]) == notes
    assert all(text.startswith(b"Paragraph") for text in texts[long_docs[1]])
    assert b"".join(texts[long_docs[2]]) == Path(long_docs[2]).read_bytes()
    assert any(b"def dedent(" in text and len(text) > 48 for text in texts[long_docs[2]])


def test_cli_eval_fraction_and_bad_values(long_docs, tmp_path, capsys):
    out = tmp_path / "cli"
    argv = ["prepare", *long_docs, "--output", str(out), "--max-seq-len", "48", "--seed", "5",
            "--rows-per-block", "16", "--eval-fraction", "0.2", "--engine", "local"]
    assert cli_main(argv) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["eval"]["documents"] > 0 and (out / "eval" / "part-00000.parquet").exists()
    one = tmp_path / "one.txt"
    one.write_text("a single paragraph\n")
    for args, message in [(["--eval-fraction", "1"], "--eval-fraction must be in [0, 0.5)"),
                          (["--eval-fraction", "-0.1"], "--eval-fraction must be in [0, 0.5)"),
                          (["--eval-fraction", "0.1"], "none is left for training")]:
        assert cli_main(["prepare", str(one), "--output", str(tmp_path / "bad"), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
        assert not (tmp_path / "bad").exists()


def test_row_ids_keep_the_old_ids_without_a_split_and_number_held_rows_after():
    held = np.zeros(10, dtype=bool)
    ids, train = row_ids(held, 3)
    assert train == 10 and np.array_equal(np.argsort(ids), np.random.default_rng(3).permutation(10))
    held[[2, 3, 7]] = True
    ids, train = row_ids(held, 3)
    assert train == 7 and sorted(ids[held]) == [7, 8, 9] and sorted(ids[~held]) == list(range(7))


def test_rechunk_takes_the_held_out_set_along(split, tmp_path):
    stats = rechunk(split, tmp_path / "re", rows_per_block=7)
    assert stats["eval"]["path"] == "eval"
    info = inspect_dataset(str(tmp_path / "re"))
    assert info.eval_split is not None and inspect_dataset(info.eval_split["path"]).rows == (
        stats["eval"]["rows"])


# -- at train time ------------------------------------------------------------------------------
def _ids(table) -> set[int]:
    return {int(i) for i in BlockReader(table).read(np.arange(len(table)))["id"]}


def test_a_run_evaluates_on_exactly_the_recorded_split(split, tmp_path, caplog):
    base = [*TINY, f"data.path={split}", f"run.storage_path={tmp_path}"]
    cfg = load_config(None, [*base, "eval.fraction=0.2"])
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        check_inputs(cfg)  # the driver's checks pass, and say nothing
    assert not caplog.records
    tables = data_tables(cfg, inspect_dataset(str(split)))
    assert tables.eval_info.path == str(split / "eval")
    assert _ids(tables.eval) == set(shard_table(split / "eval")["id"].to_pylist())
    assert _ids(tables.train) == set(shard_table(split)["id"].to_pylist())  # all trained
    # Another fraction: one warning naming both, and the recorded split is used all the same.
    cfg = load_config(None, [*base, "eval.fraction=0.05"])
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        check_inputs(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "eval.fraction is 0.05" in warnings[0]
    assert "--eval-fraction 0.2" in warnings[0]
    assert _ids(data_tables(cfg, inspect_dataset(str(split))).eval) == _ids(tables.eval)


def test_a_local_run_evaluates_every_held_out_row(split, tmp_path):
    from localenv import train_locally

    cfg = load_config(None, [*TINY, f"data.path={split}", "eval.fraction=0.2",
                             "train.max_steps=2", "eval.every_steps=0"])
    env = train_locally(cfg)
    held = shard_table(split / "eval")
    assert env.evals[-1]["eval_targets"] == sum(length - 1 for length in held["length"].to_pylist())


def test_a_data_set_with_documents_but_no_split_is_refused(small_dataset, tmp_path):
    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", "eval.fraction=0.1",
                             f"run.storage_path={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_inputs(cfg)
    message = str(info.value)
    assert message.startswith("eval.fraction: ") and "--eval-fraction 0.1" in message
    assert "eval.path" in message and small_dataset in message


def test_a_data_set_without_documents_keeps_row_groups_with_a_warning(small_dataset, tmp_path,
                                                                      caplog):
    """Made by another tool (no `doc` column): row groups held out as before, one warning."""
    other = tmp_path / "other"
    other.mkdir()
    for path in sorted(Path(small_dataset).glob("*.parquet")):
        table = pq.read_table(path).drop_columns(["doc"])
        pq.write_table(table, other / path.name, row_group_size=32)
    cfg = load_config(None, [*TINY, f"data.path={other}", "eval.fraction=0.1",
                             f"run.storage_path={tmp_path / 'runs'}"])
    with caplog.at_level(logging.WARNING, logger="elastic_train"):
        check_inputs(cfg)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no doc column" in warnings[0] and str(other) in warnings[0]
    tables = data_tables(cfg, inspect_dataset(str(other)))
    assert tables.eval_info is None and len(tables.eval) == round(0.1 * (len(tables.train)
                                                                         + len(tables.eval)))


def test_max_seq_len_unset_is_the_data_sets(split, tmp_path):
    base = [*NO_SEQ_LEN, f"run.storage_path={tmp_path}"]
    cfg = load_config(None, [*base, f"data.path={split}"])
    assert cfg.data.max_seq_len is None
    check_inputs(cfg)
    assert cfg.data.max_seq_len == 48 and yaml.safe_load(cfg.to_yaml())["data"]["max_seq_len"] == 48
    # Without _prepare.json (another tool's data): its longest row.
    other = tmp_path / "other"
    other.mkdir()
    lengths = pa.array([3, 40, 7, 5], pa.int32())
    pq.write_table(pa.table({"id": [0, 1, 2, 3], "tokens": [[1] * 3, [2] * 40, [3] * 7, [4] * 5],
                             "length": lengths}), other / "part-00000.parquet", row_group_size=1)
    cfg = load_config(None, [*base, f"data.path={other}", "data.global_batch_tokens=2048",
                             "data.micro_batch_tokens=1024"])
    check_inputs(cfg)
    assert cfg.data.max_seq_len == 40
    # Rows longer than a micro-batch: refused, naming both keys.
    cfg = load_config(None, [*base, f"data.path={split}", "data.micro_batch_tokens=32",
                             "data.global_batch_tokens=128"])
    with pytest.raises(ConfigError, match=r"data.micro_batch_tokens \(32\) .* data.max_seq_len"):
        check_inputs(cfg)
