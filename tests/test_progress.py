"""Tests for the live progress display: a rich bar on a pseudo-terminal, lines on a pipe.

A small script drives `Progress` with a scripted poll (no Ray): 20 steps planned, steps 1-5 on
2 workers, a restart back to step 3 on 1 worker, then on to step 7.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pexpect
import pytest

from elastic_train.observe.progress import _eta_s, format_line

pytestmark = pytest.mark.unit

SCRIPT = textwrap.dedent('''
    import sys, time
    from elastic_train.observe.progress import Progress

    attempts = [{"attempt": 0, "world_size": 2, "start_time": 0.0}]
    steps = [None, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]
    polls = 0

    def poll():
        global polls
        step = steps[min(polls, len(steps) - 1)]
        polls += 1
        if polls == 7:
            attempts.append({"attempt": 1, "world_size": 1, "start_time": 1.0})
        latest = None if step is None else {
            "step": step, "epoch": 0, "loss": 5.0 - 0.1 * step, "lr": 1e-3,
            "tokens_per_s": 1234.0, "world_size": attempts[-1]["world_size"]}
        return {"latest": latest, "attempts": list(attempts), "fatal": None}

    progress = Progress(20, "auto", every_steps=2, interval_s=0.05, stream=sys.stdout)
    print("mode", progress.mode, flush=True)
    progress.start(runlog=None, poll=poll)
    while polls < len(steps) + 3:
        time.sleep(0.05)
    progress.stop()
    print("done", flush=True)
''')


def test_bar_on_a_terminal(tmp_path):
    script = tmp_path / "drive.py"
    script.write_text(SCRIPT)
    child = pexpect.spawn(sys.executable, [str(script)], dimensions=(24, 120), timeout=30,
                          env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "120"},
                          encoding="utf-8")
    child.expect("mode bar")
    child.expect("done")
    screen = child.before
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, screen
    assert "train" in screen and "7/20" in screen, screen
    assert "\x1b[" in screen  # drawn with escape sequences, in place
    assert "workers 1 restarts 1" in screen, screen


def test_lines_on_a_pipe(tmp_path):
    script = tmp_path / "drive.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "mode lines" and lines[-1] == "done"
    progress = lines[1:-1]
    assert progress and all(re.fullmatch(r"step \d+/20 epoch 0 loss \S+ lr \S+ tok/s 1234 "
                                         r"workers \d restarts \d eta \S+", x) for x in progress)
    steps = [int(x.split()[1].split("/")[0]) for x in progress]
    assert steps[0] == 1 and steps[-1] in (6, 7)  # a line each time step // every_steps changes
    assert "workers 2 restarts 0" in progress[0] and "workers 1 restarts 1" in progress[-1]
    assert "\x1b[" not in out


def test_format_line_and_eta():
    latest = {"step": 7, "epoch": 1, "loss": 2.5, "lr": 3e-4, "tokens_per_s": 5000.4,
              "world_size": 3}
    line = format_line(latest, [{}, {}], 20, 13.2)
    assert line == ("step 7/20 epoch 1 loss 2.5000 lr 3.00e-04 tok/s 5000 workers 3 "
                    "restarts 1 eta 13s")
    assert format_line(latest, [], 20, None).endswith("restarts 0 eta ?")
    evaluated = {"eval_loss": 2.75, "best_eval_loss": 2.625, "best_step": 4}
    assert "loss 2.5000 eval 2.7500 (best 2.6250 @4) lr" in format_line(latest, [], 20, None, evaluated)
    assert _eta_s([(0.0, 2), (10.0, 7)], 7, 20) == pytest.approx(26.0)
    assert _eta_s([(0.0, 2)], 2, 20) is None


def test_a_new_attempts_lines_wait_for_the_line_of_the_failure_that_began_it():
    """The run watch's gate: a step line of attempt 1 is held back until the failure before it
    has had its line; attempt 0's lines, and lines once the watch has stopped, pass."""
    import io

    from elastic_train.cluster.runwatch import RunWatch
    from elastic_train.config import load_config
    from elastic_train.observe.progress import Progress

    watch = RunWatch(load_config(None), None, abort=lambda: None, describe_wait=lambda: "")
    attempts = [{"attempt": 0, "world_size": 2, "start_time": 0.0},
                {"attempt": 1, "world_size": 2, "start_time": 6.0}]
    failures = [{"kind": "worker_died", "time": 5.0}]
    step = {"step": 22, "epoch": 0, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 10.0,
            "world_size": 2, "attempt": 1}
    assert watch.announced(failures, attempts, {**step, "attempt": 0})
    assert not watch.announced(failures, attempts, step)
    stream = io.StringIO()
    progress = Progress(60, "lines", every_steps=1, interval_s=0.01, stream=stream)
    progress.gate = watch.announced
    progress._fetch = lambda: {"latest": step, "attempts": attempts, "failures": failures}
    assert progress._poll(None, [])[0] is None  # held back
    watch.printed.add(0)  # the failure's line is out
    assert progress._poll(None, [])[0] == step


class _Writes:
    """A stream that keeps each write apart, as an unbuffered sys.stderr passes each to the pipe."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_the_watch_and_progress_write_each_line_whole():
    """A failure's line (stderr, the watch's thread) and a progress line (stdout, the progress
    thread) share the user's pipe: each line, newline included, must be one write, or one lands
    inside the other ("... with 2 workersstep 14/14 ...", seen in CI)."""
    import threading

    from elastic_train.cluster.runwatch import RunWatch
    from elastic_train.config import load_config
    from elastic_train.observe.progress import Progress

    watch_stream, progress_stream = _Writes(), _Writes()
    watch = RunWatch(load_config(None), None, abort=lambda: None, describe_wait=lambda: "",
                     stream=watch_stream)
    watch._print("attempt 0: rank 1 failed at step 8: its process died; restarting")
    step = {"step": 3, "epoch": 0, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 10.0,
            "world_size": 2, "attempt": 0}
    progress = Progress(6, "lines", every_steps=1, interval_s=0.01, stream=progress_stream)
    polled = threading.Event()

    def fetch():
        polled.set()
        return {"latest": step, "attempts": [], "failures": []}

    progress._fetch = fetch
    thread = threading.Thread(target=progress._run_lines, args=(None,))
    thread.start()
    polled.wait(10)
    progress._stop.set()
    thread.join(10)
    writes = watch_stream.writes + progress_stream.writes
    assert len(progress_stream.writes) >= 1 and len(watch_stream.writes) == 1
    assert all(text.endswith("\n") and text.count("\n") == 1 for text in writes), writes
