"""Unit tests of the GPT, its token loss, the LR schedule and the optimizers (CPU, no Ray).

Sizes: d_model=64 and max_seq_len=64 make every weight matrix hold >= 4096 elements, bitsandbytes'
default min_8bit_size, so AdamW8bit keeps 8-bit state for all of them; only the layer norms
(64 elements each) keep 32-bit state, which is why its bytes per parameter sit just above 2.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from elastic_train.config import ModelConfig, OptimConfig
from elastic_train.training.model import (
    build_model,
    count_parameters,
    matmul_parameters,
    model_flops_per_token,
    token_loss_sum,
)
from elastic_train.training.optim import (
    build_optimizer,
    lr_at,
    optimizer_state_bytes,
    set_lr,
    training_bytes_per_param,
)

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

MODEL = ModelConfig(n_layer=1, n_head=2, d_model=64)
MAX_SEQ_LEN = 64


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(MODEL, MAX_SEQ_LEN)


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Four right-padded rows (pad 0) of lengths 12, 7, 3 and 1."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 7, 3, 1])
    tokens = torch.randint(1, 256, (4, 12), generator=gen)
    tokens[torch.arange(12)[None, :] >= lengths[:, None]] = 0
    return tokens, lengths


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    tokens, lengths = _batch()
    losses = []
    for _ in range(steps):
        loss_sum, n_targets = token_loss_sum(model, tokens, lengths)
        optimizer.zero_grad(set_to_none=True)
        (loss_sum / n_targets).backward()
        optimizer.step()
        losses.append(loss_sum.item() / n_targets)
    return losses


def test_logits_shape() -> None:
    tokens = torch.randint(0, 256, (3, 10))
    assert _model()(tokens).shape == (3, 10, 256)  # model.vocab_size None: bytes


def test_unknown_model_name_is_named() -> None:
    with pytest.raises(ValueError, match="model.name.*'llama'"):
        build_model(ModelConfig(name="llama"), MAX_SEQ_LEN)


def test_loss_ignores_padding() -> None:
    model = _model().eval()
    tokens, lengths = _batch()
    loss, n = token_loss_sum(model, tokens, lengths)
    assert n == 11 + 6 + 2 + 0
    wider = torch.cat([tokens, torch.zeros(4, 5, dtype=torch.long)], dim=1)
    loss_wider, n_wider = token_loss_sum(model, wider, lengths)
    garbage = tokens.clone()
    garbage[torch.arange(12)[None, :] >= lengths[:, None]] = 77
    loss_garbage, n_garbage = token_loss_sum(model, garbage, lengths)
    assert n_wider == n_garbage == n
    torch.testing.assert_close(loss_wider, loss)
    torch.testing.assert_close(loss_garbage, loss)


def test_row_of_length_one_has_no_targets() -> None:
    tokens = torch.tensor([[5, 0, 0]])
    loss, n = token_loss_sum(_model(), tokens, torch.tensor([1]))
    assert n == 0 and loss.item() == 0.0


def test_flops_and_parameter_count() -> None:
    # 12 d^2 per layer + 256 x d tied head + 64 x d positions + 3 layer norms of 2 d.
    assert count_parameters(_model()) == 12 * 64 * 64 + 256 * 64 + MAX_SEQ_LEN * 64 + 3 * 128
    assert model_flops_per_token(MODEL, 64) == 6 * (12 * 64 * 64 + 256 * 64) + 12 * 64 * 64
    # the closed form is the rule every model's count follows (model.matmul_parameters)
    assert matmul_parameters(_model()) == 12 * 64 * 64 + 256 * 64
    assert model_flops_per_token(MODEL, 64, _model()) == model_flops_per_token(MODEL, 64)


def test_lr_schedule() -> None:
    cfg = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(4, cfg, 110) == pytest.approx(0.5)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    assert lr_at(500, cfg, 110) == pytest.approx(0.1)
    lrs = [lr_at(s, cfg, 110) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs[:-1], lrs[1:], strict=True))
    assert lr_at(0, OptimConfig(lr=2.0, warmup_steps=0), 10) == pytest.approx(2.0)


def test_set_lr() -> None:
    optimizer = build_optimizer(_model(), OptimConfig(), use_gpu=False)
    set_lr(optimizer, 0.123)
    assert [g["lr"] for g in optimizer.param_groups] == [0.123, 0.123]


def test_weight_decay_only_on_matrices() -> None:
    optimizer = build_optimizer(_model(), OptimConfig(weight_decay=0.1), use_gpu=False)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


def test_adamw8bit_trains_on_cpu() -> None:
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="adamw8bit", lr=3e-3), use_gpu=False)
    losses = _train(model, optimizer, 20)
    assert math.isfinite(losses[-1]) and losses[-1] < 0.7 * losses[0]


def test_adamw8bit_state_round_trip_is_bitwise() -> None:
    cfg = OptimConfig(name="adamw8bit", lr=3e-3)
    model = _model()
    optimizer = build_optimizer(model, cfg, use_gpu=False)
    _train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed = _model(seed=123)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = build_optimizer(resumed, cfg, use_gpu=False)
    resumed_optimizer.load_state_dict(saved["optim"])
    _train(model, optimizer, 1)
    _train(resumed, resumed_optimizer, 1)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name


@pytest.mark.parametrize(("name", "low", "high"), [("adamw8bit", 1.5, 3.0), ("adamw", 7.9, 8.1)])
def test_optimizer_state_bytes_per_parameter(name: str, low: float, high: float) -> None:
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name=name), use_gpu=False)
    assert optimizer_state_bytes(optimizer) == 0  # state is allocated lazily, at the first step
    _train(model, optimizer, 1)
    assert low < optimizer_state_bytes(optimizer) / count_parameters(model) < high


def test_bytes_per_parameter_table_matches_the_measured_adamw_state() -> None:
    model = _model()
    optimizer = build_optimizer(model, OptimConfig(name="adamw"), use_gpu=False)
    loss, _ = token_loss_sum(model, *_batch())
    loss.backward()
    optimizer.step()
    assert optimizer_state_bytes(optimizer) / count_parameters(model) == pytest.approx(8.0, abs=0.01)
    assert training_bytes_per_param("adamw", "exact") == 24
    assert training_bytes_per_param("adamw8bit", "ddp") == 14


class ResumingEnv:
    """LocalEnv (tests/localenv.py) that resumes from `resume_from` and writes its final
    checkpoint into `folder`."""

    @staticmethod
    def make(resume_from, folder):
        from pathlib import Path

        from localenv import LocalEnv

        from elastic_train.training.checkpoint import write_checkpoint

        class Env(LocalEnv):
            def latest_checkpoint_dir(self):
                return resume_from

            def save_checkpoint(self, snap, step, final):
                super().save_checkpoint(snap, step, final)
                if final:
                    write_checkpoint(snap, Path(folder))

        return Env


def test_a_resume_trains_with_the_configs_betas_and_weight_decay_not_the_checkpoints(
        small_dataset, tmp_path):
    """optim.beta1, beta2 and weight_decay changed on a resume are what it trains with (the
    checkpoint's optimizer state carried the old ones back, silently, while config.yaml said
    the new); unchanged, the run's own."""
    from conftest import TINY
    from localenv import train_locally

    from elastic_train.config import load_config
    from elastic_train.training.checkpoint import read_shards

    base = [*TINY, f"data.path={small_dataset}", "train.grad_reduce=exact"]
    first = tmp_path / "first"
    train_locally(load_config(None, [*base, "train.max_steps=3"]),
                  env_cls=lambda *a: ResumingEnv.make(None, first)(*a))
    changed = ["optim.weight_decay=0.0", "optim.beta1=0.8", "optim.beta2=0.99"]
    runs = {}
    for name, extra in (("same", []), ("changed", changed)):
        out = tmp_path / name
        train_locally(load_config(None, [*base, "train.max_steps=5", *extra]),
                      env_cls=lambda *a, out=out: ResumingEnv.make(str(first), out)(*a))
        runs[name] = read_shards(out, "optimizer")["param_groups"]
    assert [(g["betas"], g["weight_decay"]) for g in runs["same"]] == [((0.9, 0.95), 0.1),
                                                                      ((0.9, 0.95), 0.0)]
    assert [(g["betas"], g["weight_decay"]) for g in runs["changed"]] == [((0.8, 0.99), 0.0),
                                                                         ((0.8, 0.99), 0.0)]
