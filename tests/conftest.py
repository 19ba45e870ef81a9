"""Shared fixtures: a small real Parquet dataset, and one local Ray cluster per test module."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

TINY = [
    "model.n_layer=1", "model.d_model=32", "model.n_head=2",
    "data.max_seq_len=128", "data.micro_batch_tokens=1024", "data.global_batch_tokens=4096",
    "log.progress=none", "scaling.health_check_interval_s=0.1",
    "eval.fraction=0", "checkpoint.keep_best=false",  # evaluation: tests of its own
]


# Rough seconds a test of each tier takes here: a module's cost is the sum over its tests (a Ray
# test is a fit or two, a chaos test several with faults between).
TIER_COST_S = {"chaos": 60.0, "ray": 25.0, "slow": 40.0, "dist": 3.0, "unit": 0.1}


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (scripts/test.sh by default), the costliest modules first, each
    module's tests together and in their order. The workers (`--dist loadfile`) take whole modules
    in this order, one after another: started last, a long Ray module would end the suite on one
    worker while the other has nothing left to do. In one process, the files' order."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    cost: dict[Path, float] = {}
    for item in items:
        tiers = [TIER_COST_S[m.name] for m in item.iter_markers() if m.name in TIER_COST_S]
        cost[item.path] = cost.get(item.path, 0.0) + max(tiers, default=0.1)
    items.sort(key=lambda item: -cost[item.path])


@pytest.fixture(scope="session")
def tiny() -> list[str]:
    """Overrides for a tiny model and budget: a step takes tens of milliseconds."""
    return list(TINY)


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> str:
    """About 1,500 rows of real, long-tailed text: a few standard-library modules."""
    from elastic_train.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py",
                                        "heapq.py", "glob.py", "colorsys.py")]
    out = tmp_path_factory.mktemp("data") / "small"
    prepare(files, out, max_seq_len=128, rows_per_shard=600, rows_per_block=32)
    return str(out)


@pytest.fixture(scope="session")
def held_out_dataset(tmp_path_factory) -> str:
    """The modules of `small_dataset`, prepared with 10% of their documents (definitions) held
    out in `eval/`: the data set of runs with eval.fraction > 0."""
    from elastic_train.data.prepare import prepare

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / name for name in ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py",
                                        "heapq.py", "glob.py", "colorsys.py")]
    out = tmp_path_factory.mktemp("data") / "held_out"
    prepare(files, out, max_seq_len=128, rows_per_shard=600, rows_per_block=32, eval_fraction=0.1)
    return str(out)


PROCESS_GROUP_SHUTDOWN_S = 5


def start_shared_ray(metrics_report_interval_ms: int | None = None) -> None:
    """The session's local Ray cluster, started if none is up: every module on a plain local
    cluster shares it (its start and shutdown cost 5-10 s a module here, and a first run in a
    cold cluster more). A module that needs a cluster of its own calls `own_ray_cluster` first.
    `metrics_report_interval_ms`: how often its processes send their metrics (test_metrics.py
    reads them every second, in a cluster of its own: at that rate the dashboard agent took 148
    of the suite's 3398 CPU-seconds; Ray's default is 10 s)."""
    import ray

    from elastic_train.cluster.driver import start_local_ray

    if ray.is_initialized():
        return
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.1"
    # As init_ray starts a run's local cluster: its processes know its address. Without it, Ray
    # Train's placement-group cleaner (an actor) asks the state API of the cluster that
    # /tmp/ray/ray_current_cluster names, a `ray start` of another test long gone by then, and
    # each fit's end waited 12 s for the cleaner to give up (40 s GCS timeouts).
    # A group with a frozen worker in it (tests/test_hangs.py): Ray's controller waits this long
    # for its ranks to leave the process group before it kills them (30 s by default).
    # Ray's log monitor globs the session's log folder every 0.1 s while it holds under 1000 files
    # (every worker process leaves some); in a session-long cluster it took 104 of 2415 CPU-seconds
    # the suite spent in 23 min. Nothing reads its output here (log_to_driver=False): every 5 s.
    start_local_ray({"TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": str(PROCESS_GROUP_SHUTDOWN_S),
                     "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"},
                    num_cpus=4, dashboard_host="127.0.0.1", include_dashboard=True,
                    log_to_driver=False, _system_config=(
                        {} if metrics_report_interval_ms is None
                        else {"metrics_report_interval_ms": metrics_report_interval_ms}))


def own_ray_cluster() -> None:
    """Shut down the shared cluster, if up, before a module starts one of its own (a
    `ray.cluster_utils.Cluster`, other resources); the next module on `ray_cluster` starts the
    shared one again."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster():
    """The local Ray cluster of a module's runs: the session's shared one (`start_shared_ray`)."""
    start_shared_ray()
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_down():
    yield
    own_ray_cluster()


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> str:
    """The path of a small byte-level BPE `tokenizer.json` (vocabulary 400, with the special
    tokens "<|endoftext|>" (id 0) and "<pad>" (id 1); decode(encode(text)) == text), trained
    in a few tens of milliseconds on a few standard-library modules."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [str(stdlib / name) for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train(files, trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus) -> None:
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """End the process with pytest's own status once everything is reported. Seen once in CI: a
    segmentation fault in the interpreter's teardown after "417 passed" had been printed (threads
    of Ray, gloo or pyarrow still alive while Python finalises), which turned a passing suite into
    a failed one. Nothing of the tests' is left to run or write by then."""
    if _EXIT_STATUS and os.environ.get("ELASTIC_TRAIN_TEST_HARD_EXIT", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])


@pytest.fixture(scope="session")
def base_llama(tmp_path_factory) -> str:
    """A tiny Llama with its weights saved (a base that from_pretrained loads alone): the base of
    the LoRA tests."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("base")
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def prepare_sft_pairs(tokenizer: str, root: Path, eval_fraction: float = 0.0) -> str:
    """Prompt/response pairs, prepared in `root/data`: a line of textwrap.py and the line after it
    (a loss_mask column); `eval_fraction` of them held out."""
    import json

    from elastic_train.data.prepare import prepare

    lines = [line for line in (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py")
             .read_text().splitlines() if line.strip()]
    with open(root / "pairs.jsonl", "w") as handle:
        for i in range(0, len(lines) - 1, 2):
            handle.write(json.dumps({"prompt": f"Next line after: {lines[i]}\n",
                                     "response": lines[i + 1]}) + "\n")
    prepare([root / "pairs.jsonl"], root / "data", max_seq_len=64, tokenizer=tokenizer,
            rows_per_block=8, eval_fraction=eval_fraction)
    return str(root / "data")

