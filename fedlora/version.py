"""fedlora's version (the same as pyproject.toml's ``[project] version``; tests/test_cli_reading.py checks it)."""

__version__ = "0.1.0"
