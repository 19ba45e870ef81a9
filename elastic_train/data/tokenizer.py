"""One small interface for every tokenizer the project uses: UTF-8 bytes, or Hugging Face.

A tokenizer has `kind` ("bytes" | "hf"), `vocab_size`, `eos_id` and `pad_id` (None when it has
none), `encode(text)` (no special tokens added), `encode_batch(texts)`, `decode(ids)`,
`save(folder)` (a copy that `load_tokenizer(folder)` loads back) and
`save_for_transformers(folder)` (files `transformers.AutoTokenizer.from_pretrained` loads), and
`chat_template` (the jinja2 template of its tokenizer_config.json, None without one: `sft.py`
renders `messages` records with it, given the tokenizer's `special_tokens()` as transformers
gives them; saved with the copy).

`load_tokenizer(None)` is the byte tokenizer; a path is a `tokenizer.json` file, a folder
holding one, or a folder `transformers.AutoTokenizer` loads, never downloaded. The Hugging Face
libraries (the `hf` extra) are imported only when such a tokenizer is loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

BYTE_VOCAB = 256
BYTES_MARKER = "bytes_tokenizer.json"  # what ByteTokenizer.save writes, so the folder loads back
HF_EXTRA_HINT = "pip install 'elastic_train[hf]'"
# Names that mark the end of a document, or padding, in common vocabularies, in order of
# preference; used when the tokenizer's own config does not say.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")
# A folder holding none of these is not a tokenizer (transformers may find one through a
# model's config.json).
_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")


class Tokenizer(Protocol):
    """What prepare, training and sampling need from a tokenizer."""

    kind: str  # "bytes" | "hf"
    vocab_size: int  # every id is below this
    eos_id: int | None  # appended after each document by prepare; None: no end marker
    bos_id: int | None  # put before each document and prompt (`HFTokenizer.bos_id`); None: none
    pad_id: int | None  # None: the tokenizer has no padding token
    chat_template: str | None  # renders chat records (`sft.py`); None: the tokenizer has none

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def save(self, folder: str | os.PathLike) -> None: ...
    def save_for_transformers(self, folder: str | os.PathLike) -> None: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no end-of-document or padding token (the byte
    GPT's vocabulary is exactly 256, so there is no id left for one)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB
    eos_id: int | None = None
    bos_id: int | None = None
    pad_id: int | None = None
    chat_template: str | None = None

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`."""
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of those bytes; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def save(self, folder: str | os.PathLike) -> None:
        """Write a marker file that `load_tokenizer(folder)` reads back as bytes."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / BYTES_MARKER).write_text(json.dumps({"kind": "bytes"}) + "\n")

    def save_for_transformers(self, folder: str | os.PathLike) -> None:
        """Bytes have no `transformers` tokenizer: always raises ValueError."""
        raise ValueError("the byte tokenizer has no transformers equivalent; prepare the data "
                         "with --tokenizer to train a model that transformers can tokenize for")


class HFTokenizer:
    """A Hugging Face `tokenizers.Tokenizer`, with the end-of-document and padding ids found
    in its config or vocabulary."""

    kind = "hf"

    def __init__(self, backend: Any, eos_id: int | None, pad_id: int | None,
                 chat_template: str | None = None, config: dict | None = None) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))
        self.eos_id = eos_id
        self.bos_id = _leading_special(backend)
        self.pad_id = pad_id
        self.chat_template = chat_template
        # the source folder's tokenizer_config.json (its special tokens, bos included, extra
        # special tokens, class, chat template ...), written back whole by `save`
        self.config = dict(config or {})

    def token_text(self, token_id: int | None) -> str | None:
        """The text of a token id (the EOS a chat template writes), or None."""
        return self._token(token_id)

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens a chat template is rendered with, as transformers'
        `apply_chat_template` passes its `special_tokens_map`: those the config names (bos, unk,
        sep, cls, mask), with the EOS and pad used here; a token it lacks is not passed."""
        found = {name: _token_content(self.config.get(name)) for name in _TEMPLATE_TOKENS}
        found.update(eos_token=self._token(self.eos_id), pad_token=self._token(self.pad_id))
        return {name: token for name, token in found.items() if token}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without the special tokens a post-processor would add."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` of each text, in parallel threads."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, special tokens included."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def _token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def save(self, folder: str | os.PathLike) -> None:
        """Write `tokenizer.json` and a `tokenizer_config.json`: the source's whole (bos, unk,
        extra special tokens, class, chat template: what `transformers.AutoTokenizer` loads)
        with the EOS and pad tokens used here, without transformers installed here."""
        Path(folder).mkdir(parents=True, exist_ok=True)
        self.backend.save(str(Path(folder) / "tokenizer.json"))
        config = {key: value for key, value in self.config.items() if key not in _PATH_KEYS}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.update(eos_token=self._token(self.eos_id), pad_token=self._token(self.pad_id))
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (Path(folder) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    def save_for_transformers(self, folder: str | os.PathLike) -> None:
        """Write the files `transformers` loads this tokenizer from: `save`'s when the source had
        a tokenizer_config.json (kept whole), else those the installed `transformers` saves."""
        if self.config:
            self.save(folder)
            return
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError as exc:
            raise ValueError(f"saving a tokenizer for transformers needs it: {HF_EXTRA_HINT}") from exc
        wrapped = PreTrainedTokenizerFast(tokenizer_object=self.backend,
                                          eos_token=self._token(self.eos_id),
                                          pad_token=self._token(self.pad_id))
        if self.chat_template:
            wrapped.chat_template = self.chat_template
        wrapped.save_pretrained(str(folder))


def _leading_special(backend: Any) -> int | None:
    """The id the tokenizer's post-processor puts before a text (Llama's and Gemma's BOS), as
    transformers' `tokenizer(text)` adds it and the models were trained with; None when it puts
    none (GPT-2, a tokenizer trained without a post-processor) or more than one token."""
    probe = "a b"
    plain = backend.encode(probe, add_special_tokens=False).ids
    full = backend.encode(probe, add_special_tokens=True).ids
    return int(full[0]) if len(full) > len(plain) and full[1:len(plain) + 1] == plain else None


# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a chat template may use
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                    "mask_token")


def _token_content(value: Any) -> str | None:
    """A token as tokenizer_config.json names it: a string, or an {"content": ...} mapping."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _config_token(folder: Path, key: str) -> str | None:
    """The token named by `key` in the folder's tokenizer_config.json or special_tokens_map.json
    (a string, or an {"content": ...} mapping), or None."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


# tokenizer_config.json keys that name where the source was, not what the tokenizer is
_PATH_KEYS = ("name_or_path", "tokenizer_file", "auto_map")


def _folder_config(folder: Path) -> dict:
    """The folder's tokenizer_config.json, with the special tokens of its special_tokens_map.json
    that the config does not name ({} without either)."""
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        try:
            value = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(value, dict):
            config.update(value)
    return config


def _chat_template(folder: Path) -> str | None:
    """The chat template of the folder's tokenizer_config.json (or chat_template.jinja): a
    string, or the one named "default" of a list of named templates; None without one."""
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        value = None
    if isinstance(value, list):
        value = next((item.get("template") for item in value
                      if isinstance(item, dict) and item.get("name") == "default"), None)
    if not value and (folder / "chat_template.jinja").is_file():
        value = (folder / "chat_template.jinja").read_text()
    return value if isinstance(value, str) and value else None


def _special_id(backend: Any, configured: str | None, names: Sequence[str]) -> int | None:
    """The id of the configured token if the vocabulary has it, else of the first of `names`
    it has, else None."""
    for token in ([configured] if configured else []) + list(names):
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return None


def _from_tokenizer_json(file: Path) -> HFTokenizer:
    """A tokenizer.json file, with special tokens from the config files beside it."""
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(file))
    folder = file.parent
    eos = _special_id(backend, _config_token(folder, "eos_token"), EOS_NAMES)
    pad = _special_id(backend, _config_token(folder, "pad_token"), PAD_NAMES)
    return HFTokenizer(backend, eos, pad, _chat_template(folder), _folder_config(folder))


def _from_transformers(folder: Path) -> HFTokenizer:
    """A folder that `transformers.AutoTokenizer` loads from local files only."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"transformers loads it as {type(loaded).__name__}, which has no fast "
                         "(tokenizers) backend")
    eos = _special_id(backend, getattr(loaded, "eos_token", None), EOS_NAMES)
    pad = _special_id(backend, getattr(loaded, "pad_token", None), PAD_NAMES)
    template = getattr(loaded, "chat_template", None)
    return HFTokenizer(backend, eos, pad,
                       template if isinstance(template, str) else _chat_template(folder),
                       _folder_config(folder))


def load_tokenizer(path: str | os.PathLike | None, *, label: str = "--tokenizer") -> Tokenizer:
    """The tokenizer at `path`: None -> bytes; a tokenizer.json file; a folder holding one (or
    the marker `ByteTokenizer.save` writes); else a folder `transformers.AutoTokenizer` loads
    with `local_files_only=True`. Nothing is downloaded.

    Raises ValueError "<label> 'path' does not load: <why>", pointing at the `hf` extra when
    the Hugging Face libraries are missing.
    """
    if path is None:
        return ByteTokenizer()
    shown = f"{label} '{path}' does not load"
    file = Path(path).expanduser()
    if not str(path).strip():
        raise ValueError(f"{shown}: it is an empty path")
    if not file.exists():
        raise ValueError(f"{shown}: no such file or folder (nothing is downloaded: give a local "
                         "tokenizer.json or a folder holding a transformers tokenizer)")
    if file.is_dir() and (file / BYTES_MARKER).is_file():
        return ByteTokenizer()
    if file.is_dir() and not any((file / name).is_file() for name in _FOLDER_FILES):
        raise ValueError(f"{shown}: the folder holds none of {', '.join(_FOLDER_FILES)}")
    try:
        if file.is_dir() and (file / "tokenizer.json").is_file():
            return _from_tokenizer_json(file / "tokenizer.json")
        if file.is_file():
            return _from_tokenizer_json(file)
        return _from_transformers(file)
    except ImportError as exc:
        raise ValueError(f"{shown}: the Hugging Face libraries are not installed ({exc}); "
                         f"{HF_EXTRA_HINT}") from exc
    except Exception as exc:  # tokenizers and transformers raise many kinds for a bad file
        why = " ".join(str(exc).split())[:400] or type(exc).__name__  # one line
        raise ValueError(f"{shown}: {why}") from exc
