"""LoRA with train.sharding=fsdp over real gloo processes, through the real loop (issue 30): the
frozen base sharded (each rank holds its rows, in its own dtype: bf16 here), the adapters whole
on every rank. A W=2 run crashed after its step-4 checkpoint, that checkpoint resumed at W=2
and at W=1: every step's loss and the final adapters are those of one unsharded LoRA process,
to the bit; the checkpoint holds adapter tensors (and the base's hash) only; the run's export
gathers them.

One module fixture runs the three (ranks forked from a server that imported torch and FSDP
once, ranks.py); each test asserts one property of what they saved. An uninterrupted W=2 run
would add nothing: its steps are the crashed run's and the resumed run's, both checked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import prepare_sft_pairs
from localenv import LocalEnv, train_locally
from ranks import run_ranks

from elastic_train import load_config
from elastic_train.export import export, load_trained
from elastic_train.training.checkpoint import read_shards, read_state, write_checkpoint
from elastic_train.training.lora import BASE_KEY

pytestmark = pytest.mark.dist
pytest.importorskip("peft")

CRASH_AT, SAVE_EVERY, STEPS = 5, 4, 6
DDP = ("train.grad_reduce=ddp", "train.max_steps=3")


class Crash(RuntimeError):
    """The test's crash: raised on every rank after step CRASH_AT (its checkpoint not written)."""


class RankEnv(LocalEnv):
    """`LocalEnv` as one rank of run_ranks' gloo group, writing every checkpoint to `folder`
    (each rank its share) and resuming from `resume_from`; `crash` raises after CRASH_AT."""

    def __init__(self, *args, resume_from: str | None = None, crash: bool = False,
                 steps: list | None = None) -> None:
        super().__init__(*args)
        self.world_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.resume_from, self.crash = resume_from, crash
        if steps is not None:  # the caller's list: it outlives a crash
            self.steps = steps

    def latest_checkpoint_dir(self) -> str | None:
        return self.resume_from

    def save_checkpoint(self, snap, step: int, final: bool) -> None:
        super().save_checkpoint(snap, step, final)
        write_checkpoint(snap, Path(self.folder) / f"checkpoint_{step:09d}")

    def inject_faults(self, step: int) -> None:
        if self.crash and step == CRASH_AT:
            raise Crash(step)


def lora_config(base: str, data: str, sharding: str, *extra: str):
    return load_config(None, [
        "model.name=hf", f"model.path={base}", f"data.path={data}", "model.lora.r=4",
        "model.lora.alpha=8", "model.lora.target_modules=[q_proj, v_proj]", "optim.lr=0.01",
        "model.base_dtype=bf16", "data.max_seq_len=64", "data.micro_batch_tokens=256",
        "data.global_batch_tokens=1024", "eval.fraction=0", "log.progress=none",
        f"train.max_steps={STEPS}", f"checkpoint.every_steps={SAVE_EVERY}",
        "checkpoint.keep_best=false", f"train.sharding={sharding}", "train.grad_reduce=exact",
        *extra])


def run(cfg, folder: Path, **env_kwargs) -> LocalEnv:
    folder.mkdir(parents=True, exist_ok=True)
    return train_locally(cfg, extra_columns=("loss_mask",), folder=str(folder),
                         env_cls=lambda *a: RankEnv(*a, **env_kwargs))


def _worker(rank: int, world_size: int, base: str, data: str, root: str) -> None:
    cfg, root = lora_config(base, data, "fsdp"), Path(root)
    losses = {}
    if world_size == 2:
        crashed = []
        try:
            run(cfg, root / "crashed", crash=True, steps=crashed)
        except Crash:
            losses["crashed"] = [s["loss"] for s in crashed]
        else:
            raise AssertionError("the crash hook did not fire")
    ckpt = root / "crashed" / f"checkpoint_{SAVE_EVERY:09d}"
    env = run(cfg, root / f"resumed{world_size}", resume_from=str(ckpt))
    losses["resumed"] = [s["loss"] for s in env.steps]
    if world_size == 2:  # the ddp reduction (one fp32 all-reduce of the adapters' gradients)
        env = run(lora_config(base, data, "fsdp", *DDP), root / "ddp")
        losses["ddp"] = [s["loss"] for s in env.steps]
    if rank == 0:
        (root / f"losses{world_size}.json").write_text(json.dumps(losses))


@pytest.fixture(scope="module")
def sft_data(bpe_tokenizer, tmp_path_factory) -> str:
    """Prompt/response pairs: a line of textwrap.py and the line after it (a loss_mask column)."""
    return prepare_sft_pairs(bpe_tokenizer, tmp_path_factory.mktemp("sft"))


@pytest.fixture(scope="module")
def worlds(base_llama, sft_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fsdp")
    for world_size in (2, 1):  # W=2 first: it writes the checkpoint W=1 resumes
        run_ranks(_worker, world_size, root, base_llama, sft_data, str(root),
                  start_method="forkserver")
    unsharded = train_locally(lora_config(base_llama, sft_data, "none"), extra_columns=("loss_mask",))
    ddp = train_locally(lora_config(base_llama, sft_data, "none", *DDP), extra_columns=("loss_mask",))
    return root, unsharded, ddp


def final(folder: Path) -> dict[str, torch.Tensor]:
    return read_shards(folder / f"checkpoint_{STEPS:09d}", "model")


def test_lora_on_a_sharded_base_is_one_unsharded_process_to_the_bit(worlds):
    """Crashed at W=2, resumed at W=2 and at W=1 (a resize): every step's loss and the final
    adapters are those of one unsharded LoRA process."""
    root, unsharded, ddp = worlds
    want = unsharded.final["model"]
    want_losses = [s["loss"] for s in unsharded.steps]
    assert len(want_losses) == STEPS and want_losses[0] != want_losses[-1]
    crashed = json.loads((root / "losses2.json").read_text())["crashed"]
    assert crashed == want_losses[:CRASH_AT]
    for world_size in (1, 2):
        losses = json.loads((root / f"losses{world_size}.json").read_text())
        assert losses["resumed"] == want_losses[SAVE_EVERY:], world_size
        got = final(root / f"resumed{world_size}")
        assert got.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (world_size, name)
        state = read_state(root / f"resumed{world_size}" / f"checkpoint_{STEPS:09d}")
        assert state["world_size"] == world_size and state["train_state"]["step"] == STEPS
    # train.grad_reduce=ddp at W=2: fp32 sums, so equal to fp32 round-off (the order of the
    # additions differs with W); a lost or doubled gradient would move the loss by percents
    ddp_losses = json.loads((root / "losses2.json").read_text())["ddp"]
    assert ddp_losses == pytest.approx([s["loss"] for s in ddp.steps], rel=1e-5)
    saved = read_shards(root / "ddp" / f"checkpoint_{3:09d}", "model")
    for name, tensor in ddp.final["model"].items():
        if name != BASE_KEY:
            torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=1e-6)


def test_the_checkpoint_holds_the_adapters_and_the_base_hash_only(worlds, base_llama):
    root, *_ = worlds
    ckpt = root / "crashed" / f"checkpoint_{SAVE_EVERY:09d}"
    saved = read_shards(ckpt, "model")
    adapters = {n: t for n, t in saved.items() if n != BASE_KEY}
    assert adapters and all("lora_A" in n or "lora_B" in n for n in adapters)
    assert {t.dtype for t in adapters.values()} == {torch.float32}
    assert saved[BASE_KEY].dtype == torch.uint8 and saved[BASE_KEY].any()
    state = read_state(ckpt)
    assert state["world_size"] == 2 and "sharding" not in state  # whole tensors, in 2 shares
    assert len(list(ckpt.glob("model.shard*.pt"))) == 2
    optim = read_shards(ckpt, "optimizer")
    assert len(optim["state"]) == len(adapters)
    base_bytes = sum(p.stat().st_size for p in Path(base_llama).glob("*.safetensors"))
    model_bytes = sum(p.stat().st_size for p in ckpt.glob("model.shard*.pt"))
    assert model_bytes < base_bytes / 5


def test_the_export_of_a_sharded_lora_run_loads_its_adapters(worlds, base_llama, sft_data, tmp_path):
    """export (adapters, and --merge) of the resumed W=2 run: peft's adapter files hold the checkpoint's
    tensors; the merged model is the base plus B A alpha / r."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, *_ = worlds
    run_dir = root / "resumed2"
    (run_dir / "config.yaml").write_text(lora_config(base_llama, sft_data, "fsdp").to_yaml())
    trained = load_trained(run_dir)
    saved = final(run_dir)
    for name, tensor in trained.model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    export(run_dir, tmp_path / "adapter")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_llama),
                                        str(tmp_path / "adapter"))
    lora_a = {n: p for n, p in adapted.named_parameters() if "lora_A" in n}
    assert len(lora_a) == sum("lora_A" in n for n in saved)
    assert all(any(torch.equal(p, t) for t in saved.values()) for p in lora_a.values())
    export(run_dir, tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base = AutoModelForCausalLM.from_pretrained(base_llama)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[q], base.state_dict()[q])
