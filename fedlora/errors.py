"""Errors a user can fix: the command line prints them as one line on stderr and exits 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem the user can fix (the message names the key, the value and the fix)."""


def did_you_mean(word: str, choices: list[str] | tuple[str, ...], prefix: str = "") -> str:
    """`` (did you mean 'PREFIXx'?)`` for the closest of ``choices`` to a mistyped ``word`` (difflib,
    case ignored, similarity >= 0.6), else ``''``."""
    import difflib

    lowered = {choice.lower(): choice for choice in choices}  # FedIT -> fedit
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{lowered[close[0]]}'?)" if close else ""
