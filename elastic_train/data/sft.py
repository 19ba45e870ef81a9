"""Fine-tuning records: a prompt and its response, or a chat conversation, made into one row of
tokens with a `loss_mask` (1 where the token is a target: the answer's tokens and the end marker
after it).

Why a mask and not more rows: every SFT recipe trains on the answer only, and an answer means
nothing without its prompt. So an example is never cut into a second row that would start
mid-answer. The rule for an example longer than `max_seq_len`: it is truncated to its first
`max_seq_len` tokens when that keeps at least one target token (the end of a long answer is lost,
its prompt kept), else (the prompt alone fills the row, or there is no answer at all) it is
dropped. Both are counted (`SftCounts`) and recorded in `_prepare.json` under `sft`.

A record is a fine-tuning example when it holds both `prompt` and `response` fields (names
settable, `RecordFields`), or a `messages` list of `{role, content}`; otherwise its text field is
read as plain text (every token a target). A null prompt and response (or null messages) count as
absent, so that one file of one schema (Parquet has no absent fields, only nulls) may hold plain
text and examples side by side: each row is whichever it holds, none is dropped (a record holding
an example and a text too is the example).

Prompt and response are tokenized apart and put back to back (no separator is added: put one in
the prompt), then the tokenizer's EOS, a target. A conversation is rendered with the tokenizer's
chat template (the `chat_template` of its tokenizer_config.json, rendered with jinja2 as
transformers does); each assistant message's rendering (from the end of the generation prompt
before it to the end of the message, so the template's end-of-turn marker is a target too) is a
target span; the pieces between are tokenized apart, so that the mask falls exactly on span
boundaries. A template that does not render a conversation as the prefix of its continuation is
refused, as is a tokenizer without a template; an error of the template (one that does not
compile, or raises on a conversation) names the record's file and line or row.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elastic_train.data.tokenizer import Tokenizer

TRUNCATION_RULE = ("an example longer than max_seq_len keeps its first max_seq_len tokens when "
                   "they hold a target token, else it is dropped")


@dataclass(frozen=True)
class RecordFields:
    """The field (column) names `prepare` reads from JSONL and Parquet records."""

    text: str = "text"  # plain text: every token a target
    prompt: str = "prompt"  # with `response`: a fine-tuning example
    response: str = "response"
    messages: str = "messages"  # a list of {role, content}: a chat example


def as_fields(fields: RecordFields | str) -> RecordFields:
    """`fields`, or the default field names with `fields` as the text field."""
    return fields if isinstance(fields, RecordFields) else RecordFields(text=fields)


@dataclass(frozen=True)
class Example:
    """One fine-tuning record: `prompt` and `response`, or `messages`."""

    prompt: str | None = None
    response: str | None = None
    messages: tuple[dict, ...] | None = None
    # where it was read ("'file' line N", "'file' row N"): errors of its chat template name it
    where: str = field(default="", compare=False)


# SftCounts' fields, in order: the Ray prepare carries them between its stages as columns
SFT_COUNTS = ("examples", "truncated", "dropped", "no_answer", "long_prompt")


@dataclass
class SftCounts:
    """Fine-tuning examples read, truncated and dropped (`TRUNCATION_RULE`)."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    # why each was dropped: no answer (an empty response, no assistant turn), or a prompt that
    # fills max_seq_len before its answer begins
    no_answer: int = 0
    long_prompt: int = 0

    def add(self, other: SftCounts) -> None:
        self.examples += other.examples
        self.truncated += other.truncated
        self.dropped += other.dropped
        self.no_answer += other.no_answer
        self.long_prompt += other.long_prompt

    def dropped_all(self, max_seq_len: int) -> str:
        """Why no row is left when every example was dropped (prepare's error)."""
        why = []
        if self.no_answer:
            why.append(f"{self.no_answer} had no answer (an empty response, or no assistant turn)")
        if self.long_prompt:
            why.append(f"{self.long_prompt} had a prompt that fills --max-seq-len {max_seq_len} "
                       "before its answer begins (raise --max-seq-len)")
        reasons = "; ".join(why) or f"{TRUNCATION_RULE}"
        return (f"every one of the {self.examples} fine-tuning example(s) was dropped, nothing "
                f"is left to train on: {reasons}")

    def record(self) -> dict:
        """The `sft` section of `_prepare.json`."""
        return {"examples": self.examples, "truncated": self.truncated, "dropped": self.dropped,
                "rule": TRUNCATION_RULE}


def _string(value: Any, where: str, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where}: field '{name}' is not a string (it is {type(value).__name__})")
    return value


def _messages(value: Any, where: str, name: str) -> tuple[dict, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: field '{name}' is not a list of {{role, content}} "
                         f"(it is {type(value).__name__})")
    out = []
    for number, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: {name}[{number}] is not a {{role, content}} mapping of "
                             f"strings: {json.dumps(message, default=str)[:120]}")
        out.append({"role": message["role"], "content": message["content"]})
    return tuple(out)


def record_item(record: dict, where: str, fields: RecordFields) -> str | Example | None:
    """A record's content: an `Example` when it holds prompt and response (or messages), else its
    text (None for a null). Null prompt and response, or null messages, count as absent (a
    union-schema file's plain-text row). ValueError naming `where` for a record with none of
    the fields, one with only one of prompt and response null, or one of the wrong type."""
    pair = fields.prompt in record and fields.response in record
    prompt, response = record.get(fields.prompt), record.get(fields.response)
    if pair and (prompt is not None or response is not None):
        for name, value in ((fields.prompt, prompt), (fields.response, response)):
            if value is None:  # not an empty string: a broken record, not an example to train
                raise ValueError(f"{where}: field '{name}' is null (a fine-tuning example needs "
                                 f"both '{fields.prompt}' and '{fields.response}' as strings)")
        return Example(prompt=_string(prompt, where, fields.prompt),
                       response=_string(response, where, fields.response), where=where)
    if record.get(fields.messages) is not None:
        return Example(messages=_messages(record[fields.messages], where, fields.messages),
                       where=where)
    if fields.text not in record:
        if pair or fields.messages in record:  # an example's fields, all null: a null record
            return None
        have = ", ".join(map(str, record)) or "none"
        raise ValueError(f"{where} has no field '{fields.text}' (--text-field), nor "
                         f"'{fields.prompt}' and '{fields.response}' (--prompt-field, "
                         f"--response-field), nor '{fields.messages}'; it has: {have}")
    text = record[fields.text]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}: field '{fields.text}' is not a string "
                         f"(it is {type(text).__name__})")
    return text


@functools.lru_cache(maxsize=4)
def _compiled_template(template: str) -> Any:
    """The chat template compiled as transformers compiles it (sandboxed jinja2); ValueError
    for one that does not compile."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template (of --tokenizer) does not compile: {exc.message} "
                         f"(line {exc.lineno} of the template)") from exc


def _renderer(tokenizer: Tokenizer) -> Callable[[Sequence[dict], bool], str]:
    """render(messages, add_generation_prompt) with the tokenizer's chat template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        which = "prepare has no tokenizer (bytes)" if tokenizer.kind == "bytes" else (
            "the tokenizer (--tokenizer) has no chat template (no 'chat_template' in its "
            "tokenizer_config.json)")
        raise ValueError(f"records with 'messages' are rendered with the tokenizer's chat "
                         f"template, but {which}: give a tokenizer that has one, or records "
                         "with prompt/response fields")
    compiled = _compiled_template(template)
    # as transformers' apply_chat_template: the tokenizer's named special tokens (its real BOS
    # for a template that writes `{{ bos_token }}`); one it lacks is left undefined
    special = getattr(tokenizer, "special_tokens", dict)()
    return lambda messages, prompt: compiled.render(messages=list(messages),
                                                    add_generation_prompt=prompt, **special)


def chat_segments(messages: Sequence[dict], render: Callable[[Sequence[dict], bool], str]
                  ) -> list[tuple[str, bool]]:
    """A conversation's rendering cut into (text, is_target) pieces: each assistant message,
    from the end of the generation prompt before it to the end of its rendering, a target."""
    segments: list[tuple[str, bool]] = []
    done = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head, full = render(messages[:index], True), render(messages[:index + 1], False)
        if not (head.startswith(done) and full.startswith(head)):
            raise ValueError("the chat template does not render a conversation as the prefix of "
                             "its continuation, so the answer tokens cannot be told apart")
        segments += [(head[len(done):], False), (full[len(head):], True)]
        done = full
    whole = render(messages, False)
    if not whole.startswith(done):
        raise ValueError("the chat template does not render a conversation as the prefix of "
                         "its continuation, so the answer tokens cannot be told apart")
    segments.append((whole[len(done):], False))
    return [(text, target) for text, target in segments if text]


def _example_segments(example: Example, tokenizer: Tokenizer) -> list[tuple[str, bool]]:
    """`chat_segments` of a chat example. Whatever its template raises (its `raise_exception`,
    a jinja2 error, a Python error inside it) comes back as one ValueError that names the record,
    so that a bad conversation among thousands is found by its line."""
    try:
        return chat_segments(example.messages or (), _renderer(tokenizer))
    except Exception as exc:  # a user's template can raise anything jinja2 or Python raises
        why = " ".join(str(exc).split()) or type(exc).__name__
        if not isinstance(exc, ValueError):
            why = f"the chat template failed on the conversation: {type(exc).__name__}: {why}"
        raise ValueError(f"{example.where}: {why}" if example.where else why) from exc


def _encode_segments(segments: list[tuple[str, bool]], tokenizer: Tokenizer
                     ) -> tuple[np.ndarray, np.ndarray]:
    texts = [text for text, _ in segments]
    if tokenizer.kind == "bytes":
        pieces = [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]
        dtype: type = np.uint8
    else:
        pieces = [np.asarray(ids, dtype=np.int32) for ids in tokenizer.encode_batch(texts)]
        dtype = np.int32
    masks = [np.full(len(piece), int(target), dtype=np.int8)
             for piece, (_, target) in zip(pieces, segments, strict=True)]
    ids = np.concatenate([np.zeros(0, dtype), *pieces]).astype(dtype)
    return ids, np.concatenate([np.zeros(0, np.int8), *masks])


def encode_example(example: Example, tokenizer: Tokenizer, max_seq_len: int,
                   counts: SftCounts) -> tuple[np.ndarray, np.ndarray] | None:
    """An example's row: (tokens, loss_mask), the tokenizer's BOS first for a prompt/response
    example (a chat template writes its own), the EOS after the answer (after the conversation,
    a target when it ends with an assistant message, unless the template wrote it); None when it
    is dropped (`TRUNCATION_RULE`). Counts it in `counts`."""
    counts.examples += 1
    if example.messages is None:
        segments = [(example.prompt or "", False), (example.response or "", True)]
        segments = [(text, target) for text, target in segments if text]
        ends_with_answer = bool(example.response)
    else:
        segments = _example_segments(example, tokenizer)
        ends_with_answer = bool(example.messages) and example.messages[-1]["role"] == "assistant"
    ids, mask = _encode_segments(segments, tokenizer)
    if example.messages is None and tokenizer.bos_id is not None:  # a template writes its own
        ids = np.concatenate([np.asarray([tokenizer.bos_id], ids.dtype), ids]).astype(ids.dtype)
        mask = np.concatenate([np.zeros(1, np.int8), mask])
    eos = tokenizer.eos_id
    if eos is not None and (len(ids) == 0 or int(ids[-1]) != eos):
        ids = np.append(ids, np.asarray(eos, ids.dtype)).astype(ids.dtype)
        mask = np.append(mask, np.int8(ends_with_answer)).astype(np.int8)
    answered = bool(mask.any())
    if len(ids) > max_seq_len:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if mask.any():
            counts.truncated += 1
    if not mask.any():
        counts.dropped += 1
        counts.long_prompt += answered
        counts.no_answer += not answered
        return None
    return ids, mask
