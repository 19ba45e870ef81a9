"""train.compile: the model under torch.compile, with shapes bounded, recompiles counted, and
compiled code kept across the run's processes.

What makes compile different here from a fixed-shape trainer:

- Length-bucketed token-budget micro-batches change shape (rows x length) from one micro-batch to
  the next. Left to itself, dynamo compiles the first shape it sees as static and recompiles with
  dynamic sizes at the second: three graphs or more over an epoch, and which one computes a shape
  depends on the order shapes came in. Compiled with `dynamic=True` from the first call, every
  process has the same graphs: one with symbolic rows and length, and one for single-row
  micro-batches (dynamo always specialises a size of 1).
- The exact reduction promises the same bits at any world size and across restarts. Compiling the
  loss with the model (as `torch.compile` of the whole LossModule did) broke that: a run crashed at
  step 10 and resumed ended at 3.175512563649605 against 3.175512532301297 uninterrupted (default
  model, 2 workers, 16 steps), likely because the loss's float32 sum over every target is a
  reduction Inductor orders by what it knows of the size, and the loss's host-side target count and
  chunk loop break its graph into shape-specialised pieces. The model alone, compiled as here, ends
  both runs at 3.1755129084809965, and 1 and 2 workers alike (tests/test_compile.py, which fails
  with the whole LossModule compiled).
- Every restart, resize and replacement starts new processes that would compile again from
  nothing. Inductor's own caches (FX graph and AOTAutograd caches) are pointed at a node-local
  folder shared by the run's attempts (`cache_folder`), and every process that compiled a new
  graph saves the "mega-cache" (`torch.compiler.save_cache_artifacts`) into the run folder, where
  a process on a new node loads it (`load_cache_artifacts`) before its first step.
- Recompiles are counted: a `compile` event each time a step compiled or loaded graphs (how many
  of each), and the summary's `compiled_graphs`.

What is compiled: the user's module in place (`nn.Module.compile`, so its state_dict keys and
the optimizer's parameters stay those of the eager module), or each module of the classes in
`train.compile_modules`, as torchtitan compiles each transformer block: identical blocks share
one graph, so compile time does not grow with depth. The loss stays eager: it counts targets with
host-side integers and walks the sequence in chunks, which would break the graph anyway.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elastic_train.config import Config
from elastic_train.observe.runfolder import join_uri, run_uri, split_uri
from elastic_train.training.losses import chunked_head_applies, hf_model_of

CACHE_SUBFOLDER = "compile_cache"  # in the run folder: one mega-cache file per rank that compiled


def compile_model(model: nn.Module, class_names: list[str], backend: str = "inductor") -> int:
    """Compile `model` in place (or each of its modules whose class is in `class_names`) with
    dynamic rows and length from the first call (module docstring). Returns how many modules
    were compiled; raises naming the classes the model lacks. `backend`: tests count graphs
    with "eager" (dynamo's graphs and guards are the same; nothing is code-generated)."""
    if not class_names:
        # a Hugging Face LM with a plain head (LoRA's base too) is called by the loss through
        # `base_model`, the head applied chunk by chunk (losses.py): compiling the outer module
        # would compile nothing
        hf = hf_model_of(model)
        target = hf.base_model if hf is not None and chunked_head_applies(hf) else model
        target.compile(dynamic=True, backend=backend)
        return 1
    chosen = [m for m in model.modules() if type(m).__name__ in class_names]
    missing = sorted(set(class_names) - {type(m).__name__ for m in chosen})
    if missing:
        have = sorted({type(m).__name__ for m in model.modules() if m is not model})
        raise ValueError(f"train.compile_modules: no module of class {', '.join(missing)} in "
                         f"{type(model).__name__} (its classes: {', '.join(have)})")
    for module in chosen:
        module.compile(dynamic=True, backend=backend)
    return len(chosen)


def cache_folder(cfg: Config) -> str:
    """The node-local folder of Inductor's caches for this run: `train.compile_cache_dir`, else
    `<tmp>/elastic_train_compile/<run name>-<hash of the run folder>`: every attempt of the run on
    this node shares it, and no other run's compiled code mixes in."""
    if cfg.train.compile_cache_dir:
        return os.path.abspath(os.path.expanduser(cfg.train.compile_cache_dir))
    key = hashlib.sha256(run_uri(cfg).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), "elastic_train_compile", f"{cfg.run.name}-{key}")


def _counts() -> dict[str, int]:
    """This process's compile counters so far (dynamo's, Inductor's and AOTAutograd's)."""
    from torch._dynamo.utils import counters

    return {
        "graphs": counters["stats"]["unique_graphs"],
        "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_misses": counters["aot_autograd"]["autograd_cache_miss"],
    }


@dataclass
class CompileWatch:
    """One process's compiled model: the caches set up before its first step, and after each
    step the graphs it compiled or loaded logged, and new ones saved to the run folder."""

    cfg: Config
    world_rank: int
    modules: int = 0
    seeded: int = 0  # artifacts loaded from the run folder at start
    last: dict[str, int] = field(default_factory=dict)

    def start(self) -> None:
        """Point Inductor at the run's node-local cache, and fill it from the run folder's saved
        artifacts (a node new to the run starts warm). Call before anything compiles."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_folder(self.cfg)
        for blob in _read_saved(self.cfg):
            info = torch.compiler.load_cache_artifacts(blob)
            self.seeded += sum(map(len, info.artifacts.values())) if info is not None else 0
        self.last = _counts()

    def after_step(self, step: int, step_s: float, log_event: Any) -> None:
        """If this step compiled or loaded graphs (a first step, a new shape, evaluation's mode),
        log how many, and save this process's artifacts to the run folder if any was new."""
        now = _counts()
        if now == self.last:
            return
        delta = {k: now[k] - self.last.get(k, 0) for k in now}
        self.last = now
        log_event({"event": "compile", "rank": self.world_rank, "step": step, "step_s": step_s,
                   "modules": self.modules, "seeded_artifacts": self.seeded,
                   "new_graphs": delta["graphs"], "total_graphs": now["graphs"],
                   "loaded": delta["fx_hits"], "compiled": delta["fx_misses"],
                   "aot_loaded": delta["aot_hits"], "aot_compiled": delta["aot_misses"]})
        if delta["fx_misses"] or delta["aot_misses"]:
            _save_artifacts(self.cfg, self.world_rank)


def _saved_folder(cfg: Config) -> str:
    """Where the run folder keeps saved artifacts: per torch version (another's never match)."""
    fs_version = torch.__version__.replace("+", "_")
    return join_uri(run_uri(cfg), CACHE_SUBFOLDER, f"torch-{fs_version}")


def _read_saved(cfg: Config) -> list[bytes]:
    import pyarrow.fs as pafs

    fs, folder, _ = split_uri(_saved_folder(cfg))
    infos = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    blobs = []
    for info in sorted(infos, key=lambda i: i.path):
        if info.type == pafs.FileType.File and info.path.endswith(".bin"):
            with fs.open_input_stream(info.path) as f:
                blobs.append(f.read())
    return blobs


def _save_artifacts(cfg: Config, world_rank: int) -> None:
    """This process's artifacts (compiled and loaded) as `rank-<r>.bin`, written whole: to a
    temporary name, then moved over the old one."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return
    fs, folder, _ = split_uri(_saved_folder(cfg))
    fs.create_dir(folder, recursive=True)
    final = f"{folder}/rank-{world_rank}.bin"
    scratch = f"{final}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    with fs.open_output_stream(scratch) as f:
        f.write(saved[0])
    fs.move(scratch, final)


def prepare_compile(cfg: Config, world_rank: int) -> CompileWatch | None:
    """The watch of a run with train.compile, started (caches set up); None without compile."""
    if not cfg.train.compile:
        return None
    watch = CompileWatch(cfg, world_rank)
    watch.start()
    return watch
