"""Live progress on the driver: a rich progress bar on a terminal, periodic lines elsewhere.

It polls the RunLog actor (the workers never wait for it), so it survives restarts and resizes;
the ETA comes from the recent step rate of the current attempt.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_train.observe.stragglers import RANK_BUSY, STRAGGLER_RATIO, straggler
from elastic_train.observe.summary import attempt_counts


def _eta_s(history: list[tuple[float, int]], step: int, max_steps: int) -> float | None:
    if len(history) < 2 or history[-1][1] == history[0][1]:
        return None
    (t0, s0), (t1, s1) = history[0], history[-1]
    return (max_steps - step) * (t1 - t0) / (s1 - s0)


def format_line(latest: dict[str, Any], attempts: list[dict], max_steps: int, eta_s,
                latest_eval: dict[str, Any] | None = None) -> str:
    eta = f"{eta_s:.0f}s" if eta_s is not None else "?"
    evaluated = (f"eval {latest_eval['eval_loss']:.4f} (best {latest_eval['best_eval_loss']:.4f} "
                 f"@{latest_eval['best_step']}) " if latest_eval else "")
    return (f"step {latest['step']}/{max_steps} epoch {latest['epoch']} "
            f"loss {latest['loss']:.4f} {evaluated}lr {latest['lr']:.2e} "
            f"tok/s {latest.get('window_tokens_per_s', latest['tokens_per_s']):.0f} "
            f"workers {latest['world_size']} "
            f"restarts {attempt_counts(attempts)['restarts']} eta {eta}{_straggler_note(latest)}")


def _straggler_note(latest: dict[str, Any]) -> str:
    """' slowest rank R Nx' when one rank's busy time is notably above the others'."""
    found = straggler(latest.get(RANK_BUSY) or [])
    if found is None or found[1] < STRAGGLER_RATIO:
        return ""
    rank, ratio = found
    return f" slowest rank {rank} {ratio:.1f}x"


class Progress:
    """Start with the RunLog handle, stop when fit returns. mode: auto | bar | lines | none."""

    def __init__(self, max_steps: int, mode: str = "auto", every_steps: int = 10,
                 interval_s: float = 0.5, stream=None) -> None:
        self.stream = stream or sys.stdout
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode, self.max_steps, self.every_steps = mode, max_steps, every_steps
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._latest_eval: dict[str, Any] | None = None
        # gate(failures, attempts, latest): False holds a line back (the driver's run watch has
        # yet to print the line of the failure that began `latest`'s attempt: api.py)
        self.gate: Callable[[list, list, dict], bool] = lambda failures, attempts, latest: True
        self._failures: list[dict] = []

    def set_total(self, total_steps: int) -> None:
        """The steps the run will train (data/horizon.py: epochs and train.max_steps counted),
        when known before it starts; the count shown and the ETA go to it."""
        self.max_steps = total_steps

    def start(self, runlog, poll: Callable[[], dict[str, Any]]) -> None:
        """Call `poll()` (the RunLog's `progress()`: cluster/runlog.py's `poll_progress`) every
        interval_s."""
        if self.mode == "none":
            return
        self._fetch = poll
        self._thread = threading.Thread(target=self._run, args=(runlog,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self, runlog) -> None:
        if self.mode == "bar":
            self._run_bar(runlog)
        else:
            self._run_lines(runlog)

    def _poll(self, runlog, history: list) -> tuple[dict | None, list, float | None]:
        try:
            state = self._fetch()
        except Exception:  # the actor is gone at shutdown
            return None, [], None
        latest = state["latest"]
        self._latest_eval = state.get("latest_eval")
        self._failures = state.get("failures", [])
        if latest is None or not self.gate(self._failures, state["attempts"], latest):
            return None, state["attempts"], None
        if history and history[-1][1] > latest["step"]:
            history.clear()  # a restart went back to its checkpoint
        history.append((time.time(), latest["step"]))
        del history[:-30]
        return latest, state["attempts"], _eta_s(history, latest["step"], self.max_steps)

    def _run_lines(self, runlog) -> None:
        history: list = []
        printed = -1
        while not self._stop.wait(self.interval_s):
            latest, attempts, eta = self._poll(runlog, history)
            if self._stop.is_set():  # stopped while it polled: the run's end line is out
                return
            if latest and latest["step"] // self.every_steps != printed:
                printed = latest["step"] // self.every_steps
                line = format_line(latest, attempts, self.max_steps, eta, self._latest_eval)
                self.stream.write(line + "\n")  # one write, as runwatch.py's lines
                self.stream.flush()

    def _run_bar(self, runlog) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        columns = [TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}")]
        history: list = []
        with RichProgress(*columns, console=Console(file=self.stream), transient=False) as bar:
            task = bar.add_task("train", total=self.max_steps, info="starting workers...")
            while not self._stop.wait(self.interval_s):
                latest, attempts, eta = self._poll(runlog, history)
                if latest:
                    info = format_line(latest, attempts, self.max_steps, eta,
                                       self._latest_eval).split(" ", 2)[2]
                    bar.update(task, completed=latest["step"], info=info)
