"""A model that cannot fit is refused from its meta shapes (training/memory.py), before any
parameter is allocated: the figures a rank needs, the refusal's one line, the driver's check of
the issue's 39B GPT in seconds, and the console's silence about the run's own building worker."""

from __future__ import annotations

import io
import time

import psutil
import pytest

from elastic_train.cluster.runwatch import RunWatch
from elastic_train.config import ConfigError, load_config
from elastic_train.preflight.inputs import check_model_memory
from elastic_train.training.memory import (
    GiB,
    ModelShapes,
    ModelTooLargeError,
    check_fits_memory,
    min_ranks,
    model_shapes,
    rank_need,
)
from elastic_train.training.model import build_meta_model

pytestmark = pytest.mark.unit

HUGE = ["model.n_layer=48", "model.d_model=8192", "model.n_head=64", "data.max_seq_len=512"]


def test_bytes_per_parameter_by_sharding_reduction_and_world_size():
    cfg = load_config(None, ["data.micro_batch_tokens=128"])
    shapes = ModelShapes(trainable=1000, frozen_bytes=0, largest_block=10)
    assert rank_need(shapes, cfg, "exact", 2, "none").total == 24 * 1000  # 4 + 4 + 8 + 8
    assert rank_need(shapes, cfg, "ddp", 2, "none").total == 20 * 1000
    fsdp = rank_need(shapes, cfg, "exact", 4, "fsdp")
    assert fsdp.total == 24 * 1000 / 4 + 8 * 10  # float64 master, grad; fp32 moments; a gathered block
    lora = ModelShapes(trainable=10, frozen_bytes=2000, largest_block=0, lora=True)
    assert rank_need(lora, cfg, "exact", 4, "fsdp").weights == 4 * 10 + 2000 / 4


def test_activation_estimate_is_stated_and_shrinks_with_checkpointing():
    meta = build_meta_model(load_config(None, []).model, 256)
    plain = load_config(None, ["data.micro_batch_tokens=1024"])
    shapes = model_shapes(meta, plain)
    assert shapes.n_layer and shapes.width and shapes.vocab
    acts = rank_need(shapes, plain, "exact", 1).activations
    assert acts == 68 * 1024 * shapes.width * shapes.n_layer + 8 * 1024 * shapes.vocab
    ckpt = load_config(None, ["data.micro_batch_tokens=1024", "model.gradient_checkpointing=true"])
    assert rank_need(shapes, ckpt, "exact", 1).activations < acts


def test_a_model_too_large_is_refused_in_one_line_with_what_would_fit():
    cfg = load_config(None, ["model.n_layer=8", "model.d_model=1024", "model.n_head=8",
                             "data.max_seq_len=256", "data.micro_batch_tokens=256"])
    shapes = model_shapes(build_meta_model(cfg.model, 256), cfg)
    need = rank_need(shapes, cfg, "exact", 2).total
    check_fits_memory(shapes, cfg, "exact", 2, need, "enough")  # fits exactly: no error
    with pytest.raises(ModelTooLargeError) as info:
        check_fits_memory(shapes, cfg, "exact", 2, need / 3, "a third")
    text = str(info.value)
    assert "\n" not in text
    assert f"needs {need / GiB:.1f} GiB" in text and "a third" in text
    ranks = min_ranks(shapes, cfg, "exact", need / 3)
    assert ranks is not None and f"fsdp over {ranks} ranks" in text
    assert rank_need(shapes, cfg, "exact", ranks, "fsdp").total <= need / 3
    assert rank_need(shapes, cfg, "exact", ranks - 1, "fsdp").total > need / 3
    assert "train.sharding=fsdp" in text and "model.lora.r=8" in text


def test_the_driver_refuses_the_39b_gpt_from_its_meta_shapes_in_seconds():
    """The issue's case: 2 CPU workers, unsharded; nothing is allocated (the process stays far
    below the model's bytes) and the check takes seconds."""
    cfg = load_config(None, HUGE)
    before = psutil.Process().memory_info().rss
    started = time.monotonic()
    meta = build_meta_model(cfg.model, cfg.data.max_seq_len)
    with pytest.raises(ConfigError, match=r"38\.66B parameters does not fit: each of 2 rank\(s\) "
                                          r"needs \d+\.\d GiB .* but a rank has \d+\.\d GiB "
                                          r"\(95% of this host's"):
        check_model_memory(cfg, meta, None)
    assert time.monotonic() - started < 30
    assert psutil.Process().memory_info().rss - before < GiB


def test_a_model_that_fits_passes_the_drivers_check():
    cfg = load_config(None, ["data.max_seq_len=128"])
    check_model_memory(cfg, build_meta_model(cfg.model, 128), None)


def test_no_waiting_line_while_the_runs_own_worker_builds():
    """While no attempt has begun but a worker of the run has started (it builds its model), the
    console prints no "waiting for workers" line: the resources it holds are the run's own."""
    now = [1000.0]
    out = io.StringIO()
    cfg = load_config(None, ["scaling.start_timeout_s=600"])
    watch = RunWatch(cfg, None, abort=lambda: None, describe_wait=lambda: "0 CPU free",
                     stream=out, clock=lambda: now[0])
    now[0] += 100
    watch._watch_start([], now[0], worker_started=now[0] - 90)
    assert "waiting for workers" not in out.getvalue()
    watch._watch_start([], now[0], worker_started=None)
    assert "waiting for workers" in out.getvalue()


def test_the_summary_keeps_the_largest_build_peak_of_any_rank():
    from elastic_train.observe.summary import read_figures
    from elastic_train.training.memory import peak_rss_bytes

    events = [{"event": "start", "world_size": 2, "utilisation": 1.0, "rank": r,
               "build_peak_rss_bytes": b} for r, b in ((0, 5 * GiB), (1, 7 * GiB))]
    assert read_figures(events, 10)["build_peak_rss_bytes"] == 7 * GiB
    assert read_figures([], 10)["build_peak_rss_bytes"] is None
    assert peak_rss_bytes() >= psutil.Process().memory_info().rss


def test_fsdp_ranks_on_cpu_return_large_frees_to_the_os():
    """glibc accepts the 1 MiB mmap threshold (docs/sharding.md: what it saved)."""
    import ctypes.util

    from elastic_train.training.memory import return_large_frees_to_os

    assert return_large_frees_to_os() is (ctypes.util.find_library("c") is not None)


LLAMA_70B = dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def qlora_70b(tmp_path_factory):
    """A Llama-70B-shaped QLoRA run at r=16 (a config.json only: built on the meta device, no
    weights, nothing downloaded), its config and its meta model."""
    pytest.importorskip("peft")
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama70b")
    LlamaConfig(**LLAMA_70B).save_pretrained(folder)
    cfg = load_config(None, [
        "model.name=hf", f"model.path={folder}", "model.lora.r=16",
        "model.lora.target_modules=[q_proj, v_proj]", "model.lora.load_in_4bit=true",
        "scaling.use_gpu=true", "train.precision=bf16", "data.max_seq_len=512",
        "data.micro_batch_tokens=1024", "data.global_batch_tokens=8192"])
    return cfg, build_meta_model(cfg.model, cfg.data.max_seq_len)


def test_a_qlora_base_counts_as_nf4_and_a_70b_fits_an_80_gib_gpu(qlora_70b):
    """docs/finetuning.md: a 4-bit 70B base fits one 80 GB GPU. The meta model's base is fp32
    (nothing is quantised on meta): counted at that size, it needs 257 GiB and is refused."""
    from dataclasses import replace

    cfg, meta = qlora_70b
    shapes = model_shapes(meta, cfg)
    assert 69.0e9 < shapes.total < 69.1e9
    assert 0.5 < shapes.frozen_bytes / shapes.frozen_params < 0.6
    # every Linear of the base at NF4 (4.127 bits), the embedding, lm_head and norms in fp32
    from elastic_train.training.memory import NF4_BYTES_PER_PARAM

    d, v, layers = LLAMA_70B["hidden_size"], LLAMA_70B["vocab_size"], LLAMA_70B["num_hidden_layers"]
    full = 2 * v * d + (2 * layers + 1) * d
    assert shapes.frozen_bytes == pytest.approx((shapes.frozen_params - full) * NF4_BYTES_PER_PARAM
                                                + 4 * full)
    check_fits_memory(shapes, cfg, "exact", 1, 80 * GiB, "an 80 GiB GPU")  # no error
    assert rank_need(shapes, cfg, "exact", 1).weights < 36 * GiB  # the base ~35 GB, as documented

    plain = replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, load_in_4bit=False)))
    fp32 = model_shapes(meta, plain)  # the same meta model: an fp32 base is 4 bytes a parameter
    assert fp32.frozen_bytes == 4 * fp32.frozen_params
    with pytest.raises(ModelTooLargeError, match="69.01B parameters does not fit"):
        check_fits_memory(fp32, plain, "exact", 1, 80 * GiB, "an 80 GiB GPU")


def test_a_qlora_that_does_not_fit_is_advised_without_fsdp(qlora_70b):
    """fsdp is refused with a 4-bit base (validate.py): the advice names what would fit instead."""
    cfg, meta = qlora_70b
    shapes = model_shapes(meta, cfg)
    need = rank_need(shapes, cfg, "exact", 1)
    with pytest.raises(ModelTooLargeError) as info:
        check_fits_memory(shapes, cfg, "exact", 1, 48 * GiB, "a 48 GiB GPU")
    text = str(info.value)
    assert "fsdp" not in text and "base_dtype" not in text
    assert "model.lora.r=8: " in text and "data.micro_batch_tokens=512" in text
    assert "model.gradient_checkpointing=true" in text
    assert f"a GPU of at least {need.total / GiB:.1f} GiB" in text
    with pytest.raises(ModelTooLargeError) as info:  # the base alone exceeds it: a bigger GPU only
        check_fits_memory(shapes, cfg, "exact", 1, 16 * GiB, "a 16 GiB GPU")
    assert "what would fit: a GPU of at least" in str(info.value)
