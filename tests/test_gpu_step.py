"""The step's host work, checked on CPU for the GPU: no host sync per micro-batch, the device
defaults settled from the config, batch columns rounded without changing what is trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_train.config import ModelConfig, load_config
from elastic_train.data.batches import MicroBatch
from elastic_train.observe.profile import StepProfiler
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.step import StepSetup, train_step

pytestmark = pytest.mark.unit


def _micro_batches(count: int, rows: int = 2, width: int = 9) -> list[MicroBatch]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(count):
        lengths = rng.integers(2, width + 1, size=rows)
        lengths[0] = width
        tokens = np.zeros((rows, width), dtype=np.int64)
        for r, n in enumerate(lengths):
            tokens[r, :n] = rng.integers(1, 256, size=n)
        out.append(MicroBatch(i, np.arange(rows) + 10 * i, tokens, lengths.astype(np.int64)))
    return out


def _syncs_per_step(micro_batches: list[MicroBatch], exact: bool) -> float:
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=1, n_head=2, d_model=16), 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # no host sync of its own on CPU
    reducer = ExactGradSum(model, torch.device("cpu")) if exact else None
    setup = StepSetup(device=torch.device("cpu"), world_size=1, exact=reducer)
    profiler = StepProfiler([2, 3], torch.device("cpu"))
    targets = sum(mb.targets for mb in micro_batches)
    for step in range(1, 4):
        with profiler.step(step):
            train_step(LossModule(model), model, optimizer, micro_batches, setup=setup,
                       data_targets=targets, step=step, lr=1e-3)
        summary = profiler.after_step(step)
    return summary["host_syncs_per_step"]


@pytest.mark.parametrize("exact", [False, True])
def test_a_step_syncs_with_the_device_as_often_whatever_its_micro_batches(exact):
    # the norm (is it finite?) and the loss for the record, read together once a step: never
    # once a micro-batch (one process: its counters never go to the device and back)
    assert _syncs_per_step(_micro_batches(4), exact) == _syncs_per_step(_micro_batches(1), exact) == 1


def test_rounded_columns_train_the_same_tokens():
    mb = _micro_batches(1)[0]
    plain, rounded = mb.to_batch(torch.device("cpu")), mb.to_batch(torch.device("cpu"), 8, 16)
    assert rounded["tokens"].shape == (2, 16) and (rounded["labels"][:, 9:] == -100).all()
    assert torch.equal(rounded["labels"][:, :9], plain["labels"])
    assert mb.to_batch(torch.device("cpu"), 64, 12)["tokens"].shape == (2, 12)  # never past the cap
    torch.manual_seed(0)
    model = LossModule(build_model(ModelConfig(n_layer=1, n_head=2, d_model=16), 16)).eval()
    (a, na), (b, nb) = model(plain), model(rounded)
    assert int(na) == int(nb) and torch.allclose(a, b, rtol=1e-5)


def test_gpu_workers_get_device_defaults_and_cpu_workers_keep_theirs():
    cpu = load_config(None, [])  # the batch sizes follow from the data set (preflight/inputs.py)
    assert (cpu.train.precision, cpu.data.micro_batch_tokens, cpu.scaling.cpus_per_worker,
            cpu.data.pad_multiple) == ("fp32", None, 1.0, 1)
    # on CPU the micro-batch of a step set alone also follows from the data (was pinned at 2048:
    # data.max_seq_len=4096 was refused for a micro-batch nobody set)
    assert load_config(None, ["data.global_batch_tokens=16384"]).data.micro_batch_tokens is None
    gpu = load_config(None, ["scaling.use_gpu=true", "scaling.min_workers=1", "scaling.max_workers=1",
                             "data.global_batch_tokens=65536"])
    assert (gpu.train.precision, gpu.data.micro_batch_tokens, gpu.scaling.cpus_per_worker,
            gpu.data.pad_multiple) == ("bf16", None, 4.0, 64)  # the micro-batch: with the data
    mine = load_config(None, ["scaling.use_gpu=true", "train.precision=fp32", "data.micro_batch_tokens=4096"])
    assert (mine.train.precision, mine.data.micro_batch_tokens) == ("fp32", 4096)


def test_batch_sizes_from_the_data_take_the_gpu_rule_on_gpu_workers():
    """Both batch keys unset on GPU workers: the step's budget from the data set (the default
    corpus: 16384, as on CPU), then the GPU's few, large micro-batches (config/devices.py)."""
    from elastic_train.data.dataset import inspect_dataset
    from elastic_train.data.prepare import default_corpus_dir
    from elastic_train.preflight.inputs import fill_batch_tokens

    info = inspect_dataset(str(default_corpus_dir()))
    for gpu, micro in ((False, 2048), (True, 16384)):
        cfg = load_config(None, [f"scaling.use_gpu={str(gpu).lower()}", "scaling.min_workers=1",
                                 "scaling.max_workers=1", "data.max_seq_len=512"])
        fill_batch_tokens(cfg, info)
        assert (cfg.data.micro_batch_tokens, cfg.data.global_batch_tokens) == (micro, 16384)
    long_rows = load_config(None, ["data.max_seq_len=4096", "data.global_batch_tokens=32768"])
    fill_batch_tokens(long_rows, info)  # the micro-batch holds the longest row
    assert (long_rows.data.micro_batch_tokens, long_rows.data.global_batch_tokens) == (4096, 32768)
