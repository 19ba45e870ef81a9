"""The training loop's own memory levels off: no epoch leaves anything behind.

Run in one process, without Ray, for 40 epochs of the small data set: long enough to see the
plateau (the allocators warm up for the first ~14 epochs, as the batches' shapes come round),
which the Ray runs of the other tests (15 epochs) end too early to show."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY
from localenv import train_locally

from elastic_train import load_config

pytestmark = pytest.mark.unit

EPOCHS = 40


def test_the_loops_own_memory_levels_off_over_many_epochs(small_dataset, tmp_path):
    torch.set_num_threads(1)
    cfg = load_config(None, [*TINY, f"data.path={small_dataset}", f"run.storage_path={tmp_path}",
                             "run.name=memory", f"train.epochs={EPOCHS}", "train.max_steps=100000"])
    env = train_locally(cfg)
    own = {}
    for rec in env.steps:
        own[rec["epoch"]] = rec["rss_private_bytes"]  # the last step of each epoch
    curve = [round(own[e] / 2**20) for e in sorted(own)]
    print(f"the loop's own memory at the end of each epoch (MiB): {curve}")
    assert sorted(own) == list(range(EPOCHS))
    half, last = own[EPOCHS // 2], own[EPOCHS - 1]
    # a leak of one epoch's batches (~1 MiB here) each epoch would add ~20 MiB over the second half
    assert last - half < 0.02 * half, curve
