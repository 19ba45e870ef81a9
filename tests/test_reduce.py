"""Choosing the gradient reduction (train.grad_reduce=auto), keeping the choice in checkpoints, and
the driver's refusal of a compression that the chosen reduction cannot honour."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from elastic_train.checkpoint import read_state, snapshot, write_checkpoint
from elastic_train.checks import check_reduce
from elastic_train.config import ConfigError, choose_grad_reduce, load_config
from elastic_train.loop import TrainState
from elastic_train.optim import training_bytes_per_param

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides, use_gpu, saved, chosen, why", [
    ([], False, None, "exact", "auto: CPU workers"),
    ([], True, None, "ddp", "auto: GPU workers"),
    (["train.deterministic=true"], True, None, "exact", "auto: train.deterministic=true"),
    ([], False, "ddp", "ddp", "kept from the run's checkpoint"),  # a GPU run resumed on CPUs
    ([], True, "exact", "exact", "kept from the run's checkpoint"),
    (["train.grad_reduce=ddp"], False, "exact", "ddp", "train.grad_reduce=ddp"),  # as set
    (["train.grad_reduce=exact"], True, None, "exact", "train.grad_reduce=exact"),
])
def test_auto_chooses_by_device_and_keeps_a_saved_choice(overrides, use_gpu, saved, chosen, why):
    choice = choose_grad_reduce(load_config(None, overrides).train, use_gpu, saved)
    assert choice.chosen == chosen and why in choice.reason


def test_the_choice_is_kept_in_the_checkpoints_state(tmp_path):
    model = torch.nn.Linear(2, 2)
    state = TrainState(step=3, grad_reduce="ddp")
    snap = snapshot(model, torch.optim.AdamW(model.parameters()), None, asdict(state), {}, 2)
    write_checkpoint(snap, tmp_path / "ckpt")
    saved = read_state(tmp_path / "ckpt")
    assert TrainState(**saved["train_state"]) == state
    # the driver reads it so: auto on CPU workers may compress a run that chose ddp on GPUs
    check_reduce(load_config(None, ["train.grad_compression=fp16"]), saved)
    with pytest.raises(ConfigError, match=r"reduces exactly \(auto: CPU workers\)"):
        check_reduce(load_config(None, ["train.grad_compression=fp16"]), None)


def test_memory_per_parameter_counts_the_resolved_reduction_and_powersgd():
    assert training_bytes_per_param("adamw", "exact") == 24
    assert training_bytes_per_param("adamw", "ddp") == 20
    assert training_bytes_per_param("adamw", "ddp", "powersgd") == 24
    assert training_bytes_per_param("adamw", "ddp", "bf16") == 20
