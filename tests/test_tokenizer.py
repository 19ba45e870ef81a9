"""Tests for elastic_train.data.tokenizer: bytes, tokenizer.json files and transformers folders."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elastic_train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

pytestmark = pytest.mark.unit

TEXT = "def f(x):\n    return 'h\u00e9llo \u2603'  # a comment\n"


def test_byte_tokenizer(tmp_path):
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id) == (
        "bytes", 256, None, None)
    assert tokenizer.encode("h\u00e9") == [104, 195, 169]
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT
    assert tokenizer.decode([104, 195]) == "h\ufffd"  # a cut character is replaced
    assert tokenizer.encode_batch(["a", "bc"]) == [[97], [98, 99]]
    tokenizer.save(tmp_path / "copy")
    assert isinstance(load_tokenizer(tmp_path / "copy"), ByteTokenizer)
    with pytest.raises(ValueError, match="no transformers equivalent"):
        tokenizer.save_for_transformers(tmp_path / "hf")


def test_tokenizer_json_its_copy_and_the_transformers_folder_agree(tmp_path, bpe_tokenizer):
    transformers = pytest.importorskip("transformers")
    tokenizer = load_tokenizer(bpe_tokenizer)
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id) == (
        "hf", 400, 0, 1)
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT and tokenizer.encode_batch([TEXT, "x"])[0] == ids
    assert tokenizer.decode(ids + [0]) == TEXT + "<|endoftext|>"
    tokenizer.save(tmp_path / "copy")
    tokenizer.save_for_transformers(tmp_path / "hf")
    for folder in ("copy", "hf"):
        loaded = load_tokenizer(tmp_path / folder)
        assert (loaded.encode(TEXT), loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (
            ids, 400, 0, 1)
        auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / folder),
                                                          local_files_only=True)
        assert auto.encode(TEXT, add_special_tokens=False) == ids
        assert (auto.eos_token_id, auto.pad_token_id) == (0, 1)


def test_a_folder_only_transformers_loads(tmp_path, bpe_tokenizer):
    pytest.importorskip("transformers")
    tokenizer = load_tokenizer(bpe_tokenizer)
    folder = tmp_path / "gpt2-style"
    folder.mkdir()
    tokenizer.backend.model.save(str(folder))  # vocab.json and merges.txt, no tokenizer.json
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>",
              "pad_token": "<pad>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(folder)
    assert loaded.encode(TEXT) == tokenizer.encode(TEXT)
    assert (loaded.eos_id, loaded.pad_id) == (0, 1)


def test_the_config_names_the_special_tokens_before_common_names(tmp_path, bpe_tokenizer):
    load_tokenizer(bpe_tokenizer).save(tmp_path / "copy")
    config = {"eos_token": {"content": "<pad>"}, "pad_token": "<not in the vocabulary>"}
    (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = load_tokenizer(tmp_path / "copy")
    assert (loaded.eos_id, loaded.pad_id) == (1, 1)  # pad: the first common name present
    (tmp_path / "copy" / "tokenizer_config.json").write_text("{}")
    assert (load_tokenizer(tmp_path / "copy").eos_id, load_tokenizer(tmp_path / "copy").pad_id) == (
        0, 1)


def test_without_the_hf_extra_the_error_says_how_to_install_it(monkeypatch, bpe_tokenizer):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError, match=r"pip install 'elastic_train\[hf\]'") as info:
        load_tokenizer(bpe_tokenizer, label="--tokenizer")
    assert str(info.value).startswith(f"--tokenizer '{bpe_tokenizer}' does not load: ")


def test_the_package_imports_without_the_hf_libraries():
    code = ("import sys; sys.modules['tokenizers'] = sys.modules['transformers'] = None; "
            "import elastic_train.cli, elastic_train.data.prepare, elastic_train.data.tokenizer as t; "
            "assert t.load_tokenizer(None).encode('a') == [97]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_tokenizer_goes_through_prepare_and_export_whole(tmp_path):
    """A transformers tokenizer folder with bos, eos, pad, an extra special token and a chat
    template: the copy prepare keeps (`save`) and the one export writes from that copy
    (`save_for_transformers`) load in transformers as the source does: the same special
    tokens, chat template, and ids for a text holding them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello world, how are you"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<pad>", "<tool>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    source = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", extra_special_tokens=["<tool>"])
    source.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    source.save_pretrained(tmp_path / "src")
    load_tokenizer(tmp_path / "src").save(tmp_path / "prepared")  # what prepare keeps
    load_tokenizer(tmp_path / "prepared").save_for_transformers(tmp_path / "export")
    want = AutoTokenizer.from_pretrained(tmp_path / "src")
    for folder in ("prepared", "export"):
        got = AutoTokenizer.from_pretrained(tmp_path / folder)
        assert (got.bos_token, got.eos_token, got.pad_token) == ("<s>", "</s>", "<pad>")
        assert list(got.extra_special_tokens) == ["<tool>"] == list(want.extra_special_tokens)
        assert got.all_special_tokens == want.all_special_tokens
        assert got.chat_template == want.chat_template
        text = "<s>hello <tool> world</s>"
        assert got(text)["input_ids"] == want(text)["input_ids"]
