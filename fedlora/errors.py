"""Errors a user can fix: the command line prints them as one line on stderr and exits 2."""

from __future__ import annotations

MAX_SHOWN = 80  # characters of a value an error line shows (the rest: its length instead)
MAX_ERROR_LENGTH = 1000  # characters of an error line (a longer one is cut, its length stated)


def shorten(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` for an error line: at most ``limit`` characters, then ``...`` and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value: object, limit: int = MAX_SHOWN) -> str:
    """``repr(value)`` for an error line: at most ``limit`` characters, then ``...`` and the
    length of the whole (a string's characters, else its repr's)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    length = len(value) if isinstance(value, str) else len(text)
    return f"{text[:limit]}... ({length} characters)"


def one_line(message: str, limit: int = MAX_ERROR_LENGTH) -> str:
    """``message`` as one line of at most ``limit`` characters (cut, with its length stated)."""
    return shorten(" ".join(message.split("\n")), limit)


class ConfigError(ValueError):
    """A configuration problem the user can fix (the message names the key, the value and the fix),
    in one line of at most :data:`MAX_ERROR_LENGTH` characters whatever value it quotes."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(str(message)), *args)


def did_you_mean(word: str, choices: list[str] | tuple[str, ...], prefix: str = "") -> str:
    """`` (did you mean 'PREFIXx'?)`` for the closest of ``choices`` to a mistyped ``word`` (difflib,
    case ignored, similarity >= 0.6), else ``''``."""
    import difflib

    lowered = {choice.lower(): choice for choice in choices}  # FedIT -> fedit
    close = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{lowered[close[0]]}'?)" if close else ""
