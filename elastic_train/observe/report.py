"""`elastic-train report RUN_FOLDER`: a run's figures on the terminal, and two plots beside them.

It reads the run folder's files only (no Ray): `metrics.jsonl`, `events.jsonl`, `attempts.json`
and `summary.json`. Lines of the JSONL files that are cut short, not JSON, or not records of this
project (a field missing or not a number) are skipped, and the console says how many; a corrupt
`attempts.json` or `summary.json` is an error naming the file. Without a summary.json, or with
one older than the metrics (a resumed run that is still going, or whose driver died), the summary
is computed from the logs up to their last line.
`loss.png` shows loss against step for every attempt (a replayed step appears once per attempt),
and the eval loss when the run evaluated, and `throughput.png` shows tokens/s against wall time;
both mark each restart and resize. `ranks.png` (when the records carry every rank's figures) shows
each rank's busy time per step.

The PNGs go into `--output` when given, else into the run folder; a run folder on remote storage
(`s3://`, `gs://`: any pyarrow.fs URI) is read through a temporary local copy of those four files
and its PNGs go into `./<run name>-report/` in the current folder (the output says where).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from elastic_train.config import redact
from elastic_train.observe.runfolder import local_copy
from elastic_train.observe.stragglers import RANK_BUSY
from elastic_train.observe.summary import build_summary, effective_records, ledger, split_records

RUN_FILES = ("metrics.jsonl", "events.jsonl", "attempts.json", "summary.json")  # what it reads
LEDGER_PARTS = ("startup_s", "productive_s", "recovery_s", "replayed_s", "checkpoint_s",
                "data_wait_s", "eval_s", "shutdown_s", "other_s")


@dataclass
class RunFiles:
    """What a run folder holds, parsed."""

    folder: Path
    records: list[dict[str, Any]]
    events: list[dict[str, Any]]
    attempts: list[dict[str, Any]]
    summary: dict[str, Any]
    summary_source: str  # "summary.json" or why it was computed from the logs
    skipped: dict[str, int] = field(default_factory=dict)  # file -> corrupt/foreign lines left out
    evals: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl's evaluation records


@dataclass
class Mark:
    """The start of an attempt after the first: a vertical line on both plots."""

    kind: str  # "restart" (same world size) or "resize" (the world size changed)
    attempt: int
    step: float | None  # on the loss plot: the step it resumed from (None: it logged no step)
    time: float | None  # absolute wall time of the attempt's start
    world_sizes: tuple[int | None, int | None]  # (before, after)
    label: str


@dataclass
class Report:
    """What `make_report` printed and drew."""

    run: RunFiles
    marks: list[Mark]  # every attempt boundary found
    loss_marks: list[Mark]  # those drawn on loss.png
    throughput_marks: list[Mark]  # those drawn on throughput.png
    loss_png: Path
    throughput_png: Path
    ranks_png: Path | None = None  # None: no record carries per-rank figures (one worker, old run)


def fit_start_time(records: list[dict], events: list[dict], attempts: list[dict]) -> float:
    """When the latest fit began: its `fit_start` event, else the earliest evidence of one."""
    starts = [e["time"] for e in events if e.get("event") == "fit_start"]
    if starts:
        return starts[-1]
    if attempts:
        return attempts[0]["start_time"]
    return min(r["time"] - r["step_time_s"] for r in records)


def run_origin(run: RunFiles) -> float:
    """Time zero of the plots: the first start of the run (a resumed run spans several fits)."""
    candidates = [e["time"] for e in run.events if e.get("event") == "fit_start"]
    candidates += [a["start_time"] for a in run.attempts]
    candidates += [r["time"] - r["step_time_s"] for r in run.records[:1]]
    return min(candidates)


# The fields of a metrics.jsonl record that the report reads: numbers all.
RECORD_NUMBERS = ("step", "attempt", "world_size", "loss", "time", "step_time_s", "data_wait_s",
                  "real_tokens", "padded_tokens", "tokens_per_s")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_record(line: Any) -> bool:
    """A metrics.jsonl record this report can draw (finite time, numbers where numbers go)."""
    return (isinstance(line, dict) and all(_is_number(line.get(k)) for k in RECORD_NUMBERS)
            and math.isfinite(line["time"]) and math.isfinite(line["step_time_s"]))


EVAL_NUMBERS = ("step", "attempt", "time", "eval_loss", "eval_s")


def is_eval_record(line: Any) -> bool:
    """A metrics.jsonl evaluation record (`eval_loss` and the numbers drawn with it)."""
    return (isinstance(line, dict) and all(_is_number(line.get(k)) for k in EVAL_NUMBERS)
            and math.isfinite(line["time"]))


def is_event(line: Any) -> bool:
    """An events.jsonl record: a time and an event name (data_read ones with their counts)."""
    if not (isinstance(line, dict) and _is_number(line.get("time"))
            and isinstance(line.get("event"), str)):
        return False
    if line["event"] == "data_read":
        return all(_is_number(line.get(k)) for k in ("attempt", "rank", "rows_read", "bytes_read"))
    return True


def read_lines(path: Path, valid: Callable[[Any], bool]) -> tuple[list[dict[str, Any]], int]:
    """The valid JSON lines of a file (none if absent), and how many others were skipped."""
    if not path.is_file():
        return [], 0
    kept, skipped = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # cut short by a crash, or not JSON at all
            skipped += 1
            continue
        if valid(record):
            kept.append(record)
        else:
            skipped += 1
    return kept, skipped


def _read_json_file(path: Path, valid: Callable[[Any], bool], what: str) -> Any:
    """A JSON file's content; ValueError naming the file if it is not JSON or not `what`."""
    try:
        content = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"run file '{path}' is corrupt: {exc}") from None
    if not valid(content):
        raise ValueError(f"run file '{path}' is corrupt: not {what}")
    return content


def _is_attempts(content: Any) -> bool:
    return isinstance(content, list) and all(
        isinstance(a, dict) and _is_number(a.get("attempt")) and _is_number(a.get("world_size"))
        and _is_number(a.get("start_time")) for a in content)


def summary_from_logs(folder: Path, records: list[dict], events: list[dict],
                      attempts: list[dict], reason: str, evals: list[dict]) -> dict[str, Any]:
    """build_summary, but ending at the logs' last line rather than now, and over the lines
    that were kept (build_summary reads a copy of them, never the corrupt or foreign ones)."""
    start = fit_start_time(records, events, attempts)
    end = max([r["time"] for r in records] + [e["time"] for e in events])
    with tempfile.TemporaryDirectory(prefix="elastic-train-report-") as clean:
        for name, lines in (("metrics.jsonl", records + evals), ("events.jsonl", events)):
            Path(clean, name).write_text("".join(json.dumps(line) + "\n" for line in lines))
        Path(clean, "attempts.json").write_text(json.dumps(attempts))
        summary = build_summary(clean, start_time=start)
    wall = max(end - start, 1e-9)
    fit_real = sum(r["real_tokens"] for r in effective_records(records).values()
                   if r["time"] >= start)
    summary.update(status="incomplete", reason=reason, wall_s=wall, tokens_per_s=fit_real / wall,
                   ledger=ledger(records, events, start, end, evals))
    summary["goodput"] = summary["ledger"]["goodput"]
    return summary


def load_run(folder: str | Path) -> RunFiles:
    """Parse a run folder; FileNotFoundError when it has no step logged, ValueError naming a
    corrupt attempts.json or summary.json."""
    folder = Path(folder)
    metrics = folder / "metrics.jsonl"
    if folder.exists() and not folder.is_dir():
        raise FileNotFoundError(f"run folder {folder} is a file, not a run folder")
    if not folder.is_dir():
        raise FileNotFoundError(f"run folder {folder} does not exist")
    lines, skipped_records = read_lines(metrics, lambda r: is_record(r) or is_eval_record(r))
    records, evals = split_records(lines)
    if not records:
        what = ("no metrics.jsonl" if not metrics.is_file() else
                f"no step in {metrics} ({skipped_records} corrupt or foreign lines)"
                if skipped_records else "an empty metrics.jsonl")
        raise FileNotFoundError(f"run folder {folder} has {what}: no step was logged yet")
    events, skipped_events = read_lines(folder / "events.jsonl", is_event)
    skipped = {name: n for name, n in (("metrics.jsonl", skipped_records),
                                       ("events.jsonl", skipped_events)) if n}
    attempts_path = folder / "attempts.json"
    attempts = (_read_json_file(attempts_path, _is_attempts, "a list of attempts")
                if attempts_path.is_file() else [])
    summary_path = folder / "summary.json"
    summary = (_read_json_file(summary_path, lambda c: isinstance(c, dict), "a JSON object")
               if summary_path.is_file() else None)
    if summary is None:
        source = "computed from the logs: no summary.json (still running, or the driver died)"
    elif _older_than_the_logs(summary, summary_path, metrics, records, attempts):
        source = "computed from the logs: summary.json is older than metrics.jsonl (resumed run)"
    else:
        return RunFiles(folder, records, events, attempts, summary, "summary.json", skipped, evals)
    summary = summary_from_logs(folder, records, events, attempts, source, evals)
    return RunFiles(folder, records, events, attempts, summary, source, skipped, evals)


def _older_than_the_logs(summary: dict, path: Path, metrics: Path, records: list[dict],
                         attempts: list[dict]) -> bool:
    """Whether summary.json is an earlier fit's (a resumed run still training, or whose driver
    died): it says when it was written (`written_at`), later than every step record and
    attempt start of the fit it sums up. Files' times decide for one written before
    `written_at` existed; never for remote storage, whose objects take the time of their last
    upload (a staging copy uploads the old summary again with the new logs)."""
    written = summary.get("written_at")
    if not isinstance(written, int | float):
        return path.stat().st_mtime + 1.0 < metrics.stat().st_mtime
    latest = max([r.get("time", 0) for r in records]
                 + [a.get("start_time", 0) for a in attempts if isinstance(a, dict)])
    return latest > written + 1.0


def by_attempt(records: list[dict]) -> dict[int, list[dict]]:
    """attempt -> its records, in the order they were logged."""
    out: dict[int, list[dict]] = {}
    for rec in records:
        out.setdefault(rec["attempt"], []).append(rec)
    return dict(sorted(out.items()))


def find_marks(records: list[dict], attempts: list[dict]) -> list[Mark]:
    """One mark per attempt after the first, from attempts.json and the metrics' attempt ids."""
    groups = by_attempt(records)
    known = {a["attempt"]: a for a in attempts}
    ids = sorted(set(groups) | set(known))
    marks, previous_ws, last_step = [], None, None
    for k in ids:
        recs = groups.get(k, [])
        ws = known[k]["world_size"] if k in known else (recs[0]["world_size"] if recs else None)
        if k != ids[0]:
            step = recs[0]["step"] - 1 if recs else None
            when = known[k]["start_time"] if k in known else (
                recs[0]["time"] - recs[0]["step_time_s"] if recs else None)
            resized = None not in (previous_ws, ws) and ws != previous_ws
            label = f"attempt {k}: " + (f"resize {previous_ws}→{ws} workers" if resized
                                        else "restart")
            if last_step is not None:
                label += f" after step {last_step}"
            if step is not None:
                label += f", resumed from step {step:g}"
            marks.append(Mark("resize" if resized else "restart", k, step, when,
                              (previous_ws, ws), label))
        previous_ws = ws if ws is not None else previous_ws
        last_step = max((r["step"] for r in recs), default=last_step)
    return marks


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def build_table(run: RunFiles):
    """The rich Table of a run's figures and its goodput ledger."""
    from rich.table import Table

    s = run.summary
    table = Table(title=f"run {run.folder.name}", caption=f"source: {run.summary_source}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("share of wall", justify="right")
    status = s.get("status", "?")
    if status == "failed":
        status += f": {s.get('reason')}"
    table.add_row("status", status)
    table.add_row("steps", f"{s.get('steps')} (epochs completed {s.get('epochs_completed', '-')})")
    table.add_row("loss first → final", f"{_fmt(s.get('first_loss'), '.4f')} → "
                                        f"{_fmt(s.get('final_loss'), '.4f')}")
    if s.get("best_eval_loss") is not None:
        table.add_row("eval loss final (best @ step)", f"{_fmt(s.get('final_eval_loss'), '.4f')} "
                      f"({_fmt(s.get('best_eval_loss'), '.4f')} @ {s.get('best_step')})")
    table.add_row("real tokens", _fmt(s.get("real_tokens"), ","))
    table.add_row("tokens/s (whole fit)", _fmt(s.get("tokens_per_s"), ",.0f"))
    stepping = sum(r["step_time_s"] for r in effective_records(run.records).values())
    real = sum(r["real_tokens"] for r in effective_records(run.records).values())
    table.add_row("tokens/s (while stepping)", _fmt(real / stepping if stepping else None, ",.0f"))
    table.add_row("padding efficiency", _fmt(s.get("padding_efficiency"), ".3f"))
    table.add_row("restarts", _fmt(s.get("restarts")))
    table.add_row("world sizes", " → ".join(str(w) for w in s.get("world_sizes", [])) or "-")
    table.add_row("skipped steps", _fmt(s.get("skipped_steps")))
    table.add_row("replayed steps", _fmt(s.get("replayed_steps")))
    if s.get("slowest_rank") is not None:
        table.add_row("slowest rank (busy p50 / others')",
                      f"{s['slowest_rank']} on {s.get('slowest_node') or '?'}: "
                      f"{_fmt(s.get('slowest_ratio'), '.2f')}x")
    table.add_section()
    lg = s.get("ledger") or {}
    wall = lg.get("wall_s") or s.get("wall_s")
    table.add_row("goodput", _fmt(s.get("goodput"), ".1%"))
    table.add_row("wall", f"{_fmt(wall, '.1f')} s", "100%")
    for part in LEDGER_PARTS:
        seconds = lg.get(part)
        share = f"{seconds / wall:.1%}" if seconds is not None and wall else "-"
        table.add_row(f"  {part[:-2].replace('_', ' ')}", f"{_fmt(seconds, '.1f')} s", share)
    return table


def _attempt_colour(k: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](k % 10)


def _attempt_label(k: int, recs: list[dict]) -> str:
    ws = recs[0]["world_size"]
    return f"attempt {k} ({ws} worker{'s' if ws != 1 else ''})"


def _figure():
    """A figure outside pyplot: no global state, rendered by Agg whatever the backend."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 5), dpi=110)
    return fig, fig.add_subplot()


def _save(fig, ax, path: Path) -> None:
    """Grid, legend, layout, and the PNG: how every plot of the report ends (ValueError naming
    the file when it cannot be written: a read-only run folder, say)."""
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as exc:
        raise ValueError(f"cannot write '{path}': {exc.strerror or exc} (--output DIR writes the "
                         "figures elsewhere)") from None


def _draw_marks(ax, marks: list[Mark], xs: list[float | None]) -> list[Mark]:
    """Vertical line and label per mark at its x (None: not drawn); returns the marks drawn."""
    drawn = []
    for mark, x in zip(marks, xs, strict=True):
        if x is None:
            continue
        colour = "tab:red" if mark.kind == "restart" else "tab:purple"
        ax.axvline(x, color=colour, linestyle="--", linewidth=1.2)
        ax.text(x, 0.98, " " + mark.label, transform=ax.get_xaxis_transform(), rotation=90,
                va="top", ha="right", fontsize=8, color=colour,
                bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1})
        drawn.append(mark)
    return drawn


def plot_loss(run: RunFiles, marks: list[Mark], path: Path) -> list[Mark]:
    """loss.png: loss per step, one colour per attempt; superseded (replayed) records hollow;
    the eval loss (each step's latest evaluation) on the same axes."""
    kept = {id(r) for r in effective_records(run.records).values()}
    fig, ax = _figure()
    for k, recs in by_attempt(run.records).items():
        colour = _attempt_colour(k)
        ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], color=colour,
                marker="o", markersize=3, linewidth=1.2,
                label=_attempt_label(k, recs))
        replayed = [r for r in recs if id(r) not in kept]
        if replayed:
            ax.plot([r["step"] for r in replayed], [r["loss"] for r in replayed], linestyle="none",
                    marker="o", markersize=7, markerfacecolor="none", color=colour,
                    label=f"attempt {k}: steps replayed later")
    evals = effective_records(run.evals, steps=run.records)
    if evals:
        ax.plot(list(evals), [r["eval_loss"] for r in evals.values()], color="black",
                marker="s", markersize=5, linewidth=1.6, label="eval loss (held out)")
    drawn = _draw_marks(ax, marks, [m.step for m in marks])
    ax.set(xlabel="step", ylabel="loss", title=f"{run.folder.name}: loss per step")
    _save(fig, ax, path)
    return drawn


def plot_throughput(run: RunFiles, marks: list[Mark], path: Path) -> list[Mark]:
    """throughput.png: tokens/s per step against wall time since the run's first start."""
    origin = run_origin(run)
    fig, ax = _figure()
    groups = by_attempt(run.records)
    previous_end, recovery_label = None, "recovery"
    for k, recs in groups.items():
        begin = recs[0]["time"] - recs[0]["step_time_s"] - origin
        if previous_end is not None and begin > previous_end:
            ax.axvspan(previous_end, begin, color="tab:red", alpha=0.08, linewidth=0,
                       label=recovery_label)
            recovery_label = None
        elif previous_end is None and begin > 0:
            ax.axvspan(0, begin, color="grey", alpha=0.12, linewidth=0, label="start-up")
        previous_end = recs[-1]["time"] - origin
        ax.plot([r["time"] - origin for r in recs], [r["tokens_per_s"] for r in recs],
                color=_attempt_colour(k), marker="o", markersize=3, linewidth=1.2,
                label=_attempt_label(k, recs))
    overall, goodput = run.summary.get("tokens_per_s"), run.summary.get("goodput")
    if overall:
        ax.axhline(overall, color="black", linestyle=":", linewidth=1,
                   label=f"fit average {overall:,.0f} tokens/s"
                         + (f" (goodput {goodput:.0%})" if goodput is not None else ""))
    drawn = _draw_marks(ax, marks, [None if m.time is None else m.time - origin for m in marks])
    ax.set(xlabel="wall time since the run started (s)", ylabel="tokens/s",
           title=f"{run.folder.name}: throughput per step")
    ax.set_ylim(bottom=0)
    _save(fig, ax, path)
    return drawn


def plot_ranks(run: RunFiles, path: Path) -> bool:
    """ranks.png: every rank's busy time (its step less its time in collectives) per step, one
    line per (attempt, rank); False (nothing drawn) when no record carries per-rank figures."""
    recs = [r for r in run.records if isinstance(r.get(RANK_BUSY), list)]
    if not recs:
        return False
    fig, ax = _figure()
    for k, group in by_attempt(recs).items():
        for rank in range(len(group[0][RANK_BUSY])):
            # a record carries the figures of the step before it
            ax.plot([r["step"] - 1 for r in group], [r[RANK_BUSY][rank] for r in group],
                    marker="o", markersize=2, linewidth=1,
                    label=f"attempt {k} rank {rank}")
    ax.set(xlabel="step", ylabel="busy time (s): step less time in collectives",
           title=f"{run.folder.name}: step time per rank")
    ax.set_ylim(bottom=0)
    _save(fig, ax, path)
    return True


def _download_run_files(fs: pafs.FileSystem, path: str, local: Path) -> None:
    """Copy `RUN_FILES` of a remote run folder into `local`, their times kept (a summary older
    than the metrics is recomputed)."""
    local.mkdir()
    for info in fs.get_file_info([f"{path}/{name}" for name in RUN_FILES]):
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as src:
                (local / info.base_name).write_bytes(src.read())
            if info.mtime is not None:
                os.utime(local / info.base_name, (info.mtime.timestamp(),) * 2)


def make_report(folder: str | os.PathLike, console=None,
                output: str | os.PathLike | None = None) -> Report:
    """Print the table to `console` (default: stdout) and write loss.png, throughput.png and,
    with per-rank figures, ranks.png into `output`: by default the run folder, or for a remote
    one `./<run name>-report/` (the report never writes to remote storage)."""
    from rich.console import Console

    console = console or Console()
    shown = redact.shown(os.fspath(folder).rstrip("/"))
    with local_copy(folder, _download_run_files, "elastic-train-report-") as (local, remote):
        run = load_run(local)
    figures = Path(output) if output is not None else (
        Path(f"{local.name}-report") if remote else local)
    try:
        figures.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot write the figures into '{figures}': {exc.strerror or exc}") from None
    for name, count in run.skipped.items():
        console.print(f"skipped {count} corrupt or foreign line(s) of {shown}/{name}")
    console.print(build_table(run))
    marks = find_marks(run.records, run.attempts)
    loss_png, throughput_png = figures / "loss.png", figures / "throughput.png"
    ranks_png = figures / "ranks.png"
    report = Report(run, marks, plot_loss(run, marks, loss_png),
                    plot_throughput(run, marks, throughput_png), loss_png, throughput_png,
                    ranks_png if plot_ranks(run, ranks_png) else None)
    written = [p for p in (report.loss_png, report.throughput_png, report.ranks_png) if p]
    where = " (the run folder is remote: --output DIR to write them elsewhere)" if (
        remote and output is None) else ""
    console.print("wrote " + ", ".join(str(p) for p in written) + where)
    return report


def run_report(folder: str, output: str | None = None) -> int:
    """The `report` subcommand: exit status 0 (a missing run raises FileNotFoundError)."""
    make_report(folder, output=output)
    return 0
