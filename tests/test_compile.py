"""train.compile: bounded recompiles over an epoch of the embedded corpus, and the exact
reduction's bitwise promises kept with Inductor-compiled code (1 worker against 2, a resumed
process against an uninterrupted one), the resumed process warm from the run folder's cache.

The bitwise pairs run the real loop (`train_loop`) in fresh gloo processes (ranks.py): a fresh
process compiles, or loads, its graphs from nothing, as a restarted Ray worker does. The first
world compiles (1-3 minutes of Inductor on a loaded 2-core machine); the others load its graphs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from localenv import LocalEnv, train_locally
from ranks import run_ranks

from elastic_train.config import OptimConfig, batch_tokens, load_config, num_partitions
from elastic_train.data.blocks import iter_rank_steps, make_reader
from elastic_train.data.dataset import inspect_dataset
from elastic_train.data.plan import StreamSpec
from elastic_train.data.prepare import default_corpus_dir
from elastic_train.preflight.inputs import data_tables
from elastic_train.training.checkpoint import load_checkpoint, write_checkpoint
from elastic_train.training.compile import compile_model
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer

STEPS, SAVE_EVERY = 6, 3
# Graphs over an epoch: one with symbolic rows and length, one for single-row micro-batches
# (dynamo specialises a size of 1). Without dynamic=True from the first call it is 3 or more,
# and which kernel computes a shape depends on the order shapes came in.
MAX_GRAPHS_PER_EPOCH = 2


@pytest.mark.slow  # it compiles (~11 s): out of the fast tiers
def test_an_epoch_of_the_embedded_corpus_compiles_at_most_two_graphs():
    """Every micro-batch of one epoch of the embedded corpus through the real batcher (its
    token budget and length buckets), through the compiled GPT. Forward only, without grad:
    grad mode is one global guard, alike for every shape, and the backward graph comes with its
    forward's, so the count is a training epoch's at half the cost."""
    from torch._dynamo.utils import counters

    cfg = load_config(None, ["model.n_layer=1", "model.d_model=32", "model.n_head=2"])
    info = inspect_dataset(str(default_corpus_dir()))
    cfg.data.path = info.path
    table = data_tables(cfg, info).train
    spec = StreamSpec(num_partitions(cfg), batch_tokens(cfg)[0], cfg.data.shuffle_window,
                      cfg.data.seed, cfg.data.bucketing)
    torch.manual_seed(0)
    model = build_model(cfg.model, info.max_length)
    loss = LossModule(model)
    torch._dynamo.reset()
    counters.clear()
    compile_model(model, [], backend="eager")
    shapes = set()
    reader = make_reader("pyarrow", table)
    try:
        for micro_batches, _ in iter_rank_steps(reader, spec, partitions=list(range(spec.num_partitions)),
                                                epoch=0):
            if not micro_batches:
                break
            for mb in micro_batches:
                shapes.add(mb.tokens.shape)
                with torch.no_grad():
                    loss(mb.to_batch(torch.device("cpu")))
    finally:
        reader.close()
        torch._dynamo.reset()
    assert len(shapes) > 20  # many shapes came in ...
    assert 1 <= counters["stats"]["unique_graphs"] <= MAX_GRAPHS_PER_EPOCH, dict(counters["stats"])


class RunEnv(LocalEnv):
    """One rank of a run_ranks gloo group running the real loop, writing every checkpoint (each
    rank its share) under `folder/ckpt/<step>`, resuming from `resume_from`, keeping events."""

    def __init__(self, *args, resume_from: str | None = None) -> None:
        super().__init__(*args)
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.resume_from = resume_from
        self.events: list[dict] = []

    def latest_checkpoint_dir(self) -> str | None:
        return self.resume_from

    def save_checkpoint(self, snap: dict | None, step: int, final: bool) -> None:
        self.last_saved_step = step
        write_checkpoint(snap, Path(self.folder, "ckpt", str(step)))

    def log_event(self, record: dict) -> None:
        self.events.append(record)


def compile_config(data: str, storage: str, name: str, cache: str):
    return load_config(None, [*TINY, f"data.path={data}", f"train.max_steps={STEPS}",
                              f"checkpoint.every_steps={SAVE_EVERY}", "train.grad_reduce=exact",
                              "model.dropout=0.1", "train.compile=true", f"run.storage_path={storage}",
                              f"run.name={name}", f"train.compile_cache_dir={cache}"])


def _run_worker(rank: int, world_size: int, cfg, folder: str, resume_from: str | None) -> None:
    made = {}

    def env_cls(*args):
        made["env"] = RunEnv(*args, resume_from=resume_from)
        return made["env"]

    train_locally(cfg, folder=folder, env_cls=env_cls)
    events = [e for e in made["env"].events if e.get("event") == "compile"]
    Path(folder, f"compile-events-{rank}.json").write_text(json.dumps(events))


def final_weights(folder: Path) -> dict[str, torch.Tensor]:
    cfg = load_config(None, TINY + ["model.dropout=0.1"])
    model = build_model(cfg.model, 128)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    load_checkpoint(folder / "ckpt" / str(STEPS), model, optimizer, restore_rng=False)
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(small_dataset, tmp_path_factory):
    """Three runs, each in fresh processes: 1 worker uninterrupted (it compiles, on "node a"),
    2 workers uninterrupted (node a's cache), and 1 worker resumed from the first run's
    checkpoint at step SAVE_EVERY on "node b", whose cache is empty: it loads the run folder's."""
    tmp = tmp_path_factory.mktemp("compile")
    storage = tmp / "storage"
    out = {}
    for key, world_size, cache, resume in (("w1", 1, "node-a", None), ("w2", 2, "node-a", None),
                                           ("resumed", 1, "node-b", "w1")):
        cfg = compile_config(small_dataset, str(storage), "run", str(tmp / cache))
        folder = tmp / key
        folder.mkdir()
        resume_from = str(tmp / resume / "ckpt" / str(SAVE_EVERY)) if resume else None
        run_ranks(_run_worker, world_size, tmp, cfg, str(folder), resume_from,
                  start_method="forkserver")
        out[key] = (final_weights(folder), json.loads((folder / "compile-events-0.json").read_text()))
    out["storage"] = storage / "run"
    return out


@pytest.mark.slow  # gloo processes, no Ray; each compiles: ~100 s, out of the fast tiers
def test_compiled_training_is_the_same_to_the_bit_on_1_and_2_workers(runs):
    (w1, events1), (w2, _) = runs["w1"], runs["w2"]
    for name, p in w1.items():
        assert torch.equal(w2[name], p), name
    assert events1[0]["compiled"] > 0 and events1[0]["step"] == 1  # the first step compiled


@pytest.mark.slow  # gloo processes, no Ray; each compiles: ~100 s, out of the fast tiers
def test_a_resumed_process_on_a_new_node_loads_the_cache_and_ends_to_the_bit(runs):
    (w1, _), (resumed, events) = runs["w1"], runs["resumed"]
    for name, p in w1.items():
        assert torch.equal(resumed[name], p), name
    assert list((runs["storage"] / "compile_cache").glob("torch-*/rank-0.bin"))
    first = events[0]
    assert first["step"] == SAVE_EVERY + 1
    assert first["seeded_artifacts"] > 0  # node b's empty cache filled from the run folder
    assert first["loaded"] > 0 and sum(e["compiled"] for e in events) == 0, events


@pytest.mark.unit
@pytest.mark.parametrize("overrides, message", [
    (["train.compile=true", "fault.recovery=in_place"], "train.compile with fault.recovery=in_place"),
    (["train.compile=true", "train.sharding=fsdp"], "train.compile with train.sharding=fsdp"),
    (["train.compile_modules=[Block]"], "set train.compile=true too"),
])
def test_what_compile_does_not_support_is_refused_by_name(overrides, message):
    from elastic_train.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.unit
def test_compile_modules_naming_no_module_of_the_model_is_refused_naming_it():
    model = build_model(load_config(None, TINY).model, 128)
    with pytest.raises(ValueError, match="no module of class Blok in GPT .*Block"):
        compile_model(model, ["Blok"], backend="eager")
    assert compile_model(model, ["Block"], backend="eager") == 1  # TINY: one layer
