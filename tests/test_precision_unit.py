"""Mixed precision, the 8-bit optimizer and the non-finite guard, in-process on CPU (no Ray).

Every test drives the loop's own step functions (`forward_backward`, `optimizer_step`) and the
checkpoint functions directly, on a tiny GPT and the same real-text batches (lines of a stdlib
module). d_model=64 with max_seq_len=64 makes every weight matrix hold >= 4096 elements, so
AdamW8bit keeps 8-bit state for all of them (bitsandbytes' min_8bit_size).

Tolerances (observed worst case over 30 steps in brackets):
- bf16 against fp32, relative loss difference at every step < 1e-2 [~3e-4]. bf16 keeps 8 significant
  bits (unit round-off 2^-8 ~ 3.9e-3), and autocast rounds every matmul output to it; the loss is
  a mean over ~1,000 tokens, so the rounding of a single step averages out to far below 3.9e-3, but
  the two runs' parameters drift apart step by step through Adam. 1e-2 is ~2.5 bf16 ulps: it
  holds with ~30x margin, yet a real bug (autocast on the wrong tensors, a lost gradient scale, a
  skipped update) moves the loss by 5-50%.
- AdamW8bit against AdamW, relative loss difference at every step < 2e-2 [~6e-4], and < 5% at the
  end. Block-wise dynamic 8-bit quantisation stores each moment to ~1% relative; the update is
  m / sqrt(v), so each step's update is off by ~1% per element, which moves the loss by far less.
- Resuming from a checkpoint: bitwise. Same state, same batch, same ops, one thread.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_ranks

from elastic_train.config import ModelConfig, OptimConfig
from elastic_train.data.batches import MicroBatch, pad_rows
from elastic_train.training.checkpoint import load_checkpoint, read_shards, snapshot, write_checkpoint
from elastic_train.training.losses import LossModule
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer, lr_at
from elastic_train.training.step import StepSetup, TrainState, autocast_context, train_step

pytestmark = pytest.mark.unit
torch.set_num_threads(1)

MODEL = ModelConfig(n_layer=1, n_head=2, d_model=64)
MAX_SEQ_LEN = 64
STEPS = 30
CPU = torch.device("cpu")
OPTIM = {name: OptimConfig(name=name, lr=3e-3, warmup_steps=5) for name in ("adamw", "adamw8bit")}


def _steps(n: int, rows: int = 8, micro_batches: int = 2) -> list[list[MicroBatch]]:
    """n global steps of real text: each `micro_batches` micro-batches of `rows` source lines."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    lines = [line[:MAX_SEQ_LEN] for line in text.split(b"\n") if len(line) >= 2]
    tokens = [np.frombuffer(line, dtype=np.uint8).astype(np.int64) for line in lines]
    out, k = [], 0
    for _ in range(n):
        step = []
        for p in range(micro_batches):
            step.append(pad_rows([(k + i, tokens[(k + i) % len(tokens)]) for i in range(rows)], p))
            k += rows
        out.append(step)
    return out


BATCHES = _steps(STEPS + 1)


def _build(optim: str, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(MODEL, MAX_SEQ_LEN)
    return model, build_optimizer(model, OPTIM[optim], use_gpu=False)


def _poison(value: float | None):
    if value is None:
        return None

    def poison(model):
        next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = value
    return poison


def _step(model, optimizer, step: int, precision: str = "fp32", scaler=None,
          poison: float | None = None) -> tuple[float, bool]:
    """One optimizer step, the loop's own `train_step`: (mean loss, skipped)."""
    micro_batches = BATCHES[step]
    setup = StepSetup(device=CPU, world_size=1, precision=precision, grad_clip=1.0, scaler=scaler)
    result = train_step(LossModule(model), model, optimizer, micro_batches, setup=setup,
                        data_targets=sum(mb.targets for mb in micro_batches), step=step,
                        lr=lr_at(step, optimizer_cfg(optimizer), STEPS), poison=_poison(poison))
    return result.loss, result.skipped


def optimizer_cfg(optimizer) -> OptimConfig:
    return OPTIM["adamw" if isinstance(optimizer, torch.optim.AdamW) else "adamw8bit"]


def _curve(precision: str, optim: str) -> np.ndarray:
    model, optimizer = _build(optim)
    losses = []
    for step in range(STEPS):
        loss, skipped = _step(model, optimizer, step, precision)
        assert not skipped and math.isfinite(loss), (precision, optim, step)
        losses.append(loss)
    return np.array(losses)


@pytest.fixture(scope="module")
def fp32_adamw() -> np.ndarray:
    return _curve("fp32", "adamw")


def _same(a, b) -> bool:
    """Bitwise equality of nested dicts of tensors and numbers."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- bf16 ------------------------------------------------------------------------------------------
def test_bf16_autocast_computes_in_bf16_on_cpu() -> None:
    model, _ = _build("adamw")
    tokens = torch.from_numpy(BATCHES[0][0].tokens)
    with autocast_context("bf16", CPU):
        assert model(tokens).dtype == torch.bfloat16
    with autocast_context("fp32", CPU):
        assert model(tokens).dtype == torch.float32


def test_bf16_loss_tracks_fp32(fp32_adamw) -> None:
    bf16 = _curve("bf16", "adamw")
    rel = np.abs(bf16 - fp32_adamw) / fp32_adamw
    assert rel.max() < 1e-2, rel  # see the module docstring
    assert rel.max() > 0  # really computed in bf16, not a silent fp32 run
    assert bf16[-5:].mean() < 0.7 * bf16[0]  # and it learns


# -- AdamW8bit -------------------------------------------------------------------------------------
def test_adamw8bit_loss_tracks_adamw(fp32_adamw) -> None:
    eight = _curve("fp32", "adamw8bit")
    rel = np.abs(eight - fp32_adamw) / fp32_adamw
    assert rel.max() < 2e-2, rel
    assert rel[-1] < 5e-2
    assert rel.max() > 0
    assert eight[-5:].mean() < 0.7 * eight[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_adamw8bit_checkpoint_resumes_the_next_step_bitwise(tmp_path, precision) -> None:
    model, optimizer = _build("adamw8bit")
    for step in range(4):
        _step(model, optimizer, step, precision)
    state = TrainState(step=4, step_in_epoch=4)
    snap = snapshot(model, optimizer, None, asdict(state), {"note": "test"}, world_size=1)
    write_checkpoint(snap, tmp_path / "ckpt")
    # The 8-bit state is what was saved: uint8 moments with their block-wise absmax.
    saved = read_shards(tmp_path / "ckpt", "optimizer")["state"]
    eight_bit = [s for s in saved.values()
                 if s["__bnb_optimizer_quant_state__"]["state1"].dtype == torch.uint8]
    assert len(eight_bit) == sum(p.numel() >= 4096 for p in model.parameters()) > 0

    resumed, resumed_optimizer = _build("adamw8bit", seed=123)  # different weights, no state
    assert TrainState(**load_checkpoint(tmp_path / "ckpt", resumed, resumed_optimizer)) == state
    for step in (4, 5):
        loss, _ = _step(model, optimizer, step, precision)
        resumed_loss, _ = _step(resumed, resumed_optimizer, step, precision)
        assert resumed_loss == loss, step
    theirs = _params(resumed)
    for name, tensor in _params(model).items():
        assert torch.equal(tensor, theirs[name]), name
    assert _same(optimizer.state_dict()["state"], resumed_optimizer.state_dict()["state"])


# -- GradScaler ------------------------------------------------------------------------------------
def test_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path) -> None:
    """torch.amp.GradScaler("cuda") (what the loop builds for fp16) is disabled on a CPU-only host:
    its state is {} and load is a no-op, so its round trip proves nothing here. The CPU scaler
    runs the same GradScaler code, and fp16 autocast works on CPU, so this drives it through the
    loop's fp16 path: one good step, one non-finite step (backoff), then save and load."""
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            cuda_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
        assert not cuda_scaler.is_enabled() and cuda_scaler.state_dict() == {}

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model, optimizer = _build("adamw")
    assert _step(model, optimizer, 0, "fp16", scaler) == (pytest.approx(5.5, abs=0.1), False)
    assert _step(model, optimizer, 1, "fp16", scaler, poison=float("inf"))[1]
    assert scaler.get_scale() == 2.0**9
    assert not _step(model, optimizer, 2, "fp16", scaler)[1]
    saved = scaler.state_dict()
    assert saved["scale"] == 2.0**9 and saved["_growth_tracker"] == 1

    snap = snapshot(model, optimizer, scaler, asdict(TrainState(step=3)), {}, world_size=1)
    write_checkpoint(snap, tmp_path / "ckpt")
    fresh = torch.amp.GradScaler("cpu")  # default init_scale 2**16, growth_interval 2000
    resumed, resumed_optimizer = _build("adamw", seed=5)
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_optimizer, fresh)
    assert fresh.state_dict() == saved and fresh.get_scale() == 2.0**9
    # Both continue alike: two more good steps reach growth_interval=3 and double the scale.
    for step in (3, 4):
        assert _step(model, optimizer, step, "fp16", scaler) == _step(
            resumed, resumed_optimizer, step, "fp16", fresh)
    assert scaler.get_scale() == fresh.get_scale() == 2.0**10


# -- the non-finite guard --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_gradient_skips_the_step_and_changes_nothing(bad) -> None:
    model, optimizer = _build("adamw")
    _step(model, optimizer, 0)
    before, opt_before = _params(model), optimizer.state_dict()
    loss, skipped = _step(model, optimizer, 1, poison=bad)
    assert skipped and math.isfinite(loss)
    assert all(p.grad is None for p in model.parameters())
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert _same(optimizer.state_dict()["state"], opt_before["state"])
    loss, skipped = _step(model, optimizer, 2)  # the next step trains as usual
    assert not skipped and math.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_step_backs_off_the_scale_and_restarts_growth_counting() -> None:
    """As GradScaler does itself on an overflow: scale * backoff_factor, growth tracker to 0."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    model, optimizer = _build("adamw")
    for step in (0, 1):
        assert not _step(model, optimizer, step, "fp16", scaler)[1]
    assert scaler.state_dict()["_growth_tracker"] == 2
    assert _step(model, optimizer, 2, "fp16", scaler, poison=float("nan"))[1]
    assert scaler.state_dict()["scale"] == 2.0**9 and scaler.state_dict()["_growth_tracker"] == 0
    for step in (3, 4):
        _step(model, optimizer, step, "fp16", scaler)
    assert scaler.get_scale() == 2.0**9  # 2 good steps since the backoff: not yet 3


def test_fp16_loss_scale_overflows_are_skipped_but_never_roll_back() -> None:
    """A scale far too large (2^24) overflows the fp16 gradient for several steps in a row while
    GradScaler backs off: each is a skipped step, but an overflow of the scale's making, which
    neither counts toward train.max_consecutive_skips (3: a rollback replayed the same overflows
    and the run stopped) nor breaks a run of real ones. A NaN loss is real at any scale."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    model, optimizer = _build("adamw")
    state, overflows = TrainState(), []
    for step in range(12):
        micro_batches = BATCHES[step]
        setup = StepSetup(device=CPU, world_size=1, precision="fp16", grad_clip=1.0, scaler=scaler)
        result = train_step(LossModule(model), model, optimizer, micro_batches, setup=setup,
                            data_targets=sum(mb.targets for mb in micro_batches), step=step,
                            lr=lr_at(step, OPTIM["adamw"], STEPS))
        assert result.overflow == result.skipped
        overflows.append(result.overflow)
        assert not state.count_step(result.skipped, 1, 1, 1, max_skips=3, overflow=result.overflow)
    assert sum(overflows) >= 3 and overflows[0] and not overflows[-1], overflows
    assert state.skipped_steps == sum(overflows) and state.consecutive_skips == 0
    real = TrainState(consecutive_skips=2)
    assert real.count_step(True, 1, 1, 1, max_skips=3)  # a non-finite loss: counted


# -- optional: 2 gloo processes agree to skip ---------------------------------------------------
def _gloo_worker(rank: int, world_size: int, out: str) -> None:
    raw, optimizer = _build("adamw")
    model = torch.nn.parallel.DistributedDataParallel(LossModule(raw))
    setup = StepSetup(device=CPU, world_size=2)
    results = []
    for step in range(3):
        mine = [mb for mb in BATCHES[step] if mb.partition % 2 == rank]
        # after DDP's all-reduce: only rank 1's copy is bad
        poison = _poison(float("nan")) if step == 1 and rank == 1 else None
        result = train_step(model, raw, optimizer, mine, setup=setup, step=step, lr=1e-3,
                            data_targets=sum(mb.targets for mb in BATCHES[step]), poison=poison)
        results.append((result.loss, result.skipped))
    torch.save({"results": results, "params": _params(raw)}, f"{out}.{rank}")


@pytest.mark.dist
def test_two_gloo_ranks_agree_to_skip_a_step_one_of_them_saw_as_nonfinite(tmp_path) -> None:
    out = str(tmp_path / "out")
    run_ranks(_gloo_worker, 2, tmp_path, out, start_method="forkserver")
    r0, r1 = (torch.load(f"{out}.{rank}") for rank in (0, 1))
    assert [s for _, s in r0["results"]] == [s for _, s in r1["results"]] == [False, True, False]
    assert [loss for loss, _ in r0["results"]] == [loss for loss, _ in r1["results"]]
    for name, tensor in r0["params"].items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, r1["params"][name]), name
