"""Choosing the gradient reduction (train.grad_reduce=auto), keeping the choice in checkpoints, and
the driver's refusal of a compression that the chosen reduction cannot honour."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from elastic_train.config import ConfigError, choose_grad_reduce, load_config
from elastic_train.preflight.checks import check_reduce
from elastic_train.training.checkpoint import read_state, snapshot, write_checkpoint
from elastic_train.training.optim import training_bytes_per_param
from elastic_train.training.step import TrainState

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("overrides, use_gpu, saved, chosen, why", [
    ([], False, None, "exact", "auto: CPU workers"),
    ([], True, None, "exact", "auto: GPU workers"),
    (["train.grad_compression=bf16"], True, None, "ddp", "auto: train.grad_compression=bf16 needs ddp"),
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
    check_reduce(load_config(None, ["train.grad_compression=fp16"]), None)  # auto: ddp for it
    exact = {**saved, "train_state": {**saved["train_state"], "grad_reduce": "exact"}}
    with pytest.raises(ConfigError, match=r"reduces exactly \(auto: kept from the run's checkpoint"):
        check_reduce(load_config(None, ["train.grad_compression=fp16"]), exact)


def test_memory_per_parameter_counts_the_resolved_reduction_and_powersgd():
    assert training_bytes_per_param("adamw", "exact") == 24
    assert training_bytes_per_param("adamw", "ddp") == 20
    assert training_bytes_per_param("adamw", "ddp", "powersgd") == 24
    assert training_bytes_per_param("adamw", "ddp", "bf16") == 20


class FakeEnv:
    """What restore_powersgd uses of a worker's env."""

    device = torch.device("cpu")
    world_rank = 0

    def __init__(self, world_size: int) -> None:
        self.world_size, self.events = world_size, []

    def log_event(self, record: dict) -> None:
        self.events.append(record)


def test_powersgd_state_comes_back_per_rank_at_the_same_size_and_warms_up_after_a_resize(tmp_path):
    from elastic_train.training.build import restore_powersgd
    from elastic_train.training.commhooks import new_powersgd_state, powersgd_state_dict

    t = load_config(None, ["train.grad_reduce=ddp", "train.grad_compression=powersgd"]).train
    ranks = []
    for rank in range(2):  # what two ranks would have after 30 steps: their own error feedback
        state = new_powersgd_state(t)
        state.iter, state.error_dict[0] = 30, torch.full((5,), float(rank + 1))
        ranks.append(powersgd_state_dict(state))
    model = torch.nn.Linear(2, 2)
    for rank in range(2):  # each rank writes its own share, its PowerSGD state with it
        snap = snapshot(model, torch.optim.AdamW(model.parameters()), None,
                        asdict(TrainState(step=30)), {}, 2, shard=rank, shards=2,
                        comm_hook={"kind": "powersgd", "world_size": 2, "state": ranks[rank]})
        write_checkpoint(snap, tmp_path / "ckpt")

    same = FakeEnv(world_size=2)
    same.world_rank = 1
    resumed = new_powersgd_state(t)
    restore_powersgd(resumed, same, str(tmp_path / "ckpt"), step=30)
    assert resumed.iter == 30 and torch.equal(resumed.error_dict[0], torch.full((5,), 2.0))
    assert not same.events

    resized = FakeEnv(world_size=3)
    fresh = new_powersgd_state(t)
    restore_powersgd(fresh, resized, str(tmp_path / "ckpt"), step=30)
    assert fresh.iter == 0 and not fresh.error_dict  # plain all-reduce for the warm-up steps
    assert [(e["event"], e["warmup_steps"]) for e in resized.events] == [
        ("powersgd_reset", t.powersgd_warmup_steps)]
