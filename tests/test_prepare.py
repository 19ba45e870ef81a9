"""Tests for elastic_train.data.prepare: text files to Parquet shards, and checking shards."""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from elastic_train.cli import main as cli_main
from elastic_train.data import prepare as prepare_module
from elastic_train.data import sources
from elastic_train.data.dataset import inspect_dataset, load_dataset_tokenizer
from elastic_train.data.plan import bucket_window
from elastic_train.data.prepare import default_corpus_dir, prepare, stdlib_source_files
from elastic_train.data.sources import split_document_spans, tokenized_file_rows
from elastic_train.data.tokenizer import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.unit

PY_SOURCE = '''"""A module."""
import os


@decorator
@other(
    arg=1,
)
def first():
    return 1


class Second:
    """Prose in a docstring:
    class and def words that start a line do not cut it.
    """
    x = 1
    # A comment block directly above a method
    # stays with it.
    @property
    def method(self):
        def inner():
            pass

        return inner

async def third():
    """Unicode: h\u00e9llo w\u00f6rld \u2603."""
'''

BYTES_RECORD = {"kind": "bytes", "vocab_size": 256, "eos_id": None, "pad_id": None}
TEXT = "First paragraph,\ntwo lines.\n\n\nSecond paragraph.\n  \n\nThird " + "long " * 80 + "end.\n"


def write_inputs(root: Path) -> list[Path]:
    """A small tree of .py, .txt and .md files, one document longer than 64 bytes."""
    (root / "pkg" / "sub").mkdir(parents=True)
    files = [root / "pkg" / "mod.py", root / "pkg" / "sub" / "notes.txt", root / "readme.md"]
    files[0].write_text(PY_SOURCE)
    files[1].write_text(TEXT)
    files[2].write_text("# Title\n\nSome *markdown*.\n")
    (root / "pkg" / "empty.txt").write_text("")
    (root / "pkg" / "image.bin").write_bytes(b"\x00\x01")  # not a text suffix: skipped
    return files


def read_all(folder: Path) -> pa.Table:
    """All shards of a prepared folder, concatenated in file order."""
    return pa.concat_tables(pq.read_table(path) for path in sorted(folder.glob("*.parquet")))


def reconstruct(table: pa.Table) -> dict[str, bytes]:
    """Each source file's bytes, rebuilt from its rows ordered by offset."""
    pieces = defaultdict(list)
    for row in table.select(["source", "offset", "tokens"]).to_pylist():
        pieces[row["source"]].append((row["offset"], bytes(row["tokens"])))
    return {source: b"".join(chunk for _, chunk in sorted(rows)) for source, rows in pieces.items()}


def test_round_trip_reconstructs_every_file(tmp_path):
    files = write_inputs(tmp_path / "in")
    stats = prepare([tmp_path / "in"], tmp_path / "out", max_seq_len=64, rows_per_shard=5)
    table = read_all(tmp_path / "out")
    ids = table.column("id").to_numpy()
    lengths = table.column("length").to_numpy()
    assert sorted(ids) == list(range(len(table)))
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("length").type == pa.int32()
    assert list(lengths) == [len(tokens) for tokens in table.column("tokens").to_pylist()]
    assert lengths.max() <= 64 and lengths.min() >= 1
    assert reconstruct(table) == {str(path): path.read_bytes() for path in files}
    total_bytes = sum(path.stat().st_size for path in files)
    assert stats == {"rows": len(table), "tokens": total_bytes, "max_seq_len": 64,
                     "shards": len(list((tmp_path / "out").glob("part-*.parquet"))),
                     "source_files": 4,  # the empty file was read too
                     "skipped_binary_files": 0,
                     "tokenizer": BYTES_RECORD, "token_type": "int16", "rows_per_block": 1,
                     "max_token_id": max(max(path.read_bytes()) for path in files)}
    assert table.schema.field("tokens").type == pa.list_(pa.int16())
    assert not (tmp_path / "out" / "tokenizer").exists()  # no copy of the byte tokenizer
    assert stats["shards"] == -(-len(table) // 5)
    assert json.loads((tmp_path / "out" / "_prepare.json").read_text()) == stats


def test_python_split_at_every_def_keeps_decorators_and_comments_with_it():
    data = PY_SOURCE.encode()
    spans = split_document_spans(data, python=True, max_seq_len=10_000)
    docs = [data[start:end].decode() for start, end in spans]
    assert [doc.split("\n")[0] for doc in docs] == [
        '"""A module."""', "@decorator", "class Second:",
        "    # A comment block directly above a method", "        def inner():",
        "async def third():"]
    assert docs[3].split("\n")[2:4] == ["    @property", "    def method(self):"]
    assert docs[4].endswith("        return inner\n\n")  # the rest of the outer body
    assert "".join(docs) == PY_SOURCE


def test_comment_separated_from_def_by_code_or_blank_line_is_not_attached():
    source = "x = 1\n# about x\ny = 2\ndef f():\n    pass\n# about g\n\ndef g(): pass\n"
    spans = split_document_spans(source.encode(), python=True, max_seq_len=10_000)
    docs = [source[start:end] for start, end in spans]
    assert docs == ["x = 1\n# about x\ny = 2\n", "def f():\n    pass\n# about g\n\n",
                    "def g(): pass\n"]


def test_long_python_definition_is_cut_at_blank_lines_into_paragraph_groups():
    body = "".join(f"    step_{i} = {i}\n\n" for i in range(10))  # 10 paragraphs of 16 bytes
    source = "def long():\n" + body + "def short():\n    pass\n"
    data = source.encode()
    docs = [data[start:end] for start, end in split_document_spans(data, python=True,
                                                                     max_seq_len=64)]
    assert b"".join(docs) == data
    # 172 bytes > 64: cut into groups of whole paragraphs of at most 64 // 2 bytes.
    assert docs[0] == b"def long():\n    step_0 = 0\n\n"
    assert docs[1:5] == [b"    step_%d = %d\n\n    step_%d = %d\n\n" % (i, i, i + 1, i + 1)
                         for i in range(1, 9, 2)]
    assert docs[5:] == [b"    step_9 = 9\n\n", b"def short():\n    pass\n"]
    # A definition that fits max_seq_len stays whole, blank lines and all.
    whole = split_document_spans(data, python=True, max_seq_len=200)
    assert [data[start:end] for start, end in whole] == [data[:-22], data[-22:]]


def test_text_split_keeps_blank_lines_with_paragraph_before():
    data = TEXT.encode()
    spans = split_document_spans(data, python=False, max_seq_len=10_000)
    docs = [data[start:end] for start, end in spans]
    assert docs[0] == b"First paragraph,\ntwo lines.\n\n\n"
    assert docs[1] == b"Second paragraph.\n  \n\n"
    assert docs[2].startswith(b"Third") and len(docs) == 3


def test_long_document_is_split_into_chunks_not_dropped(tmp_path):
    text = "x" * 250 + "\n"
    (tmp_path / "long.txt").write_text(text)
    stats = prepare([tmp_path / "long.txt"], tmp_path / "out", max_seq_len=100)
    table = read_all(tmp_path / "out")
    assert sorted(table.column("length").to_pylist()) == [51, 100, 100]
    assert stats["rows"] == 3 and stats["tokens"] == 251
    assert reconstruct(table) == {str(tmp_path / "long.txt"): text.encode()}


def test_shuffle_is_seeded_and_deterministic(tmp_path):
    write_inputs(tmp_path / "in")
    for name, seed in [("a", 1), ("b", 1), ("c", 2)]:
        prepare([tmp_path / "in"], tmp_path / name, max_seq_len=32, seed=seed)
    orders = {name: read_all(tmp_path / name).column("offset").to_pylist() for name in "abc"}
    assert orders["a"] == orders["b"]
    shards = sorted(path.name for path in (tmp_path / "a").iterdir())
    assert all((tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
               for name in shards)  # written byte for byte the same
    assert orders["a"] != orders["c"]


def test_refuses_to_overwrite_existing_shards(tmp_path):
    write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out")
    before = (tmp_path / "out" / "part-00000.parquet").read_bytes()
    with pytest.raises(ValueError, match="already contains Parquet files") as info:
        prepare([tmp_path / "in"], tmp_path / "out", seed=5)
    assert str(tmp_path / "out") in str(info.value)
    assert (tmp_path / "out" / "part-00000.parquet").read_bytes() == before


def test_missing_input_names_the_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist") as info:
        prepare([tmp_path / "nope"], tmp_path / "out")
    assert str(tmp_path / "nope") in str(info.value)
    assert not (tmp_path / "out").exists()


def test_empty_input_is_refused(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="no input text found"):
        prepare([tmp_path / "in"], tmp_path / "out")
    with pytest.raises(ValueError, match="no input text found"):
        prepare([], tmp_path / "out")


def test_inspect_dataset_reads_metadata(tmp_path):
    write_inputs(tmp_path / "in")
    stats = prepare([tmp_path / "in"], tmp_path / "out", max_seq_len=64, rows_per_shard=4)
    info = inspect_dataset(str(tmp_path / "out"))
    assert info.rows == stats["rows"]
    assert info.max_length == 64
    assert info.files == sorted(info.files) and len(info.files) == stats["shards"]
    assert info.path == str(tmp_path / "out")
    assert inspect_dataset(f"file://{tmp_path / 'out'}").rows == stats["rows"]
    assert (info.vocab_size, info.eos_id, info.pad_id, info.tokenizer_kind) == (256, None, None,
                                                                               "bytes")
    assert info.max_token_id == stats["max_token_id"] and info.tokenizer_path is None
    assert info.columns == ("id", "tokens", "length", "source", "offset", "doc")
    assert isinstance(load_dataset_tokenizer(info), ByteTokenizer)


def test_inspect_dataset_without_statistics_reads_length(tmp_path):
    (tmp_path / "ds").mkdir()
    lengths = pa.array([3, 1], pa.int32())
    table = pa.table({"id": [0, 1], "tokens": [[1, 2, 3], [4]], "length": lengths})
    pq.write_table(table, tmp_path / "ds" / "a.parquet", write_statistics=False)
    info = inspect_dataset(str(tmp_path / "ds"))
    assert (info.rows, info.max_length) == (2, 3)
    # Made by another tool: no _prepare.json, so nothing is known of its tokenizer.
    assert (info.vocab_size, info.max_token_id, info.eos_id, info.pad_id) == (None,) * 4
    assert (info.tokenizer_kind, info.tokenizer_path) == (None, None)
    assert info.columns == ("id", "tokens", "length")
    assert isinstance(load_dataset_tokenizer(info), ByteTokenizer)


def test_inspect_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        inspect_dataset(str(tmp_path / "nope"))
    (tmp_path / "blank").mkdir()
    with pytest.raises(ValueError, match="no .parquet files"):
        inspect_dataset(str(tmp_path / "blank"))
    (tmp_path / "cols").mkdir()
    pq.write_table(pa.table({"id": [0], "text": ["a"]}), tmp_path / "cols" / "x.parquet")
    with pytest.raises(ValueError, match="missing required column.*tokens, length") as info:
        inspect_dataset(str(tmp_path / "cols"))
    assert "x.parquet" in str(info.value)
    (tmp_path / "kind").mkdir()
    bad_length = pa.table({"id": [0], "tokens": [[1]], "length": ["1"]})
    pq.write_table(bad_length, tmp_path / "kind" / "x.parquet")
    with pytest.raises(ValueError, match="'length' must be an integer"):
        inspect_dataset(str(tmp_path / "kind"))
    (tmp_path / "empty").mkdir()
    schema = pa.schema(
        [("id", pa.int64()), ("tokens", pa.list_(pa.int16())), ("length", pa.int32())])
    pq.write_table(schema.empty_table(), tmp_path / "empty" / "part-00000.parquet")
    with pytest.raises(ValueError, match="is empty") as info:
        inspect_dataset(str(tmp_path / "empty"))
    assert str(tmp_path / "empty") in str(info.value)


def padding_efficiency(lengths: np.ndarray, *, bucketing: bool, window: int = 2048) -> float:
    """Real tokens over padded tokens (rows x longest row) of the micro-batches that
    `bucket_window` makes from consecutive windows of `lengths`."""
    rng = np.random.default_rng(0)
    real = padded = 0
    for first in range(0, len(lengths), window):
        rows = lengths[first:first + window]
        for batch in bucket_window(rows, micro_batch_tokens=4096, rng=rng, bucketing=bucketing):
            real += int(rows[batch].sum())
            padded += len(batch) * int(rows[batch].max())
    return real / padded


def test_default_corpus_is_cached_long_tailed_and_quick(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_TRAIN_CACHE", str(tmp_path / "cache"))
    started = time.perf_counter()
    folder = default_corpus_dir(max_seq_len=256)
    assert time.perf_counter() - started < 20
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("stdlib-256-")
    assert folder.name.endswith(f"-v{prepare_module.CORPUS_FORMAT}")  # old caches not reused
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [folder.name]  # no leftovers
    stats = json.loads((folder / "_prepare.json").read_text())
    assert 1_000_000 < stats["tokens"] < 6_000_000 and stats["max_seq_len"] == 256
    info = inspect_dataset(str(folder))
    assert info.rows == stats["rows"] and info.max_length == 256
    lengths = read_all(folder).column("length").to_numpy()
    # Rows are functions, methods and classes, and paragraphs of long ones: lengths spread
    # from a few bytes up to max_seq_len, most rows well short of it.
    assert np.median(lengths) < 0.8 * 256 and lengths.mean() < 0.75 * 256
    assert 0.2 < np.mean(lengths == 256) < 0.5
    assert np.mean(lengths < 128) > 0.25 and lengths.min() < 16
    assert len(np.unique(lengths)) > 200
    # So random batches waste much of their padded size, and length bucketing almost none.
    assert padding_efficiency(lengths, bucketing=False) < 0.75
    assert padding_efficiency(lengths, bucketing=True) > 0.96
    started = time.perf_counter()
    assert default_corpus_dir(max_seq_len=256) == folder  # second call hits the cache
    assert time.perf_counter() - started < 0.5


def test_default_corpus_uses_the_winner_of_a_race(tmp_path, monkeypatch):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    final = tmp_path / f"stdlib-512-{version}-v{prepare_module.CORPUS_FORMAT}"

    def racing_prepare(inputs, output, **kwargs):
        stats = prepare(inputs[:3], output, **kwargs)
        prepare(inputs[:3], final, **kwargs)  # another process finishes first
        (final / "winner").touch()
        return stats

    monkeypatch.setattr(prepare_module, "prepare", racing_prepare)
    assert default_corpus_dir(max_seq_len=512, cache_root=tmp_path) == final
    assert (final / "winner").exists()
    assert [path.name for path in tmp_path.iterdir()] == [final.name]  # scratch removed


def test_default_corpus_refuses_an_unfinished_cache_folder(tmp_path, monkeypatch):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    final = tmp_path / f"stdlib-512-{version}-v{prepare_module.CORPUS_FORMAT}"
    final.mkdir()
    (final / "stray").touch()
    monkeypatch.setattr(prepare_module, "stdlib_source_files", lambda: stdlib_source_files()[:2])
    with pytest.raises(ValueError, match="could not create the default corpus") as info:
        default_corpus_dir(max_seq_len=512, cache_root=tmp_path)
    assert str(final) in str(info.value)
    assert [path.name for path in tmp_path.iterdir()] == [final.name]


def test_a_prepare_that_fails_while_writing_leaves_a_folder_that_is_refused(tmp_path,
                                                                          monkeypatch):
    """A prepare that stops between its first shard and `_prepare.json` leaves its marker: the
    folder is refused by name. A finished one leaves none, and its shards copied elsewhere
    without `_prepare.json` are a data set of their own."""
    files = stdlib_source_files()[:3]
    prepare(files, tmp_path / "whole", max_seq_len=256, rows_per_shard=8)
    assert not (tmp_path / "whole" / "_prepare.pending").exists()
    (tmp_path / "copy").mkdir()
    for shard in (tmp_path / "whole").glob("*.parquet"):
        shutil.copy(shard, tmp_path / "copy")
    assert inspect_dataset(str(tmp_path / "copy")).rows == inspect_dataset(
        str(tmp_path / "whole")).rows
    written = prepare_module._write_folder

    def killed_after_shards(*args, **kwargs):
        written(*args, **kwargs)
        raise KeyboardInterrupt  # the process stopped here

    monkeypatch.setattr(prepare_module, "_write_folder", killed_after_shards)
    with pytest.raises(KeyboardInterrupt):
        prepare(files, tmp_path / "half", max_seq_len=256, rows_per_shard=8)
    assert list((tmp_path / "half").glob("*.parquet"))
    with pytest.raises(ValueError, match="is an unfinished prepare output: it still holds "
                                         "_prepare.pending"):
        inspect_dataset(str(tmp_path / "half"))
    with pytest.raises(ValueError, match="_prepare.pending"):  # and a new prepare into it
        prepare(files, tmp_path / "half", max_seq_len=256)


# --- Tokenizers, JSONL and Parquet inputs -------------------------------------------------

EOS = "<|endoftext|>"  # id 0 of the bpe_tokenizer fixture
DOCS = ["def f(x):\n    return x + 1\n", "Unicode: h\u00e9llo w\u00f6rld \u2603, a long line. " * 8,
        "short"]


def token_streams(table: pa.Table) -> dict[str, list[int]]:
    """Each source's token stream: its rows ordered by `offset`, concatenated."""
    pieces = defaultdict(list)
    for row in table.select(["source", "offset", "tokens"]).to_pylist():
        pieces[row["source"]].append((row["offset"], row["tokens"]))
    streams = {}
    for source, rows in pieces.items():
        rows.sort()
        offsets = [offset for offset, _ in rows]
        assert offsets == list(np.cumsum([0] + [len(tokens) for _, tokens in rows[:-1]]))
        streams[source] = [token for _, tokens in rows for token in tokens]
    return streams


def split_at(ids: list[int], eos: int) -> list[list[int]]:
    """`ids` cut after each `eos`, which must end it."""
    assert ids[-1] == eos
    docs, start = [], 0
    for index, token in enumerate(ids):
        if token == eos:
            docs.append(ids[start:index])
            start = index + 1
    return docs


def write_jsonl(path: Path, records: list, blank_lines: bool = False) -> Path:
    lines = [json.dumps(record) for record in records]
    path.write_text("\n\n".join(lines) + "\n" if blank_lines else "\n".join(lines) + "\n")
    return path


def test_jsonl_through_the_cli_each_record_decodes_to_its_text_and_eos(
        tmp_path, capsys, bpe_tokenizer):
    records = [{"text": doc, "n": i} for i, doc in enumerate(DOCS)] + [{"text": ""}]
    jsonl = write_jsonl(tmp_path / "docs.jsonl", records, blank_lines=True)
    out = tmp_path / "out"
    argv = ["prepare", str(jsonl), "--output", str(out), "--max-seq-len", "16",
            "--tokenizer", bpe_tokenizer, "--eval-fraction", "0"]
    assert cli_main(argv) == 0
    stats = json.loads(capsys.readouterr().out)
    tokenizer = load_tokenizer(bpe_tokenizer)
    table = read_all(out)
    assert table.schema.field("tokens").type == pa.list_(pa.int16())
    lengths = table.column("length").to_numpy()
    assert lengths.max() == 16 and stats["rows"] == len(table) > len(DOCS)  # long docs cut
    stream = token_streams(table)[str(jsonl)]
    assert tokenizer.decode(stream) == "".join(doc + EOS for doc in DOCS)  # the empty one skipped
    assert [tokenizer.decode(doc) for doc in split_at(stream, 0)] == DOCS
    assert stats["tokens"] == len(stream) and stats["source_files"] == 1
    assert stats["tokenizer"] == {"kind": "hf", "vocab_size": 400, "eos_id": 0, "pad_id": 1}


def test_parquet_text_column_is_read_in_batches(tmp_path, monkeypatch, bpe_tokenizer):
    monkeypatch.setattr(sources, "PARQUET_BATCH_ROWS", 2)
    texts = [DOCS[i % 3] + f" #{i}" for i in range(7)]
    table = pa.table({"n": list(range(8)), "body": texts[:3] + [None] + texts[3:]})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=3)
    stats = prepare([tmp_path / "docs.parquet"], tmp_path / "out", max_seq_len=24,
                    tokenizer=bpe_tokenizer, text_field="body")
    tokenizer = load_tokenizer(bpe_tokenizer)
    stream = token_streams(read_all(tmp_path / "out"))[str(tmp_path / "docs.parquet")]
    assert [tokenizer.decode(doc) for doc in split_at(stream, 0)] == texts  # the null skipped
    assert stats["max_token_id"] == max(stream)


def test_jsonl_and_parquet_without_a_tokenizer_are_bytes(tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": doc} for doc in DOCS])
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "b.parquet")
    stats = prepare([jsonl, tmp_path / "b.parquet"], tmp_path / "out", max_seq_len=32)
    streams = token_streams(read_all(tmp_path / "out"))
    everything = "".join(DOCS).encode()
    assert {source: bytes(stream) for source, stream in streams.items()} == {
        str(jsonl): everything, str(tmp_path / "b.parquet"): everything}
    assert stats["tokenizer"] == BYTES_RECORD and stats["tokens"] == 2 * len(everything)


def test_folder_input_picks_up_text_jsonl_and_parquet_files(tmp_path):
    root = tmp_path / "in"
    files = write_inputs(root)
    write_jsonl(root / "pkg" / "records.jsonl", [{"text": "from jsonl"}])
    pq.write_table(pa.table({"text": ["from parquet"]}), root / "rows.parquet")
    (root / "notes.json").write_text('{"text": "not a .jsonl"}')
    (root / ".hidden").mkdir()
    write_jsonl(root / ".hidden" / "skipped.jsonl", [{"text": "hidden"}])
    stats = prepare([root], tmp_path / "out")
    streams = token_streams(read_all(tmp_path / "out"))
    assert bytes(streams[str(root / "pkg" / "records.jsonl")]) == b"from jsonl"
    assert bytes(streams[str(root / "rows.parquet")]) == b"from parquet"
    assert set(streams) == {str(path) for path in files} | {
        str(root / "pkg" / "records.jsonl"), str(root / "rows.parquet")}
    assert stats["source_files"] == 6  # and pkg/empty.txt


def test_text_files_with_a_tokenizer_keep_the_document_cuts(tmp_path, bpe_tokenizer):
    files = write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out", max_seq_len=12, tokenizer=bpe_tokenizer)
    tokenizer = load_tokenizer(bpe_tokenizer)
    streams = token_streams(read_all(tmp_path / "out"))
    for path in files:
        data = path.read_bytes()
        natural = split_document_spans(data, python=path.suffix == ".py", max_seq_len=10**9)
        expected = "".join(data[start:end].decode() + EOS for start, end in natural)
        assert tokenizer.decode(streams[str(path)]) == expected  # one EOS after each document
    rows = read_all(tmp_path / "out").column("tokens").to_pylist()
    texts = [tokenizer.decode(row) for row in rows]
    for start in ("@decorator\n", "class Second:\n", "async def third("):  # defs start rows
        assert any(text.startswith(start) for text in texts)


@pytest.mark.parametrize("max_seq_len", [8, 40, 64, 10_000])
@pytest.mark.parametrize("python", [True, False])
def test_tokenized_rows_of_bytes_without_eos_are_the_byte_spans(max_seq_len, python):
    body = "".join(f"    step_{i} = {i}\n\n" for i in range(10))
    data = (PY_SOURCE + TEXT + "def long():\n" + body).encode()

    def encode(text: bytes) -> np.ndarray:
        return np.frombuffer(text, dtype=np.uint8)

    rows = tokenized_file_rows(data, python=python, encode=encode, eos_id=None,
                               max_seq_len=max_seq_len)
    spans = split_document_spans(data, python=python, max_seq_len=max_seq_len)
    assert [bytes(row) for row in rows] == [data[start:end] for start, end in spans]


def test_tokens_are_int32_only_for_a_vocabulary_beyond_int16(tmp_path, bpe_tokenizer):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(40_000)} | {"[UNK]": 40_000, "</s>": 40_001}
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"text": "w1 w39999 w7"}, {"text": "w32768"}])
    stats = prepare([jsonl], tmp_path / "big", tokenizer=str(tmp_path / "big.json"))
    table = read_all(tmp_path / "big")
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert token_streams(table)[str(jsonl)] == [1, 39999, 7, 40_001, 32768, 40_001]
    assert stats["token_type"] == "int32" and stats["max_token_id"] == 40_001
    assert stats["tokenizer"] == {"kind": "hf", "vocab_size": 40_002, "eos_id": 40_001,
                                  "pad_id": None}
    small = prepare([jsonl], tmp_path / "small", tokenizer=bpe_tokenizer)
    assert read_all(tmp_path / "small").schema.field("tokens").type == pa.list_(pa.int16())
    assert small["token_type"] == "int16"


def test_prepare_json_and_inspect_dataset_record_the_tokenizer(tmp_path, bpe_tokenizer):
    write_inputs(tmp_path / "in")
    stats = prepare([tmp_path / "in"], tmp_path / "out", max_seq_len=32, tokenizer=bpe_tokenizer)
    out = tmp_path / "out"
    assert json.loads((out / "_prepare.json").read_text()) == stats
    tokens = read_all(out).column("tokens").combine_chunks().values.to_numpy()
    assert stats["max_token_id"] == tokens.max()
    assert stats["tokenizer"] == {"kind": "hf", "vocab_size": 400, "eos_id": 0, "pad_id": 1}
    for path in (str(out), f"file://{out}"):
        info = inspect_dataset(path)
        assert (info.vocab_size, info.max_token_id, info.eos_id, info.pad_id) == (
            400, stats["max_token_id"], 0, 1)
        assert (info.tokenizer_kind, info.tokenizer_path) == ("hf", str(out / "tokenizer"))
        assert info.columns == ("id", "tokens", "length", "source", "offset", "doc")
    text = "def g(y):\n    return y * 2\n"
    expected = load_tokenizer(bpe_tokenizer).encode(text)
    assert load_dataset_tokenizer(info).encode(text) == expected
    # Not on the local filesystem: the copy is fetched into a temporary folder first.
    remote = replace(info, filesystem=pafs.SubTreeFileSystem("/", pafs.LocalFileSystem()))
    assert load_dataset_tokenizer(remote).encode(text) == expected


def test_inspect_dataset_refuses_a_corrupt_prepare_json(tmp_path):
    write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out")
    stats_file = tmp_path / "out" / "_prepare.json"
    stats = json.loads(stats_file.read_text())
    for key in ("tokenizer", "max_token_id", "token_type"):
        del stats[key]  # as written before tokenizers: the tokens were bytes
    stats_file.write_text(json.dumps(stats))
    info = inspect_dataset(str(tmp_path / "out"))
    assert (info.vocab_size, info.tokenizer_kind) == (256, "bytes")
    largest = max(max(row) for row in read_all(tmp_path / "out").column("tokens").to_pylist())
    assert info.max_token_id == largest  # not recorded: from the Parquet statistics of `tokens`
    for corrupt in ["{not json", "[1, 2]", json.dumps({"tokenizer": {"kind": "hf",
                                                                     "vocab_size": "many"}})]:
        stats_file.write_text(corrupt)
        with pytest.raises(ValueError, match="is corrupt") as info:
            inspect_dataset(str(tmp_path / "out"))
        assert str(stats_file) in str(info.value)


def test_load_dataset_tokenizer_refuses_a_missing_copy(tmp_path, bpe_tokenizer):
    write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "out", tokenizer=bpe_tokenizer)
    shutil.rmtree(tmp_path / "out" / "tokenizer")
    with pytest.raises(ValueError, match="hf tokenizer, but its copy 'tokenizer/' is missing"):
        load_dataset_tokenizer(inspect_dataset(str(tmp_path / "out")))


def bad_input(case: str, root: Path) -> tuple[list[str], list[str]]:
    """The `prepare` arguments of one bad input, and what its error message must name."""
    good = write_jsonl(root / "good.jsonl", [{"text": "fine"}])
    if case == "tokenizer missing":
        return [str(good), "--tokenizer", str(root / "nope")], [f"--tokenizer '{root / 'nope'}'",
                                                                 "does not load"]
    if case == "tokenizer corrupt":
        (root / "bad.json").write_text('{"model": 1}')
        return [str(good), "--tokenizer", str(root / "bad.json")], [
            f"--tokenizer '{root / 'bad.json'}' does not load: "]
    if case == "tokenizer folder of nothing":
        (root / "empty").mkdir()
        return [str(good), "--tokenizer", str(root / "empty")], [
            f"--tokenizer '{root / 'empty'}' does not load: "]
    if case == "jsonl field missing":
        file = write_jsonl(root / "a.jsonl", [{"text": "ok"}, {"body": "x", "n": 1}])
        return [str(file)], [f"'{file}' line 2 has no field 'text'", "it has: body, n"]
    if case == "jsonl not json":
        file = root / "a.jsonl"
        file.write_text('{"text": "ok"}\n\n{"text": oops}\n')
        return [str(file)], [f"'{file}' line 3 is not valid JSON"]
    if case == "jsonl not an object":
        file = write_jsonl(root / "a.jsonl", [["text"]])
        return [str(file)], [f"'{file}' line 1 is not a JSON object"]
    if case == "jsonl text not a string":
        file = write_jsonl(root / "a.jsonl", [{"text": 3}])
        return [str(file)], [f"'{file}' line 1: field 'text' is not a string"]
    if case == "parquet column missing":
        pq.write_table(pa.table({"body": ["x"], "n": [1]}), root / "a.parquet")
        return [str(root / "a.parquet")], [f"'{root / 'a.parquet'}' has no column 'text'",
                                           "it has: body, n"]
    if case == "empty path":
        return [""], ["input '' is an empty path"]
    # Binary files are skipped with a warning that counts them (tests/test_bad_input.py); only
    # binary files: no text at all.
    if case == "png":
        (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
        return [str(root / "image.png")], [f"no input text found in '{root / 'image.png'}' "
                                           "(skipped 1 binary file(s), not text: "
                                           f"'{root / 'image.png'}' (it holds NUL bytes)"]
    if case == "latin-1 text":  # not UTF-8: what to do about it
        (root / "old.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
        return [str(root / "old.txt")], [f"'{root / 'old.txt'}' (it is not UTF-8 text (byte 3))",
                                         "iconv -f latin1 -t utf-8"]
    assert case == "shared library"
    (root / "lib.so").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(range(256)))
    return [str(root / "lib.so")], [f"no input text found in '{root / 'lib.so'}' "
                                    "(skipped 1 binary file(s), not text: "]


@pytest.mark.parametrize("case", [
    "tokenizer missing", "tokenizer corrupt", "tokenizer folder of nothing",
    "jsonl field missing", "jsonl not json", "jsonl not an object", "jsonl text not a string",
    "parquet column missing", "empty path", "png", "latin-1 text", "shared library"])
def test_bad_input_gives_one_clear_error_naming_the_culprit(case, tmp_path, capsys,
                                                           bpe_tokenizer):
    (tmp_path / "in").mkdir()
    inputs, named = bad_input(case, tmp_path / "in")
    out = tmp_path / "out"
    assert cli_main(["prepare", *inputs, "--output", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: ")
    for part in named:
        assert part in captured.err
    assert not out.exists()


def no_ray(num_cpus):
    raise AssertionError("Ray was started")


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("leftover", ["eval", "tokenizer", "_prepare.json"])
def test_an_output_holding_an_earlier_prepares_files_is_refused_by_name(leftover, tmp_path,
                                                                        bpe_tokenizer, monkeypatch):
    """An earlier prepare's folder whose top-level shards were removed: its `eval/` (another
    corpus's held-out rows), `tokenizer/` or `_prepare.json` would be read with the new shards.
    Refused naming what was found and how to go on; nothing there is changed."""
    from elastic_train.cluster import prepare_ray as prepare_ray_module

    monkeypatch.setattr(prepare_ray_module, "_ray_cluster", no_ray)
    write_inputs(tmp_path / "in")
    out = tmp_path / "out"
    prepare([tmp_path / "in"], out, max_seq_len=32, eval_fraction=0.3, tokenizer=bpe_tokenizer)
    for path in out.glob("*.parquet"):
        path.unlink()
    for name in {"eval", "tokenizer", "_prepare.json"} - {leftover}:
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    before = snapshot(out)
    for run in (prepare, prepare_ray_module.prepare_ray):  # refused before Ray starts
        with pytest.raises(ValueError, match="earlier prepare") as info:
            run([tmp_path / "in"], out, max_seq_len=32)
        message = str(info.value)
        assert str(out) in message and leftover in message and "another --output" in message
    assert snapshot(out) == before


@pytest.mark.parametrize("case", ["same", "output inside input", "input inside output"])
def test_an_output_that_is_or_nests_an_input_is_refused_naming_both(case, tmp_path, monkeypatch):
    """The shards would land among the inputs (or the inputs among the shards), and a later
    prepare of that folder would read them as its input. Refused before anything is written."""
    from elastic_train.cluster import prepare_ray as prepare_ray_module

    monkeypatch.setattr(prepare_ray_module, "_ray_cluster", no_ray)
    corpus = tmp_path / "corpus"
    write_inputs(corpus)
    inputs, out = {"same": ([corpus], corpus),
                   "output inside input": ([corpus], corpus / "prepared"),
                   "input inside output": ([corpus / "pkg"], corpus)}[case]
    before = snapshot(corpus)
    for run in (prepare, prepare_ray_module.prepare_ray):
        with pytest.raises(ValueError, match="--output") as info:
            run(inputs, out, max_seq_len=32)
        assert f"'{out}'" in str(info.value) and f"'{inputs[0]}'" in str(info.value)
    assert snapshot(corpus) == before and not (corpus / "prepared").exists()


def test_a_folder_of_shards_and_text_files_is_ambiguous(tmp_path):
    """Prepared shards beside new text files: neither re-chunking (which would skip the text)
    nor tokenizing (which would read the shards as records) is meant; refused naming both."""
    write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "data", max_seq_len=32)
    (tmp_path / "data" / "more.txt").write_text("new text the user added\n")
    with pytest.raises(ValueError, match="both") as info:
        prepare([tmp_path / "data"], tmp_path / "v2", max_seq_len=32)
    assert f"'{tmp_path / 'data'}'" in str(info.value) and "more.txt" in str(info.value)
    assert not (tmp_path / "v2").exists()


@pytest.mark.parametrize("option", ["tokenizer", "seed", "max_seq_len", "eval_fraction"])
def test_re_chunking_refuses_the_options_it_does_not_honour(option, tmp_path, bpe_tokenizer):
    """Re-chunking keeps the rows, ids, tokens and held-out split as they are: a tokenizer, a
    seed, a max_seq_len shorter than the rows or another held-out fraction would be silently
    ignored, so each is refused by name; rows_per_block, what it does, goes through."""
    write_inputs(tmp_path / "in")
    prepare([tmp_path / "in"], tmp_path / "data", max_seq_len=64, eval_fraction=0.3)
    given = {"tokenizer": bpe_tokenizer, "seed": 3, "max_seq_len": 16,
             "eval_fraction": 0.1}[option]
    with pytest.raises(ValueError, match="re-chunk") as info:
        prepare([tmp_path / "data"], tmp_path / "re", rows_per_block=3, **{option: given})
    assert f"--{option.replace('_', '-')}" in str(info.value)
    assert not (tmp_path / "re").exists()
    stats = prepare([tmp_path / "data"], tmp_path / "re", rows_per_block=3, max_seq_len=64,
                    eval_fraction=0.3)
    assert stats["rows_per_block"] == 3 and stats["rechunked_from"] == str(tmp_path / "data")


def test_the_command_line_re_chunks_with_only_the_options_typed(tmp_path, monkeypatch, capsys):
    """The command line's defaults for text (--max-seq-len 512, --eval-fraction 0.03) are not
    given to a re-chunk: a data set of 600-token rows with a 0.2 split re-chunks as typed, in the
    local engine even where auto would choose Ray; an option typed that it cannot honour (a
    split for a data set without one) is refused."""
    (tmp_path / "in").mkdir()
    for i in range(12):
        (tmp_path / "in" / f"doc{i}.txt").write_text(f"document {i} " * 120)  # > 1000 bytes
    prepare([tmp_path / "in"], tmp_path / "long", max_seq_len=600, eval_fraction=0.2)
    assert inspect_dataset(str(tmp_path / "long")).max_length > 512
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # auto would pick Ray: none listens there
    assert cli_main(["prepare", str(tmp_path / "long"), "--output", str(tmp_path / "re"),
                     "--rows-per-block", "2"]) == 0
    stats = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert stats["rows_per_block"] == 2 and stats["eval"]["fraction"] == 0.2
    assert stats["max_seq_len"] == 600
    prepare([tmp_path / "in"], tmp_path / "whole", max_seq_len=600)
    assert cli_main(["prepare", str(tmp_path / "whole"), "--output", str(tmp_path / "re2"),
                     "--eval-fraction", "0.1"]) == 2
    assert "--eval-fraction 0.1 (it has no held-out split, and none is made)" in (
        capsys.readouterr().err)
    assert not (tmp_path / "re2").exists()


def test_the_local_engine_prepares_into_an_s3_store_as_into_a_folder(tmp_path, monkeypatch, capsys):
    """`prepare --output s3://...` on the local engine (auto's choice for a small corpus): the
    same shards, held-out set and `_prepare.json` as a local prepare, uploaded under the pending
    marker with `_prepare.json` last; a second prepare there is refused, as in a folder. Before,
    the URI was taken for a local path ('s3:/...': pyarrow's "Expected a local filesystem path,
    got a URI"). An input URI is one line saying prepare reads local files, and nothing is
    written to the current folder."""
    from s3store import s3_server

    monkeypatch.chdir(tmp_path)
    inputs = write_inputs(tmp_path / "in")
    local = prepare(inputs, tmp_path / "local", rows_per_block=2, eval_fraction=0.3)
    with s3_server(tmp_path / "s3.log") as s3:
        stats = prepare(inputs, s3("data/p"), rows_per_block=2, eval_fraction=0.3)
        assert stats == local and stats["eval"]["rows"] > 0
        stored = inspect_dataset(s3("data/p"))
        assert stored.eval_split["rows"] == local["eval"]["rows"] and stored.rows == local["rows"]
        names = sorted(i.path.split("data/p/", 1)[1] for i in s3.fs.get_file_info(
            pafs.FileSelector("bucket/data/p", recursive=True)) if i.type == pafs.FileType.File)
        assert names == sorted(p.relative_to(tmp_path / "local").as_posix()
                               for p in (tmp_path / "local").rglob("*") if p.is_file())
        for name in names:
            with s3.fs.open_input_stream(f"bucket/data/p/{name}") as f:
                assert f.read() == (tmp_path / "local" / name).read_bytes(), name
        with pytest.raises(ValueError, match="already contains Parquet files"):
            prepare(inputs, s3("data/p"))
        capsys.readouterr()
        assert cli_main(["prepare", s3("data/p"), "--output", str(tmp_path / "re")]) == 2
        assert capsys.readouterr().err == (f"error: input '{s3('data/p', '***')}': prepare reads local "
                                           "files and folders; copy it to one first (the output "
                                           "may be a URI)\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "local", "s3.log"]
