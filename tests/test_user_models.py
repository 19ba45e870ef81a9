"""A user's own model, as the driver checks it and a worker builds it, without Ray: a factory that
refuses the meta device (`from_pretrained` inside it, `.item()` at init) is built once on the CPU
for the checks and trained from that build, while a factory that really fails is still named; the
token embedding is found even when a position table is declared first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY
from torch import nn

from elastic_train.config import ConfigError, load_config
from elastic_train.preflight.inputs import check_inputs, data_tables
from elastic_train.training.model import build_meta_model, build_model, input_embedding_rows

pytestmark = pytest.mark.unit

REAL_BUILDS: list[str] = []  # the factories below append their name on each build off meta


class TinyLM(nn.Module):
    """Embedding, one linear head: logits [B, T, vocab]; `pos_rows` > 0 declares a position table
    before the token table."""

    def __init__(self, vocab_size: int, pos_rows: int = 0, width: int = 8) -> None:
        super().__init__()
        if pos_rows:
            self.pos = nn.Embedding(pos_rows, width)
        self.tok = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(tokens))


def _on_meta() -> bool:
    return torch.empty(1).device.type == "meta"


def item_at_init(vocab_size: int, max_seq_len: int) -> nn.Module:
    """Reads a value at init, as models that size a table from a tensor do."""
    width = int(torch.tensor(8).item())  # Tensor.item() cannot be called on meta tensors
    REAL_BUILDS.append("item_at_init")
    return TinyLM(vocab_size, width=width)


def refuses_meta(vocab_size: int, max_seq_len: int) -> nn.Module:
    """What `from_pretrained` does under a meta device context."""
    if _on_meta():
        raise RuntimeError("You are using from_pretrained with a meta device context manager")
    REAL_BUILDS.append("refuses_meta")
    return TinyLM(vocab_size)


def really_broken(vocab_size: int, max_seq_len: int) -> nn.Module:
    if _on_meta():
        raise RuntimeError("cannot be called on meta tensors")
    raise ValueError("hidden_size must be even")  # the user's own mistake: on any device


def pos_first(vocab_size: int, max_seq_len: int) -> nn.Module:
    return TinyLM(vocab_size, pos_rows=20)


def pos_first_small_vocab(vocab_size: int, max_seq_len: int) -> nn.Module:
    return TinyLM(100, pos_rows=20)  # ignores vocab_size: its token table is too small


def config(data: str, tmp_path: Path, *more: str):
    return load_config(None, [*TINY, f"data.path={data}", f"run.storage_path={tmp_path}", *more])


# ---- factories that refuse the meta device ----

@pytest.mark.parametrize("factory", [item_at_init, refuses_meta])
def test_a_factory_that_refuses_meta_passes_the_driver_checks(factory, small_dataset, tmp_path):
    cfg = config(small_dataset, tmp_path)
    REAL_BUILDS.clear()
    check_inputs(cfg, factory)
    assert REAL_BUILDS == [factory.__name__]  # built for real once, for the checks


def test_from_pretrained_inside_a_factory_passes_the_driver_checks(small_dataset, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 max_position_embeddings=128)).save_pretrained(folder)

    def pretrained(vocab_size: int, max_seq_len: int) -> nn.Module:
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)

    check_inputs(config(small_dataset, tmp_path), pretrained)


def test_the_worker_trains_the_one_real_build(small_dataset, tmp_path):
    """build_training's path: the fallback build is the model trained (no second build), with
    the weights a plain build from the seed has."""
    from localenv import LocalEnv

    from elastic_train.training.build import build_training

    cfg = config(small_dataset, tmp_path)
    info = check_inputs(cfg, item_at_init)
    REAL_BUILDS.clear()
    t = build_training(cfg, LocalEnv(data_tables(cfg, info).train), item_at_init)
    assert REAL_BUILDS == ["item_at_init"]
    torch.manual_seed(cfg.train.seed)
    plain = build_model(cfg.model, cfg.data.max_seq_len, item_at_init)
    for (name, p), q in zip(t.raw_model.named_parameters(), plain.parameters(), strict=True):
        assert not p.is_meta and torch.equal(p, q), name


def test_a_factory_that_fails_for_real_is_still_named(small_dataset, tmp_path):
    with pytest.raises(ConfigError) as refused:
        check_inputs(config(small_dataset, tmp_path), really_broken)
    assert str(refused.value) == ("model: model_fn really_broken(vocab_size, max_seq_len) raised "
                                  "ValueError: hidden_size must be even")


def test_our_own_models_still_build_on_meta_only():
    """Issue 37: the embedded GPT is never built whole before the fit check."""
    cfg = load_config(None, TINY)
    assert all(p.is_meta for p in build_meta_model(cfg.model, 128).parameters())


# ---- which embedding is the token embedding ----

def test_a_position_table_declared_first_is_not_the_token_embedding(small_dataset, tmp_path):
    check_inputs(config(small_dataset, tmp_path), pos_first)
    model = pos_first(256, 128)
    assert input_embedding_rows(model, 256) == 256
    assert input_embedding_rows(model) == 256  # the worker's reader: the largest


def test_a_token_embedding_too_small_is_still_refused(small_dataset, tmp_path):
    with pytest.raises(ConfigError, match=r"model: its embedding has 150 rows but data set "):
        check_inputs(config(small_dataset, tmp_path, "model.vocab_size=150"), pos_first)
    with pytest.raises(ConfigError, match=r"model: its embedding has 100 rows but data set "):
        check_inputs(config(small_dataset, tmp_path), pos_first_small_vocab)


def test_get_input_embeddings_is_trusted():
    model = TinyLM(30, pos_rows=50)
    model.get_input_embeddings = lambda: model.tok
    assert input_embedding_rows(model, 50) == 30
