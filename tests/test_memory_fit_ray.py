"""A model too large for its ranks, refused by the workers before they build it (training/
memory.py): the run ends in seconds with the one reason, without a restart, and the console never
says it waits for workers while the run's own worker decides."""

from __future__ import annotations

import os
import time

import pytest
import torch
from conftest import TINY

from elastic_train import load_config
from elastic_train.api import TrainingFailed, train

pytestmark = pytest.mark.ray

DRIVER_PID = os.getpid()


def huge_on_workers(vocab_size: int, max_seq_len: int, **kwargs):
    """Small on the driver (its checks pass: what a remote cluster's driver cannot know), the
    issue's 39B GPT on the workers. Never built there for real: the factory refuses to be called
    off the meta device, so a missing check fails this test instead of filling the machine."""
    from elastic_train.config import ModelConfig
    from elastic_train.training.model import GPT

    if os.getpid() == DRIVER_PID:
        return GPT(ModelConfig(n_layer=1, n_head=2, d_model=32), max_seq_len, vocab_size)
    if torch.empty(0).device.type != "meta":
        raise RuntimeError("the worker built the huge model for real: nothing refused it")
    return GPT(ModelConfig(n_layer=48, n_head=64, d_model=8192), max_seq_len, vocab_size)


def test_workers_refuse_a_model_that_cannot_fit_before_building_it(ray_cluster, small_dataset,
                                                                    tmp_path, capsys):
    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=huge", "scaling.max_failures=3"])
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"38\.66B parameters does not fit") as info:
        train(cfg, model_fn=huge_on_workers)
    assert time.monotonic() - started < 60
    summary = info.value.summary
    assert summary["status"] == "failed" and summary["restarts"] == 0, summary
    assert "what would fit" in summary["reason"] and "\n" not in summary["reason"]
    assert "waiting for workers" not in capsys.readouterr().err
