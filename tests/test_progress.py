"""Round progress: a live bar on a terminal, one plain line per round elsewhere."""

from __future__ import annotations

import logging

import pytest

from fedlora.app.progress import RoundProgress


def test_live_progress_shows_the_bar_and_every_round_line(capsys: pytest.CaptureFixture[str]) -> None:
    # Execute: a resumed run (rounds 2 and 3 of 3) on a terminal
    progress = RoundProgress(3, first=2, live=True)
    progress.round_done(2, "round   2/3  global 0.500")
    progress.round_done(3, "round   3/3  global 0.600")
    progress.close()
    # Assert: the round lines and the finished bar (3 of 3) went to stdout
    err = capsys.readouterr().out
    assert "round   2/3  global 0.500" in err and "round   3/3  global 0.600" in err
    assert "3/3" in err and "eta" in err


def test_without_a_terminal_every_round_is_one_plain_log_line(caplog: pytest.LogCaptureFixture) -> None:
    # Execute
    with caplog.at_level(logging.INFO, logger="fedlora"):
        progress = RoundProgress(2, live=False)
        progress.round_done(1, "round   1/2")
        progress.round_done(2, "round   2/2")
        progress.close()
    # Assert
    assert [r.getMessage() for r in caplog.records] == ["round   1/2", "round   2/2"]
