"""Per-step scalars for TensorBoard (`log.tensorboard=true`): `<run folder>/tensorboard/`.

The RunLog actor hands it every step record. Each attempt gets its own subfolder
(`tensorboard/attempt_000`, ...), so TensorBoard draws it as its own run: the steps an attempt
replays after a restart show up as a second curve over the same steps, not as a zig-zag.
Events are flushed after every record, since the actor is killed at the end of a run.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

NOT_SCALARS = ("step", "time", "attempt")  # the x axis, the wall time, the subfolder


class TensorBoardWriter:
    """`write(record)` adds every numeric field of a metrics record as a scalar at its step."""

    def __init__(self, run_folder_local_path: str | Path) -> None:
        self.root = Path(run_folder_local_path) / "tensorboard"
        self._writers: dict[int, Any] = {}
        self._lock = threading.Lock()  # the RunLog's threads: one writer an attempt, not one each

    def _writer(self, attempt: int):
        with self._lock:
            if attempt not in self._writers:
                from torch.utils.tensorboard import SummaryWriter  # torch loads only when asked for

                self._writers[attempt] = SummaryWriter(str(self.root / f"attempt_{attempt:03d}"))
            return self._writers[attempt]

    def write(self, record: dict[str, Any]) -> None:
        writer = self._writer(int(record.get("attempt", 0)))
        walltime = record.get("time")
        for key, value in record.items():
            if key in NOT_SCALARS or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue  # a skipped step's non-finite grad norm would spoil the chart's scale
            writer.add_scalar(key, float(value), global_step=record["step"], walltime=walltime)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
