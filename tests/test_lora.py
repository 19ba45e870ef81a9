"""LoRA without Ray (issue 30): what is trained, saved and refused."""

from __future__ import annotations

import pytest
import torch

from elastic_train import load_config
from elastic_train.config import ConfigError
from elastic_train.preflight.packages import needed_packages
from elastic_train.training.lora import BASE_KEY, LoraModel
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer

pytestmark = pytest.mark.unit
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=True).save_pretrained(folder)
    return str(folder)


def lora_cfg(folder: str, *extra: str):
    return load_config(None, ["model.name=hf", f"model.path={folder}", "model.lora.r=4",
                              "model.lora.target_modules=[q_proj, v_proj]", *extra])


def test_a_bf16_base_is_frozen_and_only_fp32_adapters_are_optimized_and_saved(llama_folder):
    cfg = lora_cfg(llama_folder, "model.base_dtype=bf16")
    torch.manual_seed(0)
    model = build_model(cfg.model, 64)
    assert isinstance(model, LoraModel)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    optimizer = build_optimizer(model, cfg.optim, False)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainable.values()}
    state = model.state_dict()
    assert set(state) == set(trainable) | {BASE_KEY}
    # A batch trains the adapters only.
    tokens = torch.randint(0, 400, (2, 12))
    model(tokens).logits.float().sum().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert all(p.grad is None for p in frozen.values())


def test_adapters_of_another_base_are_refused_by_name(llama_folder):
    cfg = lora_cfg(llama_folder)
    torch.manual_seed(0)
    saved = build_model(cfg.model, 64).state_dict()
    torch.manual_seed(0)
    build_model(cfg.model, 64).load_state_dict(saved)  # the same base: loads
    torch.manual_seed(1)  # no weights in the folder: another seed is another base
    with pytest.raises(ValueError, match="trained on another base model"):
        build_model(cfg.model, 64).load_state_dict(saved)


@pytest.mark.parametrize("overrides, words", [
    (["train.sharding=fsdp"], "model.lora with train.sharding=fsdp"),
    (["model.lora.load_in_4bit=true"], "runs on GPU workers only"),
    (["model.lora.r=0", "model.base_dtype=bf16"], "model.base_dtype=bf16"),
    (["model.lora.r=-1"], "model.lora.r must be >= 0"),
    (["model.base_dtype=fp16"], "model.base_dtype must be fp32 or bf16"),
])
def test_lora_settings_that_cannot_work_are_refused_by_name(llama_folder, overrides, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        lora_cfg(llama_folder, *overrides)


def test_peft_is_a_package_the_config_needs():
    cfg = load_config(None, ["model.lora.r=2", "model.lora.target_modules=[fc]"])
    assert [need.module for need in needed_packages(cfg)] == ["peft"]
    assert not needed_packages(load_config(None))
