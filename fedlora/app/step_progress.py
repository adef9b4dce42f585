"""Local training steps under the live round bar (fedlora.app.progress.RoundProgress on a terminal).

While the round bar runs, a local training loop in this process (the in-process engine) shows its
steps as a second, transient bar under it: :class:`StepTasks` is ``fedlora.training.REPORTER``
meanwhile. Elsewhere the step loop decides for itself (fedlora.training.step_reporter).
"""

from __future__ import annotations

from typing import Any


class StepTasks:
    """Local training steps as transient tasks of a live rich ``Progress`` (the round bar): set as
    ``fedlora.training.REPORTER`` between :meth:`attach` and :meth:`detach`."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.previous: Any = None

    def attach(self) -> None:
        from fedlora import training

        self.previous, training.REPORTER = training.REPORTER, self.reporter

    def detach(self) -> None:
        from fedlora import training

        training.REPORTER = self.previous

    def reporter(self, label: str, total: int) -> StepTask:
        return StepTask(self.bar, label, total)


class StepTask:
    """One step loop's task in the live bar (removed when the loop ends)."""

    def __init__(self, bar: Any, label: str, total: int) -> None:
        self.bar, self.task = bar, bar.add_task(f"{label}  loss      -", total=total)
        self.label = label

    def update(self, steps: int, loss: float) -> None:
        self.bar.update(self.task, completed=steps, description=f"{self.label}  loss {loss:.4f}")

    def close(self) -> None:
        self.bar.remove_task(self.task)
