"""Round progress a person can follow: a live bar with ETA on a terminal and in a notebook, plain
lines elsewhere.

On a terminal (stdout is a TTY) a rich progress bar shows the rounds done, the elapsed time and
the estimated time left, with the last round's line under it; in a Jupyter notebook (an IPython
kernel) every round still prints its line and one HTML bar (rounds done, elapsed, time left)
updates in place under the cell (:class:`NotebookBar`: IPython's display, no widget library
needed); in CI and logs (no TTY) every round prints one plain line, as ``fedlora run`` always did.
"""

from __future__ import annotations

import html
import logging
import sys
import time
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
        self._notebook = NotebookBar(total, first) if not live and LIVE is None and in_notebook() else None
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
        if self._notebook is not None:
            self._notebook.update(server_round, line)
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


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython with a kernel: a notebook, JupyterLab, VS
    Code); a plain IPython shell on a terminal is not one."""
    shell_module = sys.modules.get("IPython")
    if shell_module is None:
        return False
    shell = shell_module.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class NotebookBar:
    """Rounds ``first``..``total`` as an HTML progress bar in the notebook cell that runs them,
    updated in place (IPython's ``display(..., display_id=True)``): rounds done, elapsed time, the
    estimated time left from the rounds run so far, and the last round's line."""

    def __init__(self, total: int, first: int = 1) -> None:
        from IPython.display import HTML, display

        self.total, self.first, self.started = total, first, time.monotonic()
        self._html = HTML
        self._handle = display(HTML(self.html(first - 1, "")), display_id=True)

    def html(self, done: int, line: str) -> str:
        elapsed = time.monotonic() - self.started
        ran = done - (self.first - 1)
        left = f", about {elapsed / ran * (self.total - done):.0f} s left" if 0 < ran and done < self.total else ""
        return (f'<div><progress value="{done}" max="{self.total}" style="width: 30em"></progress> '
                f"rounds {done}/{self.total}, {elapsed:.0f} s{left}<br><code>{html.escape(line)}</code></div>")

    def update(self, done: int, line: str) -> None:
        if self._handle is not None:
            self._handle.update(self._html(self.html(done, line)))
