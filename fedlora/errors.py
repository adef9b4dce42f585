"""Errors a user can fix: the command line prints them as one line on stderr and exits 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem the user can fix (the message names the key, the value and the fix)."""
