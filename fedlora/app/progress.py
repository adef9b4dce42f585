"""Round progress a person can follow: a live bar with ETA on a terminal, plain lines elsewhere.

On a terminal (stdout is a TTY) a rich progress bar shows the rounds done, the elapsed time and
the estimated time left, with the last round's line under it; in CI, logs and notebooks
(no TTY) every round prints one plain line, as ``fedlora run`` always did.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("fedlora")

#: ``None``: a live bar when stdout is a terminal; ``False``: always plain lines (set in the worker
#: processes of ``fedlora compare --workers``, which share the terminal and log to run.log).
LIVE: bool | None = None


class RoundProgress:
    """Report finished rounds ``first``..``total`` (see the module docstring)."""

    def __init__(self, total: int, first: int = 1, live: bool | None = None,
                 emit: Callable[[str], None] | None = None) -> None:
        self.total = total
        self.emit = emit or logger.info  # where the plain lines go
        if live is None:
            live = sys.stdout.isatty() if LIVE is None else LIVE
        self.live = live
        self._bar: Any = None
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), console=Console(), transient=False,
            )
            self._task = self._bar.add_task("rounds", total=total, completed=first - 1)
            self._bar.start()
            from fedlora.app.step_progress import StepTasks

            self._steps = StepTasks(self._bar)
            self._steps.attach()

    def round_done(self, server_round: int, line: str) -> None:
        if self._bar is None:
            self.emit(line)
            return
        self._bar.console.print(line, highlight=False)
        self._bar.update(self._task, completed=server_round)

    def close(self) -> None:
        if self._bar is not None:
            self._steps.detach()
            self._bar.stop()
            self._bar = None

