"""train.sharding=fsdp over real gloo processes: exact mode is the same to the bit at W = 1, 2, 3
as one process, its checkpoints load at any world size and across sharding=none <-> fsdp, a
non-finite gradient in one rank's shard skips the step on every rank, and activation
checkpointing and bf16 compute as the unsharded run with the same setting.

Two module fixtures: `worlds` runs the three worlds (W=2 first: it writes the checkpoint the
others resume), `settings` one W=2 world through the other settings; each test asserts one
property of what they saved. The ranks fork from a server that imported torch and FSDP once
(ranks.py): spawning them cost 20-25 s of the 2-core machine's time, forking about 1 s.

Tolerance, ddp reduction with bf16 (the others are torch.equal): relative loss difference at
each step < 1e-2 against the unsharded bf16 run. FSDP's bf16 policy casts the parameters
themselves to bf16 (embeddings and layer norms too, which autocast leaves in fp32) and
accumulates the micro-batches' unsharded gradients in bf16 (unit round-off 2^-8 ~ 3.9e-3), so
the two runs agree to a few bf16 ulps, not bits; a loss is a mean over hundreds of tokens, so
that rounding moves it by far less than 1e-2, while a real bug (a lost gradient scale, a skipped
or doubled micro-batch, a wrong sum) moves it by 5-50%.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY
from localenv import LocalEnv, train_locally
from ranks import run_ranks
from test_dist import DROPOUT_MODEL, global_batch

from elastic_train.config import OptimConfig, load_config
from elastic_train.export import load_trained
from elastic_train.training.checkpoint import (
    BEST_POINTER,
    load_checkpoint,
    read_shards,
    snapshot,
    write_checkpoint,
)
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer
from elastic_train.training.reduce import ExactGradSum
from elastic_train.training.sharding import load_sharded_checkpoint, shard_model, sharded_snapshot
from elastic_train.training.step import (
    StepSetup,
    TrainState,
    forward_backward,
    poison_gradient,
    train_step,
)

pytestmark = pytest.mark.dist

PARTITIONS = 5  # uneven at W = 2 and 3: some ranks run dry micro-batches to join each reduce-scatter
STEPS, SAVE_AT, POISON_AT = 4, 2, 1
CPU = torch.device("cpu")
CHECKPOINTED = replace(DROPOUT_MODEL, gradient_checkpointing=True)
SETTINGS = {"checkpointing": {"model_cfg": CHECKPOINTED}, "bf16": {"precision": "bf16"}}


def batches(step: int):
    return global_batch(PARTITIONS, seed=step)


def build_sharded(world_size: int, *, exact: bool = True, precision: str = "fp32",
                  model_cfg=DROPOUT_MODEL):
    torch.manual_seed(0)
    model = build_model(model_cfg, 64)
    root = LossModule(model)
    sharded = shard_model(root, model, exact=exact, precision=precision,
                          reshard_after_forward=True, shard_modules=[], device=CPU)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), use_gpu=False)
    # a small clip: every step is clipped, so the W-independent norm is what the update uses
    setup = StepSetup(device=CPU, world_size=world_size, precision=precision, grad_clip=0.05,
                      seed=3, sharded=sharded)
    return model, root, optimizer, setup


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective: every rank calls it)."""
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def train(rank, world_size, model, root, optimizer, setup, steps, save_to: Path | None = None,
          poison_at: int | None = None) -> list[tuple[float, bool]]:
    """Train `steps` (global step numbers); at `poison_at` the last rank's shard of the first
    gradient is made NaN. Returns each step's (loss, skipped) as this rank saw it."""
    seen = []
    for step in steps:
        mbs = batches(step)
        mine = [mb for mb in mbs if mb.partition % world_size == rank]
        bad = poison_gradient if step == poison_at and rank == world_size - 1 else None
        result = train_step(root, model, optimizer, mine, setup=setup, step=step, lr=1e-2,
                            data_targets=sum(mb.targets for mb in mbs), poison=bad)
        seen.append((result.loss, result.skipped))
        if save_to is not None and step + 1 == SAVE_AT:
            snap = sharded_snapshot(model, optimizer, asdict(TrainState(step=SAVE_AT)), {},
                                    shard=rank, shards=world_size)
            write_checkpoint(snap, save_to)
    return seen


def step_one_grads(rank: int, world_size: int, **build) -> dict[str, torch.Tensor]:
    """Step one's summed gradient, whole, as float32 values."""
    model, root, _, setup = build_sharded(world_size, **build)
    mbs = batches(0)
    forward_backward(root, [mb for mb in mbs if mb.partition % world_size == rank], setup=setup,
                     global_targets=sum(mb.targets for mb in mbs), step=17)
    return {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, out: str, fsdp_ckpt: str, none_ckpt: str) -> None:
    results = {"grads": step_one_grads(rank, world_size)}
    writer = world_size == 2
    model, root, optimizer, setup = build_sharded(world_size)
    train(rank, world_size, model, root, optimizer, setup, range(STEPS),
          Path(fsdp_ckpt) if writer else None)
    results["final"] = full(model)
    if not writer:  # resume the W=2 checkpoint at this world size
        model, root, optimizer, setup = build_sharded(world_size)
        assert load_sharded_checkpoint(fsdp_ckpt, model, optimizer)["step"] == SAVE_AT
        train(rank, world_size, model, root, optimizer, setup, range(SAVE_AT, STEPS))
        results["resumed"] = full(model)
        model, _, optimizer, _ = build_sharded(world_size)  # an unsharded run's checkpoint
        load_sharded_checkpoint(none_ckpt, model, optimizer)
        results["from_none"] = full(model)
        results["from_none_moments"] = {
            n: optimizer.state[p]["exp_avg"].full_tensor() for n, p in model.named_parameters()}
    # the NaN policy: the last rank's shard poisoned after the reduction at step POISON_AT
    model, root, optimizer, setup = build_sharded(world_size)
    seen = train(rank, world_size, model, root, optimizer, setup, range(STEPS), poison_at=POISON_AT)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, seen)
    results["poisoned_steps"], results["poisoned"] = everyone, full(model)
    if world_size == 1:  # a run that never trained step POISON_AT: what a skip must leave
        model, root, optimizer, setup = build_sharded(world_size)
        train(rank, world_size, model, root, optimizer, setup,
              [s for s in range(STEPS) if s != POISON_AT])
        results["without_step"] = full(model)
    if rank == 0:
        torch.save(results, f"{out}.{world_size}")


def none_checkpoint(folder: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An unsharded model after one AdamW step, checkpointed by the unsharded path."""
    torch.manual_seed(1)
    model = build_model(DROPOUT_MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), use_gpu=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    write_checkpoint(snapshot(model, optimizer, None, asdict(TrainState(step=1)), {}, 1), folder)
    return model, optimizer


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    out, fsdp_ckpt, none_ckpt = str(tmp / "out"), tmp / "fsdp_ckpt", tmp / "none_ckpt"
    none_model, none_optimizer = none_checkpoint(none_ckpt)
    for world_size in (2, 3, 1):
        run_ranks(_worker, world_size, tmp, out, str(fsdp_ckpt), str(none_ckpt),
                  start_method="forkserver")
    return {w: torch.load(f"{out}.{w}") for w in (1, 2, 3)}, fsdp_ckpt, none_model, none_optimizer


def exact_grads(model_cfg=DROPOUT_MODEL, precision: str = "fp32") -> dict[str, torch.Tensor]:
    """Step one's gradient by the unsharded exact reduction in this one process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_cfg, 64)
    reducer = ExactGradSum(model, CPU)
    setup = StepSetup(device=CPU, world_size=1, precision=precision, exact=reducer, seed=3)
    mbs = batches(0)
    forward_backward(LossModule(model), mbs, setup=setup, global_targets=sum(mb.targets for mb in mbs),
                     step=17)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_exact_fsdp_gradient_is_one_processs_to_the_bit(worlds):
    """Step one's gradient, sharded at W = 1, 2, 3, equals the unsharded exact reduction's."""
    ref = exact_grads()
    for world_size, saved in worlds[0].items():
        for name, g in ref.items():
            assert torch.equal(saved["grads"][name], g), (world_size, name)


def test_exact_fsdp_training_is_the_same_to_the_bit_at_any_world_size(worlds):
    results = worlds[0]
    for world_size in (2, 3):
        for name, p in results[1]["final"].items():
            assert p.dtype == torch.float64
            assert torch.equal(results[world_size]["final"][name], p), (world_size, name)
    assert any(not torch.equal(results[1]["final"][n], p) for n, p in full_initial().items())


def full_initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {n: p.detach().double() for n, p in build_model(DROPOUT_MODEL, 64).named_parameters()}


def test_a_checkpoint_written_at_2_resumes_at_1_and_3_to_the_bit(worlds):
    results = worlds[0]
    for world_size in (1, 3):
        for name, p in results[2]["final"].items():
            assert torch.equal(results[world_size]["resumed"][name], p), (world_size, name)


def test_checkpoints_load_across_sharding_none_and_fsdp(worlds):
    results, fsdp_ckpt, none_model, none_optimizer = worlds
    # none -> fsdp: the float32 weights and moments, upcast exactly into the float64 master
    for world_size in (1, 3):
        for name, p in none_model.named_parameters():
            assert torch.equal(results[world_size]["from_none"][name], p.double())
            assert torch.equal(results[world_size]["from_none_moments"][name],
                               none_optimizer.state[p]["exp_avg"].double())
    # fsdp -> none: the master weights rounded to float32, the moments too, with their step
    torch.manual_seed(5)
    model = build_model(DROPOUT_MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(), use_gpu=False)
    assert load_checkpoint(fsdp_ckpt, model, optimizer)["step"] == SAVE_AT
    saved = read_shards(fsdp_ckpt, "model")
    for name, p in model.named_parameters():
        assert saved[name].dtype == torch.float64 and torch.equal(p, saved[name].float())
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == torch.float32 and float(state["step"]) == SAVE_AT


def test_a_nan_in_one_ranks_shard_skips_the_step_on_every_rank(worlds):
    """The last rank's rows go bad after the reduction (the others' stay finite): the global
    norm is non-finite on every rank, so every rank skips that step and no other, and the run
    ends where a run that never trained that step does, to the bit, at W = 1, 2, 3."""
    results = worlds[0]
    expected = [s == POISON_AT for s in range(STEPS)]
    for world_size, saved in results.items():
        ranks = saved["poisoned_steps"]
        assert len(ranks) == world_size
        for seen in ranks:
            assert [skipped for _, skipped in seen] == expected, world_size
            assert seen == ranks[0] and all(math.isfinite(loss) for loss, _ in seen)
        for name, p in results[1]["without_step"].items():
            assert torch.equal(saved["poisoned"][name], p), (world_size, name)
    assert any(not torch.equal(results[1]["without_step"][n], p)
               for n, p in results[1]["final"].items())  # the skipped step would have moved it


def _settings_worker(rank: int, world_size: int, out: str) -> None:
    results = {name: step_one_grads(rank, world_size, **build) for name, build in SETTINGS.items()}
    for precision in ("fp32", "bf16"):  # the ddp reduction (GPU speed) in each precision
        model, root, optimizer, setup = build_sharded(world_size, exact=False, precision=precision)
        results[f"ddp_{precision}"] = train(rank, world_size, model, root, optimizer, setup,
                                            range(STEPS))
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_settings")
    run_ranks(_settings_worker, 2, tmp, str(tmp / "out"), start_method="forkserver")
    return torch.load(tmp / "out")


def test_activation_checkpointing_with_fsdp_is_the_unsharded_gradient_to_the_bit(settings):
    """model.gradient_checkpointing: each block's recompute in backward gathers its weights
    again and replays its dropout masks (the RNG state is saved with the activations)."""
    ref = exact_grads(CHECKPOINTED)
    for name, g in ref.items():
        assert torch.equal(settings["checkpointing"][name], g), name


def test_bf16_exact_fsdp_is_the_unsharded_bf16_gradient_to_the_bit(settings):
    """train.precision=bf16, exact: FSDP gathers the float64 master as float32 and autocast
    computes in bf16 exactly as it does on the unsharded model's float32 weights; each
    micro-batch's float32 gradient is reduce-scattered and summed in float64."""
    ref, fp32 = exact_grads(precision="bf16"), exact_grads()
    for name, g in ref.items():
        assert torch.equal(settings["bf16"][name], g), name
    assert any(not torch.equal(ref[n], g) for n, g in fp32.items())  # bf16 computed in bf16


def unsharded_losses(precision: str) -> list[float]:
    """The same steps by one unsharded process (float32 weights, autocast in `precision`)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(DROPOUT_MODEL, 64)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, warmup_steps=0), use_gpu=False)
    setup = StepSetup(device=CPU, world_size=1, precision=precision, grad_clip=0.05, seed=3)
    losses = []
    for step in range(STEPS):
        mbs = batches(step)
        result = train_step(LossModule(model), model, optimizer, mbs, setup=setup, step=step,
                            lr=1e-2, data_targets=sum(mb.targets for mb in mbs))
        losses.append(result.loss)
    return losses


def test_ddp_reduction_with_fsdp_follows_the_unsharded_run(settings):
    """fsdp's ddp reduction (fp32 reduce-scatter; bf16 parameters under train.precision=bf16)
    against one unsharded process: fp32 to float32 round-off, bf16 within the module
    docstring's tolerance, and bf16 really computing in bf16."""
    fp32, bf16 = unsharded_losses("fp32"), unsharded_losses("bf16")
    sharded_fp32 = [loss for loss, _ in settings["ddp_fp32"]]
    sharded_bf16 = [loss for loss, _ in settings["ddp_bf16"]]
    assert not any(skipped for _, skipped in settings["ddp_fp32"] + settings["ddp_bf16"])
    assert sharded_fp32 == pytest.approx(fp32, rel=1e-5)
    assert sharded_bf16 == pytest.approx(bf16, rel=1e-2)
    assert sharded_bf16[0] != sharded_fp32[0]


class RankEnv(LocalEnv):
    """`LocalEnv` as one rank of the gloo group that run_ranks made: the real loop, its
    evaluation and best checkpoints, at W > 1 without Ray."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()


def best_config(data: str):
    return load_config(None, [*TINY, f"data.path={data}", "eval.fraction=0.1", "eval.every_steps=3",
                              "eval.max_batches=2", "train.max_steps=7", "checkpoint.keep_best=true",
                              "train.sharding=fsdp"])


def _best_worker(rank: int, world_size: int, data: str, folder: str) -> None:
    env = train_locally(best_config(data), folder=folder, env_cls=RankEnv)
    if rank == 0:
        Path(folder, "evals.json").write_text(json.dumps(env.evals))


def test_keep_best_with_fsdp_writes_every_ranks_rows_and_export_loads_them(held_out_dataset,
                                                                             tmp_path):
    """checkpoint.keep_best at W=2: each rank writes its rows of the best checkpoint into one
    folder; rank 0 points best_checkpoint.json at it once every rank's are written (a barrier),
    and deletes the previous best; the run's export loads it whole."""
    run_ranks(_best_worker, 2, tmp_path, held_out_dataset, str(tmp_path), start_method="forkserver")
    evals = json.loads((tmp_path / "evals.json").read_text())
    assert [e["step"] for e in evals] == [3, 6, 7]
    best = min(evals, key=lambda e: e["eval_loss"])
    pointer = json.loads((tmp_path / BEST_POINTER).read_text())
    assert pointer == {"checkpoint": f"best_checkpoint_{best['step']:09d}", "step": best["step"],
                       "eval_loss": best["eval_loss"]}
    assert [p.name for p in tmp_path.glob("best_checkpoint_*")] == [pointer["checkpoint"]]
    state = json.loads((tmp_path / pointer["checkpoint"] / "state.json").read_text())
    assert state["sharding"] == "fsdp" and state["shards"] == 2
    assert state["train_state"]["step"] == best["step"]
    assert state["train_state"]["best_eval_loss"] == best["eval_loss"]
    (tmp_path / "config.yaml").write_text(best_config(held_out_dataset).to_yaml())
    trained = load_trained(tmp_path)
    assert trained.checkpoint.name == pointer["checkpoint"]
    saved = read_shards(trained.checkpoint, "model")  # both ranks' rows, assembled
    for name, p in trained.model.named_parameters():
        assert torch.equal(p, saved[name].float()), name


def _chunked_collectives_worker(rank: int, world_size: int, out: str) -> None:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_train.training.memory import peak_rss_bytes, return_large_frees_to_os
    from elastic_train.training.sharding import ChunkedAllGather, ChunkedReduceScatter

    def reset_peak() -> int:  # Linux: VmHWM back to the resident bytes now
        Path("/proc/self/clear_refs").write_text("5")
        return peak_rss_bytes()

    def grown_by(call) -> int:
        dist.barrier()
        before = reset_peak()
        call()
        return peak_rss_bytes() - before

    return_large_frees_to_os()  # as a worker's fsdp build: freed buffers leave the process
    generator = torch.Generator().manual_seed(rank)
    grads = torch.randn(6_000_000, dtype=torch.float32, generator=generator).to(torch.float64)
    inputs = grads.clone()
    chunked, whole = (torch.zeros(len(grads) // world_size, dtype=torch.float64) for _ in range(2))
    grown = {"chunked": grown_by(lambda: ChunkedReduceScatter()(chunked, inputs, dist.group.WORLD,
                                                               dist.ReduceOp.SUM)),
             "gloo": grown_by(lambda: dist.reduce_scatter_single(whole, grads, op=dist.ReduceOp.SUM))}
    # the all-gather of a unit's parameters: a rank's part of 11.5M float32 (an odd length: the
    # last slice is short), gathered into 2 x 46 MB
    part = torch.randn(11_500_001, generator=generator)
    gathered, reference = (torch.full((world_size * part.numel(),), float("nan")) for _ in range(2))
    work = None

    def gather() -> None:
        nonlocal work
        work = ChunkedAllGather()(gathered, part, dist.group.WORLD, async_op=True)

    grown["chunked_gather"] = grown_by(gather)
    grown["gloo_gather"] = grown_by(lambda: dist.all_gather_into_tensor(reference, part))
    # a unit of one parameter (an embedding, an untied head) of an odd number of rows (padded)
    torch.manual_seed(0)
    table = nn.Embedding(1_000_001, 16)
    before = table.weight.detach().clone()
    fully_shard(table, mesh=init_device_mesh("cpu", (world_size,)))
    table.set_custom_all_gather(ChunkedAllGather(table))
    grown["one_parameter_unit"] = grown_by(table.unshard)
    table_equal = torch.equal(table.weight, before)
    table.reshard()
    table.unshard()  # into the buffer freed by the reshard, allocated again
    table_equal = table_equal and torch.equal(table.weight, before)
    if rank == 0:
        torch.save({"equal": torch.equal(chunked, whole), "grown": grown, "input": grads.numel() * 8,
                    "gathered_equal": torch.equal(gathered, reference), "waited": work.wait(),
                    "output": gathered.numel() * 4, "table_equal": table_equal,
                    "table": before.numel() * 4}, out)


def test_the_chunked_collectives_are_gloos_own_without_its_staging_copies(tmp_path):
    """fsdp on CPU reduce-scatters a block's gradients and all-gathers a unit's parameters a
    slice at a time: the same values to the bit as gloo's collective of the whole, with a few MB
    of staging where gloo's own stages as much again as its input (reduce-scatter: a 48 MB
    float64 input here) or its output (all-gather: 92 MB). The all-gather's work is finished
    when it returns (FSDP2 frees the gathered buffer after its copy-out). A unit of one parameter
    is gathered straight into that parameter's unsharded buffer: its table is held once, not
    twice (FSDP2's own buffer and the copy-out), and equals the table before sharding."""
    run_ranks(_chunked_collectives_worker, 2, tmp_path, str(tmp_path / "out"),
              start_method="forkserver")
    got = torch.load(tmp_path / "out")
    grown = {key: f"{value / 2**20:.1f} MiB" for key, value in got["grown"].items()}
    print(f"\nresident growth: {grown}, for a {got['input'] / 2**20:.1f} MiB reduce-scatter input "
          f"and a {got['output'] / 2**20:.1f} MiB all-gather output")
    assert got["equal"] and got["gathered_equal"] and got["waited"]
    assert got["grown"]["chunked"] < 0.4 * got["input"], got
    assert got["grown"]["chunked_gather"] < 0.2 * got["output"], got
    assert got["table_equal"]
    assert got["grown"]["one_parameter_unit"] < 1.25 * got["table"], got


def skip_newlines_loss(model, batch):
    """A user's loss that counts fewer targets than the data has (newlines are not trained on):
    the step rescales the gradient by data targets / its own count."""
    from elastic_train.training.losses import forward

    logits = forward(model, batch)[:, :-1].float()
    labels = batch["labels"][:, 1:].masked_fill(batch["labels"][:, 1:] == 10, -100)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, (labels != -100).sum()


def test_a_loss_of_its_own_trains_alike_sharded_or_not(small_dataset):
    """The rescale of a loss that counts its own targets is a float32 product sharded too (exact
    fsdp's float64 gradient holds float32 values): the same weights to the bit as unsharded,
    so a resume that turns sharding on or off changes nothing (it multiplied in float64)."""
    finals = {}
    for sharding in ("none", "fsdp"):
        cfg = load_config(None, [*TINY, f"data.path={small_dataset}", "train.max_steps=4",
                                 "train.grad_reduce=exact", f"train.sharding={sharding}"])
        finals[sharding] = train_locally(cfg, loss_fn=skip_newlines_loss).final["model"]
    for name, weight in finals["none"].items():
        assert torch.equal(finals["fsdp"][name].to(weight.dtype), weight), name
