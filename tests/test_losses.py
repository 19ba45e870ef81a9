"""The default loss and the model builders on a tiny Hugging Face Llama (no Ray, no download)."""

from __future__ import annotations

import pytest
import torch

from elastic_train.config import ModelConfig
from elastic_train.data.batches import make_batch
from elastic_train.training.losses import (
    _logits_loss_sum,
    causal_lm_loss,
    chunked_head_applies,
    forward,
)
from elastic_train.training.model import (
    build_meta_model,
    build_model,
    count_parameters,
    input_embedding_rows,
    model_flops_per_token,
)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                tie_word_embeddings=True).save_pretrained(folder)
    return str(folder)


def _batch(vocab: int = 300):
    torch.manual_seed(1)
    lengths = torch.tensor([20, 7, 1, 13])
    tokens = torch.randint(0, vocab, (4, 20))
    return make_batch(tokens, lengths)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_chunked_loss_equals_the_loss_of_whole_logits(llama_folder):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="hf", path=llama_folder), 64)
    assert chunked_head_applies(model)
    batch = _batch()
    loss, n = causal_lm_loss(model, batch, chunk_tokens=8)  # 4 rows x 2 positions a chunk
    loss.backward()
    chunked = _grads(model)
    model.zero_grad()
    whole = _logits_loss_sum(forward(model, batch)[:, :-1], batch["labels"][:, 1:], 10**9)
    whole.backward()
    assert n == 19 + 6 + 0 + 12
    torch.testing.assert_close(loss, whole, rtol=1e-6, atol=1e-5)
    for name, g in _grads(model).items():
        torch.testing.assert_close(chunked[name], g, rtol=1e-5, atol=1e-6)


def test_padding_does_not_change_the_loss(llama_folder):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="hf", path=llama_folder), 64).eval()
    batch = _batch()
    garbage = batch["tokens"].clone()
    garbage[batch["attention_mask"] == 0] = 299
    with torch.no_grad():
        a, _ = causal_lm_loss(model, batch)
        b, _ = causal_lm_loss(model, make_batch(garbage, batch["lengths"]))
    torch.testing.assert_close(a, b)


def test_weights_in_the_folder_are_loaded_and_the_same_seed_builds_the_same_model(llama_folder, tmp_path):
    cfg = ModelConfig(name="hf", path=llama_folder)
    torch.manual_seed(3)
    a = build_model(cfg, 64)
    torch.manual_seed(3)
    b = build_model(cfg, 64)
    for name, t in a.state_dict().items():
        assert torch.equal(b.state_dict()[name], t), name
    assert a.dtype == torch.float32 and a.config.use_cache is False
    assert a.get_output_embeddings().weight is a.get_input_embeddings().weight  # tied
    a.save_pretrained(tmp_path / "trained")
    torch.manual_seed(4)  # another seed: only loading the weights gives a's
    loaded = build_model(ModelConfig(name="hf", path=str(tmp_path / "trained")), 64)
    for name, t in a.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    meta = build_meta_model(ModelConfig(name="hf", path=str(tmp_path / "trained")), 64)  # the driver's
    assert next(meta.parameters()).is_meta and input_embedding_rows(meta) == 300
    assert meta.get_output_embeddings().weight is meta.get_input_embeddings().weight


@pytest.mark.parametrize("name", ["gpt", "hf"])
def test_gradient_checkpointing_gives_the_same_gradient(name, llama_folder):
    extra = {"path": llama_folder} if name == "hf" else {"n_layer": 2, "d_model": 32, "n_head": 2}
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(name=name, gradient_checkpointing=checkpointing, **extra), 64)
        model.train()
        causal_lm_loss(model, _batch(256))[0].backward()
        grads.append(_grads(model))
    for key, g in grads[0].items():
        torch.testing.assert_close(grads[1][key], g, rtol=1e-5, atol=1e-7)


def test_flops_of_an_hf_model_follow_the_gpts_convention(llama_folder):
    """6 N + 12 L d T for an hf model too (it was 6 x every parameter, the attention left out):
    N its matmul weights, the untied input embedding and the norms left out; L and d from its
    config. A model that says nothing of its attention gets 6 N (a lower bound)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    tied = build_model(ModelConfig(name="hf", path=llama_folder), 64)
    untied = LlamaForCausalLM(type(tied.config)(**{**tied.config.to_dict(),
                                                   "tie_word_embeddings": False}))
    for model in (tied, untied):
        _check_hf_flops(model)
    user = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    assert model_flops_per_token(ModelConfig(name="pkg.mod:make"), 64, user) == 6.0 * 8 * 50


def _check_hf_flops(model) -> None:
    c = model.config
    d, layers = c.hidden_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (d // c.num_attention_heads)
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * c.intermediate_size  # q, o, k, v; the MLP
    n = layers * per_layer + c.vocab_size * d  # and the head (tied: the table counts as it)
    norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    table = 0 if c.tie_word_embeddings else c.vocab_size * d  # an untied table does no matmul
    assert count_parameters(model) == n + norms + table
    assert model_flops_per_token(ModelConfig(name="hf"), 64, model) == 6.0 * n + 12.0 * layers * d * 64
    assert model_flops_per_token(ModelConfig(name="hf"), None, model) == 6.0 * n  # length unknown


META_CHECK = """
import sys, torch
from elastic_train.config import ModelConfig
from elastic_train.training.model import build_meta_model, build_model
cfg = ModelConfig(**{kwargs!r})
meta = build_meta_model(cfg, 64)
assert {own} is False or "torch._dynamo" not in sys.modules, "the meta build imported torch._dynamo"
real = build_model(cfg, 64)
shapes = lambda m: [(n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()]
assert all(p.is_meta for p in meta.parameters())
assert shapes(meta) == shapes(real), (shapes(meta), shapes(real))
print("ok")
"""


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_the_drivers_meta_model_has_the_shapes_and_skips_initialisation(kind, llama_folder):
    """The driver's check builds the model on the meta device: the same parameters as a real build,
    and for our own model without the first-use import of torch._dynamo that meta initialisation
    kernels cause (1.2 s of every command's start-up; transformers imports it anyway)."""
    import subprocess
    import sys

    kwargs = {"name": "hf", "path": str(llama_folder)} if kind == "hf" else {"name": "gpt"}
    out = subprocess.run([sys.executable, "-c", META_CHECK.format(kwargs=kwargs, own=kind == "gpt")],
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.parametrize("returned", ["scalar", "triple", "vector"])
def test_a_loss_that_returns_otherwise_is_refused_naming_it(returned):
    """A user's loss must return (loss_sum, num_targets): one that returns a bare scalar, three
    values or a per-row vector is refused by a ConfigError naming it (fatal on a worker: the run
    ends with this reason instead of restarting into it), not a TypeError from the step."""
    from elastic_train.config import ConfigError
    from elastic_train.training.losses import LossModule

    def my_loss(model, batch):
        per_row = model(batch["tokens"]).float().sum(dim=(1, 2))
        return {"scalar": per_row.sum(), "triple": (per_row.sum(), 3, 0),
                "vector": (per_row, 3)}[returned]

    model = torch.nn.Embedding(10, 4)
    batch = make_batch(torch.tensor([[1, 2, 3]]), torch.tensor([3]))
    with pytest.raises(ConfigError, match=r"loss_fn .*my_loss returned .*: it must return "
                                          r"\(loss_sum, num_targets\)"):
        LossModule(model, my_loss)(batch)
    loss, count = LossModule(model, lambda m, b: (m(b["tokens"]).sum(), 3))(batch)
    assert loss.ndim == 0 and count == 3
