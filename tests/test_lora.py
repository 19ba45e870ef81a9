"""LoRA without Ray (issue 30): what is trained, saved and refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from elastic_train import load_config
from elastic_train.config import ConfigError
from elastic_train.preflight.packages import needed_packages
from elastic_train.training.lora import BASE_KEY, LoraModel
from elastic_train.training.model import build_model
from elastic_train.training.optim import build_optimizer

pytestmark = pytest.mark.unit
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> str:
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=True).save_pretrained(folder)
    return str(folder)


def lora_cfg(folder: str, *extra: str):
    return load_config(None, ["model.name=hf", f"model.path={folder}", "model.lora.r=4",
                              "model.lora.target_modules=[q_proj, v_proj]", *extra])


def test_a_bf16_base_is_frozen_and_only_fp32_adapters_are_optimized_and_saved(llama_folder):
    cfg = lora_cfg(llama_folder, "model.base_dtype=bf16")
    torch.manual_seed(0)
    model = build_model(cfg.model, 64)
    assert isinstance(model, LoraModel)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert {p.dtype for p in frozen.values()} == {torch.bfloat16}
    optimizer = build_optimizer(model, cfg.optim, False)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trainable.values()}
    state = model.state_dict()
    assert set(state) == set(trainable) | {BASE_KEY}
    # A batch trains the adapters only.
    tokens = torch.randint(0, 400, (2, 12))
    model(tokens).logits.float().sum().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert all(p.grad is None for p in frozen.values())


def test_adapters_of_another_base_are_refused_by_name(llama_folder):
    cfg = lora_cfg(llama_folder)
    torch.manual_seed(0)
    saved = build_model(cfg.model, 64).state_dict()
    torch.manual_seed(0)
    build_model(cfg.model, 64).load_state_dict(saved)  # the same base: loads
    torch.manual_seed(1)  # no weights in the folder: another seed is another base
    with pytest.raises(ValueError, match="trained on another base model"):
        build_model(cfg.model, 64).load_state_dict(saved)


@pytest.mark.parametrize("overrides, words", [
    (["scaling.use_gpu=true", "model.lora.load_in_4bit=true", "train.sharding=fsdp"],
     "model.lora.load_in_4bit with train.sharding=fsdp"),
    (["model.lora.load_in_4bit=true"], "runs on GPU workers only"),
    (["model.lora.r=0", "model.base_dtype=bf16"], "model.base_dtype=bf16"),
    (["scaling.use_gpu=true", "model.lora.load_in_4bit=true", "model.base_dtype=bf16"],
     "model.base_dtype=bf16 does not apply to a 4-bit base"),
    (["model.lora.r=-1"], "model.lora.r must be >= 0"),
    (["model.base_dtype=fp16"], "model.base_dtype must be fp32 or bf16"),
    (["model.name=gpt", "scaling.use_gpu=true", "model.lora.load_in_4bit=true"],
     "quantises a transformers model as it loads"),
])
def test_lora_settings_that_cannot_work_are_refused_by_name(llama_folder, overrides, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        lora_cfg(llama_folder, *overrides)


def test_peft_is_a_package_the_config_needs():
    cfg = load_config(None, ["model.lora.r=2", "model.lora.target_modules=[fc]"])
    assert [need.module for need in needed_packages(cfg)] == ["peft"]
    assert not needed_packages(load_config(None))


@pytest.fixture
def weights_folder(tmp_path, monkeypatch):
    """A tiny Llama saved with its weights; base hashes cached in this test's own folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("ELASTIC_TRAIN_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "split", max_shard_size="40KB")
    return tmp_path


def test_the_base_hash_is_of_the_stored_weights_whatever_the_dtype_or_the_files_split(weights_folder):
    """fp32 and bf16 loads of one folder carry the same hash (of the weights as stored), and a
    copy split over several safetensors files the same again; other weights another."""
    from elastic_train.training.basehash import files_hash, weight_files

    one, split = weights_folder / "one", weights_folder / "split"
    assert len(weight_files(split)) > 1
    hashes = {}
    for name, folder, dtype in (("fp32", one, "fp32"), ("bf16", one, "bf16"), ("split", split, "fp32")):
        model = build_model(lora_cfg(str(folder), f"model.base_dtype={dtype}").model, 64)
        hashes[name] = bytes(getattr(model, BASE_KEY).tolist())
    assert hashes["fp32"] == hashes["bf16"] == hashes["split"] == files_hash(weight_files(one))
    from safetensors.torch import load_file, save_file

    weights = load_file(one / "model.safetensors")
    weights["lm_head.weight"][0, 0] += 1
    save_file(weights, one / "model.safetensors", metadata={"format": "pt"})
    other = build_model(lora_cfg(str(one)).model, 64)
    assert bytes(getattr(other, BASE_KEY).tolist()) != hashes["fp32"]


def test_a_folders_hash_is_cached_per_node_until_its_files_change(weights_folder):
    """The second start reads the cache (a planted value comes back); rewriting the weights
    (same bytes even) makes a new key, so the hash is computed again."""
    from elastic_train.training.basehash import _cache_dir, folder_hash

    folder = weights_folder / "one"
    real = folder_hash(folder)
    (entry,) = [p for p in _cache_dir().iterdir() if not p.name.endswith(".lock")]
    assert entry.read_text() == real.hex()
    entry.write_text((b"\x01" * 32).hex())
    assert folder_hash(folder) == b"\x01" * 32
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").write_bytes(data)  # another inode and ctime
    assert folder_hash(folder) == real


def test_qlora_loads_a_4bit_base_on_a_gpu_and_is_refused_by_name_without_one(weights_folder):
    """A valid QLoRA config (GPU workers) built by a worker: with CUDA, a 4-bit base under fp32
    adapters, hashed as the folder's stored weights; without (this suite's CPU machines), one
    clear error naming the key."""
    from elastic_train.training.basehash import files_hash, weight_files

    folder = weights_folder / "one"
    cfg = lora_cfg(str(folder), "scaling.use_gpu=true", "model.lora.load_in_4bit=true")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"load_in_4bit \(QLoRA\) needs a CUDA GPU"):
            build_model(cfg.model, 64)
        return
    model = build_model(cfg.model, 64)
    assert model.peft.get_base_model().is_loaded_in_4bit
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    assert bytes(getattr(model, BASE_KEY).tolist()) == files_hash(weight_files(folder))


def test_lora_on_the_embedded_gpt_trains_its_linear_targets():
    """LoRA on a model that is not a transformers one (the embedded GPT, targets qkv and proj):
    the model is called with the tokens as the loop calls it (not input_ids=), only adapters
    get gradients, and they are what the state dict holds."""
    import torch.nn.functional as F

    cfg = load_config(None, ["model.lora.r=2", "model.lora.target_modules=[qkv, proj]",
                             "model.vocab_size=256"])
    model = build_model(cfg.model, 32)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert tuple(logits.shape) == (2, 16, 256)
    F.cross_entropy(logits[:, :-1].reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)
    assert any(n.endswith("qkv.lora_B.default.weight") for n in grads)
    assert any(n.endswith("proj.lora_B.default.weight") for n in grads)
    assert set(model.state_dict()) == {n for n, p in model.named_parameters()
                                       if p.requires_grad} | {BASE_KEY}


def test_no_targets_on_a_model_peft_has_no_default_for_names_the_layers_it_could_adapt():
    """The embedded GPT is no transformers model type: with target_modules empty the error
    lists its Linear layers by the names target_modules takes, and those names work."""
    with pytest.raises(ValueError, match=r"model\.lora\.target_modules is empty.*Linear layers: "
                       r"qkv, proj, mlp\.0, mlp\.2\)$"):  # not lm_head: tied to wte
        build_model(load_config(None, ["model.lora.r=2"]).model, 32)
    cfg = load_config(None, ["model.lora.r=2", "model.lora.target_modules=[mlp.0, mlp.2]"])
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in build_model(cfg.model, 32).named_parameters()
               if ".lora_A." in n}
    assert adapted and all(n.endswith(("mlp.0", "mlp.2")) for n in adapted)


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_a_target_whose_weight_is_tied_is_refused_before_ray(kind, llama_folder, tmp_path):
    """The GPT's lm_head is its wte, a tied Llama's lm_head its embed_tokens: merged, the
    adapters' update would land in the input embedding too. The driver's meta build (what
    check_inputs runs) refuses it in one line naming the key, the module, what it is tied to
    and what to do; an untied Llama's lm_head is a target like any other."""
    from transformers import LlamaConfig

    from elastic_train.preflight.inputs import meta_model

    tied = {"gpt": ("wte.weight", ["model.vocab_size=256"]),
            "hf": ("model.embed_tokens.weight", ["model.name=hf", f"model.path={llama_folder}"])}
    other, overrides = tied[kind]
    cfg = load_config(None, [*overrides, "model.lora.r=2", "model.lora.target_modules=[lm_head]",
                             "data.max_seq_len=32"])
    with pytest.raises(ConfigError) as refused:
        meta_model(cfg)
    message = str(refused.value)
    assert message.startswith(f"model.lora.target_modules: lm_head's weight is tied to {other}")
    assert "leave lm_head out of model.lora.target_modules" in message and "\n" not in message
    assert ("tie_word_embeddings=false" in message) == (kind == "hf")
    with pytest.raises(ConfigError, match="is tied to"):
        build_model(cfg.model, 32)  # a worker's build too
    untied = tmp_path / "untied"
    LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                tie_word_embeddings=False).save_pretrained(untied)
    model = meta_model(load_config(None, ["model.name=hf", f"model.path={untied}", "model.lora.r=2",
                                          "model.lora.target_modules=[lm_head]"]))
    assert any("lm_head.lora_A" in n for n, _ in model.named_parameters())


def test_a_resume_on_another_base_is_refused_before_ray_and_changes_nothing(
        weights_folder, tmp_path, monkeypatch, capsys):
    """A finished LoRA run (a checkpoint of adapters on base `one`, summary.json "finished")
    trained on with model.path naming other weights: one error naming model.path and both
    hashes, exit 2, before Ray starts, and every file of the run folder byte for byte the same
    (config.yaml not rewritten, summary.json still "finished")."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    import elastic_train.api
    from elastic_train.cli import main
    from elastic_train.data.prepare import prepare
    from elastic_train.preflight.inputs import check_inputs
    from elastic_train.training.checkpoint import snapshot, write_checkpoint

    def tripwire(cfg):
        raise AssertionError("the input was accepted: Ray would start now")

    monkeypatch.setattr(elastic_train.api, "init_ray", tripwire)
    (tmp_path / "src.txt").write_text("\n\n".join(f"line {i} " * 9 for i in range(200)))
    prepare([tmp_path / "src.txt"], tmp_path / "data", max_seq_len=64)
    other = weights_folder / "other"
    shutil.copytree(weights_folder / "one", other)
    weights = load_file(other / "model.safetensors")
    weights["lm_head.weight"][0, 0] += 1
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    common = ["model.lora.r=4", "model.lora.target_modules=[q_proj, v_proj]", "model.name=hf",
              f"data.path={tmp_path / 'data'}", f"run.storage_path={tmp_path / 'runs'}",
              "run.name=sft", "train.max_steps=2", "eval.fraction=0", "log.progress=none",
              "checkpoint.keep_best=false", "data.max_seq_len=64"]
    cfg = load_config(None, [*common, f"model.path={weights_folder / 'one'}"])
    check_inputs(cfg)
    model = build_model(cfg.model, cfg.data.max_seq_len)
    snap = snapshot(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
                    None, {"step": 2, "epoch": 0, "step_in_epoch": 2}, cfg.to_dict(), world_size=1)
    run = tmp_path / "runs" / "sft"
    write_checkpoint(snap, run / "checkpoint_000000002")
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "summary.json").write_text(json.dumps({"status": "finished", "steps": 2}))
    before = {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert main(["train", *common, f"model.path={other}", "train.max_steps=4"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.path" in errors[0] and "another base model" in errors[0]
    assert {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    with pytest.raises(AssertionError, match="Ray would start now"):  # the same base: accepted
        main(["train", *common, f"model.path={weights_folder / 'one'}", "train.max_steps=4"])


def test_the_finetuning_pages_commands_pass_every_check_before_ray(tmp_path, monkeypatch):
    """docs/finetuning.md's prepare and LoRA train commands, as written, on 300 chat examples
    with a tiny Llama (a config.json) and a tokenizer trained here: prepare succeeds, and train
    passes every check up to starting Ray (the tripwire), with data.max_seq_len and the batch
    sizes taken from the data (rows far shorter than --max-seq-len 1024 and the model's 256
    positions)."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    import elastic_train.api
    from elastic_train.cli import main

    chats = [{"messages": [{"role": "user", "content": f"What is {i} times 3?"},
                           {"role": "assistant", "content": f"{i} times 3 is {3 * i}."}]}
             for i in range(300)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator([m["content"] for c in chats for m in c["messages"]],
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                    show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.role == "
                         "'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    tok.save_pretrained(tmp_path / "model")
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                tie_word_embeddings=True).save_pretrained(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    assert main(["prepare", "sft.jsonl", "--output", "data/sft", "--tokenizer", "model",
                 "--max-seq-len", "1024", "--eval-fraction", "0.05"]) == 0
    resolved = {}

    def tripwire(cfg):
        resolved["data"] = cfg.data
        raise AssertionError("the input was accepted: Ray would start now")

    monkeypatch.setattr(elastic_train.api, "init_ray", tripwire)
    with pytest.raises(AssertionError, match="Ray would start now"):
        main(["train", "model.name=hf", "model.path=model", "data.path=data/sft",
              "model.lora.r=16", "model.lora.alpha=32", "model.lora.target_modules=[q_proj, v_proj]",
              "model.base_dtype=bf16", "eval.fraction=0.05", "run.name=my-sft"])
    data = resolved["data"]
    assert data.max_seq_len < 64 and data.micro_batch_tokens == 1 << (data.max_seq_len - 1).bit_length()
    assert 2 <= data.global_batch_tokens // data.micro_batch_tokens <= 8


def test_lora_on_a_transformers_model_takes_the_chunked_head(llama_folder, monkeypatch):
    """The default loss of a LoRA model on a transformers base applies the output head chunk by
    chunk, as for the base alone (it made the whole fp32 logits: 16k tokens of a 128k vocabulary
    are 8 GB), with the mask and positions passed; the loss and the adapters' gradients are
    those of the whole logits."""
    from elastic_train.data.batches import make_batch
    from elastic_train.training import losses

    torch.manual_seed(0)
    model = build_model(lora_cfg(llama_folder).model, 64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # B is 0 at init: the adapters would change nothing
    batch = make_batch(torch.randint(0, 400, (2, 24)), torch.tensor([24, 17]))
    chunked, chunked_loss = [], losses._chunked_hf_loss_sum
    monkeypatch.setattr(losses, "_chunked_hf_loss_sum",
                        lambda *a, **k: chunked.append(1) or chunked_loss(*a, **k))
    loss, count = losses.causal_lm_loss(model, batch, chunk_tokens=16)
    assert chunked and int(count) == 23 + 16
    (grad,) = torch.autograd.grad(loss, [p for n, p in model.named_parameters() if "lora_A" in n][:1])
    logits = losses.forward(model, batch)[:, :-1]
    whole = losses._logits_loss_sum(logits, batch["labels"][:, 1:], 10**9)
    (whole_grad,) = torch.autograd.grad(whole, [p for n, p in model.named_parameters()
                                                if "lora_A" in n][:1])
    torch.testing.assert_close(loss, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-4, atol=1e-6)


def test_qlora_on_a_folder_without_weights_is_refused_on_the_driver(llama_folder, tmp_path):
    """Not on each worker after it built the whole fp32 base (check_qlora), but before Ray."""
    import shutil

    from elastic_train.training.lora import check_qlora_inputs

    qlora = ("model.lora.load_in_4bit=true", "scaling.use_gpu=true")
    with pytest.raises(ConfigError, match=r"model\.lora\.load_in_4bit .*model\.path '.*', "
                                          r"which holds no weights"):
        check_qlora_inputs(lora_cfg(llama_folder, *qlora))
    check_qlora_inputs(lora_cfg(llama_folder))  # no QLoRA: a base from its config is fine
    shutil.copy(f"{llama_folder}/config.json", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    check_qlora_inputs(lora_cfg(str(tmp_path), *qlora))  # weights to quantise


HUB_LOOKUPS = """
import socket, sys
hosts = []
resolve = socket.getaddrinfo
def record(host, *args, **kwargs):
    hosts.append(host)
    return resolve(host, *args, **kwargs)
socket.getaddrinfo = record
{code}
print("HOSTS", sorted(set(hosts)))
"""


def _hosts_looked_up(*codes: str) -> list[list[str]]:
    """The hosts each of `codes` looked up, each run in a fresh process (side by side)."""
    import ast
    import subprocess

    runs = [subprocess.Popen([sys.executable, "-c", HUB_LOOKUPS.format(code=code)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for code in codes]
    hosts = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        hosts.append(ast.literal_eval(out.rsplit("HOSTS ", 1)[1]))
    return hosts


def test_lora_and_8bit_adam_ask_the_hugging_face_hub_for_nothing(llama_folder):
    """bitsandbytes' import asks the Hub for a CPU kernel where the CPU has AVX512-BF16 (code
    downloaded at run time, or a wait without internet), and peft imports it to wrap any model:
    every LoRA run's driver and workers looked up huggingface.co. A LoRA model and the 8-bit
    AdamW are built here, in a fresh process, with no lookup; the plain import beside it, on
    such a CPU, makes one (the control), and a user's HF_HUB_OFFLINE stays as it was."""
    ours, plain = _hosts_looked_up(
        "import torch\n"
        "from elastic_train import load_config\n"
        "from elastic_train.training.model import build_model\n"
        "from elastic_train.training.optim import build_optimizer\n"
        f"cfg = load_config(None, ['model.name=hf', 'model.path={llama_folder}', "
        "'model.lora.r=4', 'model.lora.target_modules=[q_proj]', 'optim.name=adamw8bit'])\n"
        "model = build_model(cfg.model, 64)\n"
        "build_optimizer(model, cfg.optim, False)\n"
        "import huggingface_hub.constants as hub\n"
        "assert not hub.HF_HUB_OFFLINE and 'bitsandbytes' in sys.modules\n",
        "import bitsandbytes\n")
    assert ours == []
    avx512_bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    assert ("huggingface.co" in plain) == avx512_bf16
