"""A Ray run held to one that was never interrupted (`localenv.train_locally` of the same config,
or an uninterrupted Ray run): every step's ids and loss, every checkpoint's data cursors, the
final weights to the bit. Shared by the tests of faults in series (test_repeated_faults.py) and
of resizes in series (test_elastic.py)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from test_train_ray import effective_ids, losses

from elastic_train.training.checkpoint import read_shards


def saved_cursors(run_dir: Path) -> dict[int, dict]:
    """step -> the data cursors of the run folder's checkpoint of that step."""
    out = {}
    for folder in sorted(p for p in run_dir.glob("checkpoint_*") if (p / "state.json").is_file()):
        state = json.loads((folder / "state.json").read_text())["train_state"]
        out[state["step"]] = state["cursors"]
    return out


def uninterrupted_ray_run(result) -> SimpleNamespace:
    """A Ray run that was never interrupted, in the form of `train_locally`'s result."""
    return SimpleNamespace(consumed=effective_ids(result), final={"model": read_shards(
        result.checkpoint_path, "model")}, cursors=saved_cursors(Path(result.run_dir)),
        steps=[{"step": step, "loss": loss} for step, loss in losses(result).items()])


def check_against_uninterrupted(result, reference) -> None:
    """The run `result` against `reference` (train_locally of the same config, or
    uninterrupted_ray_run): every step's ids and loss, every checkpoint's cursors, the final
    weights to the bit. A checkpoint of a step the reference did not save (one a resize or a
    drain asked for) needs a reference that saved every step (checkpoint.every_steps=1)."""
    assert effective_ids(result) == reference.consumed
    got, want = losses(result), {r["step"]: r["loss"] for r in reference.steps}
    assert got.keys() == want.keys()
    assert max(abs(got[s] - want[s]) / want[s] for s in want) < 1e-12
    cursors = saved_cursors(Path(result.run_dir))
    assert len(cursors) >= 5
    for step, saved in cursors.items():  # the last: an epoch's end, with or without its cursors
        assert step == max(want) or saved == reference.cursors.get(step, {}), step
    final = read_shards(result.checkpoint_path, "model")
    for name, tensor in reference.final["model"].items():
        assert torch.equal(final[name], tensor), name
