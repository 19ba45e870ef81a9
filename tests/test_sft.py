"""Fine-tuning data (issue 30): prompt/response and chat records become rows with a `loss_mask`,
the same from both prepare engines; the default loss counts exactly the answer tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elastic_train.cli import main as cli_main
from elastic_train.data.batches import IGNORE_INDEX, MicroBatch
from elastic_train.data.prepare import prepare
from elastic_train.data.tokenizer import load_tokenizer
from elastic_train.training.losses import causal_lm_loss

EOS = "<|endoftext|>"  # id 0 of the bpe_tokenizer fixture
# Each assistant message ends with the EOS; the generation prompt is the assistant header.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                 "{% if m.role == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PAIRS = [("Question: what is two plus two?\nAnswer:", " four"),
         ("Translate 'chat' to English:", " cat, a small animal that purrs"),
         ("Say nothing.", " ok")]


def rows_of(folder: Path) -> list[dict]:
    """Every row of a prepared folder, in id order."""
    tables = [pq.read_table(path) for path in sorted(folder.glob("*.parquet"))]
    return sorted(pa.concat_tables(tables).to_pylist(), key=lambda row: row["id"])


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


@pytest.fixture
def chat_tokenizer(bpe_tokenizer, tmp_path) -> Path:
    """The BPE tokenizer in a folder whose tokenizer_config.json has `CHAT_TEMPLATE`."""
    folder = tmp_path / "chat_tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(bpe_tokenizer).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.mark.unit
def test_prompt_response_rows_mask_exactly_the_response_and_its_eos(tmp_path, bpe_tokenizer):
    """JSONL prompt/response records (with custom field names) and a Parquet file of them: one
    row per example, tokens = prompt's + response's + EOS, loss_mask 0 on the prompt, 1 on the
    response and the EOS; a plain-text record beside them is all targets."""
    tok = load_tokenizer(bpe_tokenizer)
    write_jsonl(tmp_path / "a.jsonl", [{"q": p, "a": r} for p, r in PAIRS] + [{"text": "plain"}])
    pq.write_table(pa.table({"q": [p for p, _ in PAIRS], "a": [r for _, r in PAIRS]}),
                   tmp_path / "b.parquet")
    stats = prepare([tmp_path / "a.jsonl", tmp_path / "b.parquet"], tmp_path / "out",
                    tokenizer=bpe_tokenizer, max_seq_len=64, prompt_field="q",
                    response_field="a")
    assert stats["sft"]["examples"] == 6 and stats["sft"]["dropped"] == 0
    expected = {}
    for prompt, response in PAIRS:
        p, r = tok.encode(prompt), tok.encode(response)
        expected[tuple(p + r + [0])] = [0] * len(p) + [1] * (len(r) + 1)
    expected[tuple(tok.encode("plain") + [0])] = [1] * (len(tok.encode("plain")) + 1)
    rows = rows_of(tmp_path / "out")
    assert len(rows) == 7
    for row in rows:
        assert row["loss_mask"] == expected[tuple(row["tokens"])]
        assert len(row["loss_mask"]) == row["length"]
    assert pq.read_schema(next((tmp_path / "out").glob("*.parquet"))).field(
        "loss_mask").type == pa.list_(pa.int8())


@pytest.mark.unit
def test_chat_messages_are_rendered_with_the_template_and_only_answers_are_targets(
        tmp_path, chat_tokenizer):
    """A two-turn conversation: the row decodes to the template's rendering; the tokens masked
    1 decode to the two answers, each with its EOS; the rest to the system/user turns and the
    assistant headers. The tokenizer copy keeps the template."""
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And of Italy?"},
                {"role": "assistant", "content": "Rome."}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    prepare([tmp_path / "chat.jsonl"], tmp_path / "out", tokenizer=chat_tokenizer,
            max_seq_len=128)
    (row,) = rows_of(tmp_path / "out")
    tok = load_tokenizer(tmp_path / "out" / "tokenizer")
    tokens, mask = np.array(row["tokens"]), np.array(row["loss_mask"], dtype=bool)
    assert tok.decode(tokens) == (
        "<|system|>Be brief.\n<|user|>Capital of France?\n<|assistant|>Paris." + EOS
        + "<|user|>And of Italy?\n<|assistant|>Rome." + EOS)
    assert tok.decode(tokens[mask]) == "Paris." + EOS + "Rome." + EOS
    assert tok.decode(tokens[~mask]) == ("<|system|>Be brief.\n<|user|>Capital of France?\n"
                                         "<|assistant|><|user|>And of Italy?\n<|assistant|>")
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.unit
def test_chat_without_a_template_is_refused_by_name(tmp_path, bpe_tokenizer, capsys):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    status = cli_main(["prepare", str(tmp_path / "chat.jsonl"), "--output", str(tmp_path / "o"),
                       "--tokenizer", bpe_tokenizer, "--engine", "local"])
    err = capsys.readouterr().err
    assert status != 0 and "no chat template" in err and "--tokenizer" in err
    assert not list((tmp_path / "o").glob("*.parquet"))


@pytest.mark.unit
def test_long_examples_are_truncated_or_dropped_by_the_rule_and_counted(tmp_path):
    """Bytes, rows of 16: a long answer is cut at 16 tokens (its prompt kept whole); a prompt
    that fills the row is dropped, as is an example with an empty response; never a row that
    starts mid-answer. The documents are numbered without the dropped ones."""
    write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "Q:", "response": "A" * 40},  # truncated
        {"prompt": "P" * 20, "response": "x"},  # dropped: the prompt fills the row
        {"prompt": "Q?", "response": ""},  # dropped: no answer
        {"prompt": "Hi", "response": "yo"}])
    stats = prepare([tmp_path / "a.jsonl"], tmp_path / "out", max_seq_len=16)
    assert {k: stats["sft"][k] for k in ("examples", "truncated", "dropped")} == {
        "examples": 4, "truncated": 1, "dropped": 2}
    assert "dropped" in stats["sft"]["rule"]
    rows = {bytes(row["tokens"]): (row["loss_mask"], row["doc"]) for row in rows_of(tmp_path / "out")}
    assert rows == {b"Q:" + b"A" * 14: ([0, 0] + [1] * 14, 0), b"Hiyo": ([0, 0, 1, 1], 1)}


@pytest.mark.unit
def test_the_loss_counts_exactly_the_answer_tokens():
    """A batch of two padded rows with a hand-written mask: the loss sum is the cross entropy of
    the masked next-token targets only, the count is theirs, and `MicroBatch.targets` (the
    loop's global count) agrees; the user's loss_fn sees the mask in the batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    tokens = np.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]], dtype=np.int64)
    mask = np.array([[0, 0, 1, 1, 0, 1], [0, 1, 1, 0, 0, 0]], dtype=np.int8)
    mb = MicroBatch(0, np.array([0, 1]), tokens, np.array([6, 3]), {"loss_mask": mask})
    batch = mb.to_batch(torch.device("cpu"))
    loss_sum, count = causal_lm_loss(model, batch)
    # Hand-computed targets (row, position of the predicting token j, target token j + 1).
    picked = [(0, 1, 5), (0, 2, 6), (0, 4, 8), (1, 0, 10), (1, 1, 11)]
    logits = model(torch.from_numpy(tokens))
    expected = sum(F.cross_entropy(logits[r, j][None], torch.tensor([t]), reduction="sum")
                   for r, j, t in picked)
    assert count == len(picked) == mb.targets
    torch.testing.assert_close(loss_sum, expected)
    assert torch.equal(batch["loss_mask"], torch.from_numpy(mask))
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == int(mask.sum())
    plain = MicroBatch(0, np.array([0, 1]), tokens, np.array([6, 3]))
    assert causal_lm_loss(model, plain.to_batch(torch.device("cpu")))[1] == plain.targets == 7


@pytest.mark.ray
def test_both_engines_write_the_same_fine_tuning_shards(ray_cluster, tmp_path, chat_tokenizer,
                                                        monkeypatch):
    """Prompt/response JSONL (some truncated, some dropped), chat Parquet and a plain-text file,
    a held-out split, the JSONL and Parquet cut into many pieces: the Ray Data engine writes the
    shards (loss_mask included) and `_prepare.json` (sft counts included) of the local one."""
    from elastic_train.cluster import prepare_ray as prepare_ray_module
    from elastic_train.cluster.prepare_ray import prepare_ray

    records = [{"prompt": f"Q{i}: " + "why " * (i % 5 if i % 10 else 40),
                "response": " because" * (i % 9)} for i in range(60)]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "pairs.jsonl", records)
    chats = [[{"role": "user", "content": f"n{i}?"}, {"role": "assistant", "content": "y" * i}]
             for i in range(40)]
    pq.write_table(pa.table({"messages": chats}), tmp_path / "in" / "chat.parquet",
                   row_group_size=4)
    (tmp_path / "in" / "notes.txt").write_text("plain text\n\nanother paragraph\n")
    args = {"max_seq_len": 24, "rows_per_shard": 30, "rows_per_block": 8, "seed": 5,
            "eval_fraction": 0.2, "tokenizer": chat_tokenizer}
    local = prepare([tmp_path / "in"], tmp_path / "local", **args)
    monkeypatch.setattr(prepare_ray_module, "PIECE_BYTES", 300)
    pieces = prepare_ray_module._list_pieces(sorted((tmp_path / "in").iterdir()))
    assert {"jsonl", "parquet"} <= {piece["kind"] for piece in pieces} and len(pieces) > 6
    ray_stats = prepare_ray([tmp_path / "in"], tmp_path / "ray", progress=False, **args)
    assert ray_stats == {**local, "engine": "ray"}
    assert local["sft"]["truncated"] > 0 and local["sft"]["dropped"] > 0
    assert local["sft"]["examples"] == 100
    for side in ("", "eval"):
        names = sorted(path.name for path in (tmp_path / "local" / side).glob("*.parquet"))
        assert names and names == sorted(
            path.name for path in (tmp_path / "ray" / side).glob("*.parquet"))
        for name in names:
            left = pq.read_table(tmp_path / "local" / side / name)
            right = pq.read_table(tmp_path / "ray" / side / name)
            assert left.equals(right) and "loss_mask" in left.column_names, name


@pytest.mark.unit
@pytest.mark.parametrize("null", ["prompt", "response"])
def test_a_null_prompt_or_response_is_refused_by_record_and_field(tmp_path, capsys, null):
    """One `{"prompt": null, ...}` among good records: exit 2, one error line naming the
    file's line and the field, nothing written (not a row whose every token is a target)."""
    records = [{"prompt": "Q:", "response": "yes"}] * 3
    records.insert(1, {"prompt": "Q:", "response": "no", null: None})
    write_jsonl(tmp_path / "a.jsonl", records)
    status = cli_main(["prepare", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"),
                       "--engine", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error:")
    assert "line 2" in err[0] and f"field '{null}' is null" in err[0]
    assert not (tmp_path / "o").exists() or not list((tmp_path / "o").rglob("*.parquet"))


@pytest.mark.unit
def test_prepare_says_why_it_dropped_every_example(tmp_path, capsys):
    """All examples dropped (empty answers, prompts longer than --max-seq-len, a chat with no
    assistant turn): the error counts each reason instead of 'no input text found'."""
    write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "Q?", "response": ""}, {"prompt": "P" * 40, "response": "x"},
        {"prompt": "P" * 50, "response": "y"}])
    status = cli_main(["prepare", str(tmp_path / "a.jsonl"), "--output", str(tmp_path / "o"),
                       "--max-seq-len", "16", "--engine", "local"])
    err = capsys.readouterr().err
    assert status == 2 and "no input text" not in err
    assert "every one of the 3 fine-tuning example(s) was dropped" in err
    assert "1 had no answer" in err and "2 had a prompt that fills --max-seq-len 16" in err


@pytest.mark.unit
def test_the_ray_engine_stages_carry_the_reasons_for_dropping(tmp_path):
    """The Ray prepare's tokenize and summary stages (plain pyarrow, run here without Ray) carry
    the drop reasons the driver's error counts."""
    import pickle

    from elastic_train.data.pieces import summarize_pieces, tokenize_pieces
    from elastic_train.data.sft import RecordFields, SftCounts

    path = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Q?", "response": ""},
                                              {"prompt": "P" * 40, "response": "x"}])
    group = json.dumps([{"piece": 0, "kind": "file", "path": str(path)}])
    table = tokenize_pieces(pa.table({"pieces": [group]}), tokenizer_blob=pickle.dumps(
        load_tokenizer(None)), max_seq_len=16, text_field=RecordFields(), token_type="int16")
    record = summarize_pieces(table).to_pylist()[0]
    counts = SftCounts(*(record[k] for k in ("examples", "truncated", "dropped", "no_answer",
                                             "long_prompt")))
    assert (counts.examples, counts.dropped, counts.no_answer, counts.long_prompt) == (2, 2, 1, 1)


@pytest.mark.unit
def test_plain_text_rows_beside_examples_in_one_file_are_all_kept(tmp_path, chat_tokenizer):
    """A Parquet file (or JSONL lines) of one union schema: plain-text rows have null prompt and
    response (or a null messages list), example rows a null text. Every record gives its row:
    the plain texts all targets, the examples masked (none silently dropped)."""
    texts = ["plain document one " * 3, "plain document two " * 3]
    pq.write_table(pa.table({"text": [*texts, None], "prompt": [None, None, "Q?"],
                             "response": [None, None, " yes"]}), tmp_path / "pairs.parquet")
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    pq.write_table(pa.table({"text": pa.array([*texts, None]),
                             "messages": pa.array([None, None, chat], pa.list_(message))}),
                   tmp_path / "chat.parquet")
    write_jsonl(tmp_path / "mixed.jsonl", [{"text": texts[0], "prompt": None, "response": None},
                                           {"text": None, "prompt": "Q?", "response": " yes"},
                                           {"text": texts[1], "messages": None}])
    tok = load_tokenizer(chat_tokenizer)
    for name in ("pairs.parquet", "chat.parquet", "mixed.jsonl"):
        stats = prepare([tmp_path / name], tmp_path / f"out-{name}", tokenizer=chat_tokenizer,
                        max_seq_len=64, eval_fraction=0.0)
        rows = rows_of(tmp_path / f"out-{name}")
        assert stats["rows"] == len(rows) == 3 and stats["sft"]["examples"] == 1, name
        plain = sorted(tok.decode(row["tokens"]) for row in rows if all(row["loss_mask"]))
        assert plain == sorted(text + EOS for text in texts), name


def write_chat_tokenizer(folder: Path, bpe_tokenizer: str, template: str) -> Path:
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(bpe_tokenizer).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": EOS, "pad_token": "<pad>", "chat_template": template}))
    return folder


STRICT_TEMPLATE = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
                   "{{ raise_exception('Unknown role ' + m.role) }}{% endif %}"
                   "<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_conversation_the_template_refuses_is_named_by_file_and_line(tmp_path, bpe_tokenizer,
                                                                       capsys, kind):
    """The template raises on a 'tool' turn in the third record: one error line naming the file
    and the record's line (JSONL) or row (Parquet), nothing written."""
    tok = write_chat_tokenizer(tmp_path / "tok", bpe_tokenizer, STRICT_TEMPLATE)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    bad = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"},
           {"role": "assistant", "content": "ok"}]
    chats = [good, good, bad, good]
    if kind == "jsonl":
        path, where = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in chats]), "line 3"
    else:
        path, where = tmp_path / "chat.parquet", "row 2"
        pq.write_table(pa.table({"messages": chats}), path, row_group_size=2)
    status = cli_main(["prepare", str(path), "--output", str(tmp_path / "o"), "--tokenizer",
                       str(tok), "--engine", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: ")
    assert f"'{path}' {where}" in err[0] and "Unknown role tool" in err[0]
    assert not (tmp_path / "o").exists()
    # The Ray engine's driver finds the same message when a task fails on the file.
    from elastic_train.cluster.prepare_ray import _local_error
    from elastic_train.data.sft import RecordFields

    found = _local_error(path, load_tokenizer(tok), 512, RecordFields())
    assert found is not None and f"error: {found}" == err[0]


@pytest.mark.unit
def test_a_chat_template_that_does_not_compile_is_one_error_line(tmp_path, bpe_tokenizer,
                                                                 capsys):
    """A jinja2 syntax error in the template (TemplateSyntaxError, not a ValueError): one error
    line naming the template's tokenizer and the first record that needed it, not a traceback."""
    tok = write_chat_tokenizer(tmp_path / "tok", bpe_tokenizer, "{% for m in messages %}oops")
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"prompt": "Q?", "response": " yes"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    status = cli_main(["prepare", str(path), "--output", str(tmp_path / "o"), "--tokenizer",
                       str(tok), "--engine", "local"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert f"'{path}' line 2" in err[0] and "chat template" in err[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.unit
def test_a_template_gets_the_tokenizers_special_tokens_as_transformers_gives_them(
        tmp_path, bpe_tokenizer):
    """A template that writes `{{ bos_token }}` (Llama 3's does): the row is the rendering that
    transformers' apply_chat_template makes with the same tokenizer folder, BOS included."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(Path(bpe_tokenizer).read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<pad>", "eos_token": EOS, "pad_token": "<pad>",
         "tokenizer_class": "PreTrainedTokenizerFast",
         "chat_template": "{{ bos_token }}" + CHAT_TEMPLATE}))
    messages = [{"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    prepare([tmp_path / "chat.jsonl"], tmp_path / "out", tokenizer=folder, max_seq_len=128)
    (row,) = rows_of(tmp_path / "out")
    reference = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    rendered = reference.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith("<pad><|user|>")
    assert load_tokenizer(folder).decode(row["tokens"]) == rendered
    assert row["tokens"][0] == 1 and row["loss_mask"][0] == 0  # "<pad>", id 1, no target


@pytest.fixture(scope="module")
def bos_tokenizer(bpe_tokenizer, tmp_path_factory) -> str:
    """The BPE tokenizer with a Llama-style post-processor: `<s>` before every text."""
    from tokenizers import Tokenizer, processors

    backend = Tokenizer.from_file(bpe_tokenizer)
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))])
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    backend.save(str(path))
    return str(path)


@pytest.mark.unit
def test_documents_prompts_and_examples_begin_with_the_bos_the_tokenizer_adds(
        bos_tokenizer, bpe_tokenizer, tmp_path):
    """A tokenizer whose post-processor puts a BOS before every text (Llama, Gemma) gives each
    document, text record and prompt/response example that BOS first, as transformers'
    tokenizer(text) does and the pretrained model saw; one without (GPT-2, most trained here)
    gives none. Sampling puts it before the prompt; `_prepare.json` records it."""
    from transformers import PreTrainedTokenizerFast

    from elastic_train.config import load_config
    from elastic_train.export import TrainedModel, generate

    tok = load_tokenizer(bos_tokenizer)
    assert tok.bos_id == tok.backend.token_to_id("<s>") and load_tokenizer(bpe_tokenizer).bos_id is None
    reference = PreTrainedTokenizerFast(tokenizer_file=bos_tokenizer)
    text = "def f(x):\n    return x + 1\n"
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text(text)
    (tmp_path / "in" / "b.jsonl").write_text(
        json.dumps({"text": "plain words"}) + "\n"
        + json.dumps({"prompt": "Q: two?", "response": " 2"}) + "\n")
    stats = prepare([tmp_path / "in"], tmp_path / "out", max_seq_len=64, tokenizer=bos_tokenizer)
    assert stats["tokenizer"]["bos_id"] == tok.bos_id
    rows = pa.concat_tables(pq.read_table(p) for p in sorted((tmp_path / "out").glob("*.parquet")))
    by_doc = {row["doc"]: row for row in rows.to_pylist()}
    assert [by_doc[0]["tokens"], by_doc[1]["tokens"]] == [
        reference(text)["input_ids"] + [tok.eos_id], reference("plain words")["input_ids"] + [tok.eos_id]]
    example = by_doc[2]
    assert example["tokens"][:1] == [tok.bos_id] and example["loss_mask"][0] == 0
    assert example["tokens"][1:] == tok.encode("Q: two?") + tok.encode(" 2") + [tok.eos_id]

    class Recorder(nn.Module):  # records the context sampling feeds the model
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[list[int]] = []

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            self.seen.append(tokens[0].tolist())
            return torch.zeros(*tokens.shape, tok.vocab_size)

    model = Recorder()
    cfg = load_config(None, ["data.max_seq_len=64"])
    generate(TrainedModel(model, cfg, tmp_path, tok), "plain", max_new_tokens=1, temperature=0)
    assert model.seen[0] == [tok.bos_id, *tok.encode("plain")]
