"""A tqdm bar on stderr: packages delivered of submitted, and the live figures."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

from mesh.sim.types import SimRun

__all__ = ["ProgressBar"]


class ProgressBar:
    """Pass as ``on_progress``; it is called on every task end and every sample."""

    def __init__(
        self,
        total: int,
        desc: str = "packages",
        *,
        file: TextIO | None = None,
        disable: bool = False,
    ) -> None:
        self._bar: tqdm[Any] = tqdm(
            total=total, desc=desc, unit="pkg", file=file or sys.stderr, disable=disable, leave=True
        )
        self._done = 0

    def __call__(self, run: SimRun) -> None:
        figures: dict[str, Any] = {
            "delivered": sum(t.is_delivered for t in run.tasks),
        }
        if run.samples:
            cap = run.samples[-1].capacity
            figures["workers"] = cap.get("tickets", cap.get("sessions", {}).get("total"))
            figures["queue"] = cap.get("queue_len")
            slowest = cap.get("measured_tps", {}).get("min")
            figures["min_tps"] = f"{slowest:.1f}" if isinstance(slowest, int | float) else "–"
        finished = sum(t.done_t is not None for t in run.tasks)
        self._bar.set_postfix(figures, refresh=finished == self._done)
        if finished > self._done:
            self._bar.update(finished - self._done)  # refreshes
            self._done = finished

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
