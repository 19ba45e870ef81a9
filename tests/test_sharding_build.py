"""train.sharding=fsdp builds each rank's rows only, and the run is the unsharded run to the bit.

The real build (`build_training`) and loop (`train_loop`) of the embedded GPT on real gloo
processes, exact reduction, the same seed: fsdp at W = 1 and 2 and an unsharded run at W = 1 and 2
start from the same weights (fsdp: built on the meta device, each rank drawing every whole
parameter from the same RNG stream and keeping its rows) and end every step on the same loss.
Every step is clipped (train.grad_clip=0.05), so the W- and sharding-independent norm is what the
update uses. Before the fix the fsdp runs updated a float64 master with float64 AdamW and the
losses parted from the unsharded run's in the 6th digit.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from localenv import LocalEnv, train_locally
from ranks import run_ranks
from torch.distributed.tensor import DTensor

from elastic_train.config import load_config
from elastic_train.data.dataset import inspect_dataset
from elastic_train.preflight.inputs import data_tables
from elastic_train.training.build import build_training

pytestmark = pytest.mark.dist


def config(data: str, sharding: str):
    return load_config(None, [*TINY, f"data.path={data}", f"train.sharding={sharding}",
                              "train.grad_reduce=exact", "train.max_steps=4",
                              "train.grad_clip=0.05", "train.seed=7", "model.n_layer=2"])


class RankEnv(LocalEnv):
    """`LocalEnv` as one rank of run_ranks' gloo group."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()


def whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, as float32 values (a collective when sharded)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, data: str, sharding: str, out: str) -> None:
    cfg = config(data, sharding)
    tables = data_tables(cfg, inspect_dataset(data))
    built = build_training(cfg, RankEnv(tables.train))
    meta_left = [n for n, p in built.raw_model.named_parameters() if p.is_meta]
    local_rows = {n: p.to_local().shape[0] for n, p in built.raw_model.named_parameters()
                  if isinstance(p, DTensor)}
    initial = whole(built.raw_model)
    del built
    env = train_locally(cfg, env_cls=RankEnv)
    if rank == 0:
        torch.save({"initial": initial, "losses": [s["loss"] for s in env.steps],
                    "meta_left": meta_left, "local_rows": local_rows}, out)


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_build")
    results = {}
    for sharding, world_size in (("fsdp", 2), ("fsdp", 1), ("none", 2), ("none", 1)):
        out = tmp / f"{sharding}{world_size}.pt"
        run_ranks(_worker, world_size, tmp, small_dataset, sharding, str(out),
                  start_method="forkserver")
        results[sharding, world_size] = torch.load(out)
    return results


def test_fsdp_initial_weights_are_the_unsharded_builds_to_the_bit(runs):
    reference = runs["none", 1]["initial"]
    for key, result in runs.items():
        assert result["meta_left"] == [], key
        assert result["initial"].keys() == reference.keys(), key
        for name, p in reference.items():
            assert torch.equal(result["initial"][name], p), (key, name)
    # at W=2 each rank held half the rows of the embedding, not the whole of it
    assert runs["fsdp", 2]["local_rows"]["wte.weight"] == reference["wte.weight"].shape[0] // 2


def test_fsdp_and_unsharded_runs_end_on_the_same_loss_to_the_bit(runs):
    reference = runs["none", 1]["losses"]
    assert len(reference) == 4 and len(set(reference)) == 4
    for key, result in runs.items():
        assert result["losses"] == reference, (key, json.dumps(result["losses"]), reference)


def test_a_directly_built_gpt_draws_the_same_scheme():
    """GPT(...) outside build_gpt initialises in place with `initial_value` (layer norms 1 and
    0, the residual projections scaled down): not left at torch's defaults."""
    from elastic_train.config import ModelConfig
    from elastic_train.training.model import GPT

    model = GPT(ModelConfig(n_layer=2, n_head=2, d_model=32), 16, 64)
    assert torch.equal(model.blocks[0].ln1.weight, torch.ones(32))
    assert torch.equal(model.blocks[0].ln1.bias, torch.zeros(32))
    std = model.blocks[0].attn.proj.weight.std().item()
    assert 0.003 < std < 0.012  # 0.02 / sqrt(2 * 2) = 0.01, against nn.Linear's ~0.1

