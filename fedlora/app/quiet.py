"""What a person sees while fedlora runs: fedlora's own lines on stdout, the rest in the run's log.

Quiet (the default, in the CLI, ``fedlora.run`` / ``fedlora.compare`` and notebooks) the console
shows *fedlora lines* only:

- records of the ``fedlora`` logger (and its children) at INFO or above: the per-round progress
  line, the data summary, the final figures and where the results are, ``compare:`` steps;
- warnings and errors that fedlora's own code (``fedlora/``, ``strategies/``, ``clients/``,
  ``simulations/``) logs through Flower's logger, printed as ``warning: ...`` / ``error: ...``.

Everything else that libraries emit keeps going to the run's log file (``<run dir>/run.log``),
and the console drops it only when it is listed in :data:`NOISE`: one logger, or one message of one
logger, at a time, each with the reason. A warning that is not listed still shows, so a new one is
seen (tests/test_quiet.py fails on it). ``verbose=True`` / ``--verbose`` shows every record on the
console (libraries' INFO included, Flower at DEBUG).

Ray actors are separate processes: :func:`ray_runtime_env` gives Flower's Ray backend a worker
setup hook (:func:`setup_ray_worker`) that installs the same console filter and log file in every
worker before it runs a ClientApp.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOG_FILE = "run.log"
ENV_VERBOSE = "FEDLORA_VERBOSE"  # Ray workers: "1" shows every record (set by ray_runtime_env)
ENV_LOG_FILE = "FEDLORA_RUN_LOG"  # Ray workers: the run's log file, appended to ("" for none)
WORKER_HOOK = "fedlora.app.quiet.setup_ray_worker"
# Loggers that come with their own console handler: theirs is replaced by ours while a run lasts.
TAKEN_OVER = ("flwr", "transformers")


def _our_roots() -> tuple[str, ...]:
    """fedlora's source folders: the package, and the layers pyproject maps into it (in a source
    checkout strategies/, clients/ and simulations/ sit beside fedlora/; installed, inside it)."""
    roots = {Path(__file__).resolve().parents[1]}
    for layer in ("strategies", "clients", "simulations"):
        spec = importlib.util.find_spec(f"fedlora.{layer}")
        if spec is not None and spec.submodule_search_locations:
            roots.update(Path(folder).resolve() for folder in spec.submodule_search_locations)
    return tuple(sorted(str(root) + os.sep for root in roots))


OUR_ROOTS = _our_roots()


@dataclass(frozen=True)
class Noise:
    """Records the quiet console drops (the log file keeps them): those of ``logger`` (or a child
    of it) whose message matches ``pattern`` ("" = all), unless fedlora's own code emitted them."""

    logger: str
    pattern: str
    why: str

    def matches(self, record: logging.LogRecord) -> bool:
        if record.name != self.logger and not record.name.startswith(self.logger + "."):
            return False
        return not self.pattern or re.search(self.pattern, record.getMessage()) is not None


NOISE: tuple[Noise, ...] = (
    Noise("flwr", "", "Flower's runtime log (every message, its own API notices, a failed ServerApp's traceback): "
          "fedlora prints one line per round itself, and a failed run's cause as one error line"),
    Noise("py.warnings", r"`is_gradient_checkpointing` is deprecated",
          "peft 0.21 reads this transformers 5 attribute each time it wraps a model (every client, every round); "
          "not fedlora's call, and nothing to act on"),
    Noise("py.warnings", r"Ray will no longer override accelerator visible devices",
          "Ray's tip at every ray.init about a future default; fedlora sets each client's num_gpus itself"),
    Noise("transformers", r"LOAD REPORT",
          "a pretrained encoder loaded into a classifier reports its new head as MISSING: expected, the head is "
          "trained (fedlora.backbones says so itself when a checkpoint's head is replaced)"),
)


def is_ours(record: logging.LogRecord) -> bool:
    """True when fedlora's own code emitted ``record`` (whichever logger it used)."""
    return record.name == "fedlora" or record.name.startswith("fedlora.") or record.pathname.startswith(OUR_ROOTS)


def is_noise(record: logging.LogRecord) -> bool:
    """True for a record the quiet console drops (see :data:`NOISE`)."""
    return not is_ours(record) and any(noise.matches(record) for noise in NOISE)


class QuietFilter(logging.Filter):
    """The quiet console: fedlora's INFO lines, everyone's warnings, minus :data:`NOISE`.

    fedlora's code that logs through Flower's logger (strategies, clients) shows from WARNING up:
    its INFO lines (per-message details) stay in the log file. ``worker``: a Ray worker, where
    fedlora's INFO lines (a client loading its data) repeat the driver's: warnings only, and the
    lines of a long local training loop (logger ``fedlora.steps``, when the driver asks for them)."""

    def __init__(self, worker: bool = False) -> None:
        super().__init__()
        self.worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        if is_ours(record):
            shown = record.name.startswith("fedlora") and (not self.worker or record.name == "fedlora.steps")
            return shown or record.levelno >= logging.WARNING
        return record.levelno >= logging.WARNING and not is_noise(record)


class ConsoleFormatter(logging.Formatter):
    """fedlora's INFO lines as they are; warnings as ``warning: ...``; other libraries' records
    with their logger's name (a Python warning is already one formatted text)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        if record.name == "py.warnings":
            return message.rstrip()
        if is_ours(record):
            return message if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {message}"
        return f"{record.levelname.lower()} [{record.name}] {message}"


class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on whatever ``sys.stdout`` is when a record arrives (notebooks and tests swap it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def console_handler(verbose: bool, worker: bool = False) -> logging.Handler:
    """fedlora's console on stdout: quiet (:class:`QuietFilter`) unless ``verbose``."""
    handler = StdoutHandler()
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    handler.setFormatter(ConsoleFormatter())
    if not verbose:
        handler.addFilter(QuietFilter(worker))
    return handler


def file_handler(path: Path, prefix: str = "") -> logging.FileHandler | None:
    """Append to ``path`` (None when it cannot be opened: a Ray worker on another machine)."""
    try:
        handler = logging.FileHandler(path, mode="a", encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"))
    return handler


# --------------------------------------------------------------------------- sessions
@dataclass
class _Session:
    verbose: bool
    console: logging.Handler | None
    saved: dict[str, Any]


_SESSIONS: list[_Session] = []


def _targets() -> list[logging.Logger]:
    """Where our handlers go: the root logger, and each taken-over logger that does not pass its
    records on to the root (so that no record is handled twice)."""
    taken = [logging.getLogger(name) for name in TAKEN_OVER]
    return [logging.getLogger(), *(logger for logger in taken if not logger.propagate)]


def _install(verbose: bool, console: bool, own_console: bool = False) -> _Session:
    """Take over the console: our handler on the root logger and on the loggers that print by
    themselves (their handlers set aside), warnings captured, download bars off. Returns what to
    restore. The user's own root handlers (``logging.basicConfig`` in a script, pytest's capture)
    keep getting every record instead, and ours is not added (nothing prints twice), unless
    ``own_console`` (a Ray worker, whose root handlers are Ray's)."""
    # Both libraries attach their console handler when first imported: import them now, so that
    # we can set it aside (Flower's package import attaches its handler to the logger "flwr").
    import flwr  # noqa: F401
    import transformers.utils.logging as hf_logging

    root = logging.getLogger()
    saved: dict[str, Any] = {
        "root_level": root.level,
        "fedlora_level": logging.getLogger("fedlora").level,
        "flwr_level": logging.getLogger("flwr").level,
        "loggers": {name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
                    for name in TAKEN_OVER},
        "capture": getattr(logging, "_warnings_showwarning", None) is not None,
        "hf_bars": hf_logging.is_progress_bar_enabled(),
    }
    user_handlers = bool(root.handlers) and not own_console
    handler = None
    if console and not user_handlers:
        handler = console_handler(verbose, worker=own_console)
    elif not user_handlers:
        # no console, yet a record outside the run's log (a worker loading its model before the run
        # starts) must not fall to Python's last-resort handler, which prints every warning
        # unfiltered: the quiet console's warnings only
        handler = console_handler(False, worker=True)
        handler.setLevel(logging.WARNING)
    for name in TAKEN_OVER:
        taken = logging.getLogger(name)
        for old in list(taken.handlers):
            taken.removeHandler(old)
        # to the user's root handlers, or to ours attached to it directly (Flower turns its
        # logger's propagation off by itself in notebooks)
        taken.propagate = user_handlers
    if handler is not None:
        for target in _targets():
            target.addHandler(handler)
    logging.getLogger("fedlora").setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("flwr").setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose and root.level > logging.INFO:
        root.setLevel(logging.INFO)  # libraries' INFO lines too
    logging.captureWarnings(True)
    if not verbose:
        hf_logging.disable_progress_bar()  # "Loading weights" bars of every model load
    return _Session(verbose, handler, saved)


def _restore(session: _Session) -> None:
    import transformers.utils.logging as hf_logging

    saved = session.saved
    root = logging.getLogger()
    if session.console is not None:
        for target in [root, *(logging.getLogger(name) for name in TAKEN_OVER)]:
            target.removeHandler(session.console)
    for name, (handlers, propagate) in saved["loggers"].items():
        taken = logging.getLogger(name)
        for handler in handlers:
            taken.addHandler(handler)
        taken.propagate = propagate
    root.setLevel(saved["root_level"])
    logging.getLogger("fedlora").setLevel(saved["fedlora_level"])
    logging.getLogger("flwr").setLevel(saved["flwr_level"])
    logging.captureWarnings(saved["capture"])
    if saved["hf_bars"]:
        hf_logging.enable_progress_bar()


@contextlib.contextmanager
def output(verbose: bool = False, console: bool = True) -> Iterator[None]:
    """fedlora's console for the duration of a run or comparison (nested calls reuse the outer
    one; everything is restored afterwards). ``console=False``: no fedlora lines on the console,
    only the quiet console's warnings (the worker processes of ``fedlora compare --workers``, which
    log to their run.log)."""
    if _SESSIONS:
        yield
        return
    session = _install(verbose, console)
    _SESSIONS.append(session)
    try:
        yield
    finally:
        _SESSIONS.pop()
        _restore(session)


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[None]:
    """Every record (fedlora's, Flower's, the libraries', Python warnings) appended to ``path``
    while the block runs. A block refused as a user error (ConfigError: a tampered checkpoint, a
    bad value found late) leaves ``path`` as it was: a refusal changes nothing in the folder."""
    from fedlora.errors import ConfigError

    size = path.stat().st_size if path.is_file() else None
    handler = file_handler(path)
    if handler is None:
        yield
        return
    handler.handle(logging.makeLogRecord({"name": "fedlora", "levelno": logging.INFO, "levelname": "INFO",
                                          "msg": f"---- fedlora run log: {path.parent} ----"}))
    targets = _targets()
    for target in targets:
        target.addHandler(handler)
    refused = False
    try:
        yield
    except ConfigError:
        refused = True
        raise
    finally:
        for target in targets:
            target.removeHandler(handler)
        handler.close()
        if refused and size is None:
            path.unlink(missing_ok=True)
        elif refused and size is not None:
            os.truncate(path, size)


# --------------------------------------------------------------------------- Ray workers
def ray_runtime_env(log_path: Path | None, verbose: bool, env_vars: dict[str, str]) -> dict[str, Any]:
    """The ``runtime_env`` of the Ray job: ``env_vars`` plus this module's settings, and
    :func:`setup_ray_worker` run in every worker process before its first task."""
    return {
        "env_vars": {**env_vars, ENV_VERBOSE: "1" if verbose else "0",
                     ENV_LOG_FILE: str(log_path.resolve()) if log_path is not None else "",
                     **worker_step_progress()},
        "worker_process_setup_hook": WORKER_HOOK,
    }


def worker_step_progress() -> dict[str, str]:
    """How a Ray worker's local training shows its steps (fedlora.training.step_reporter): a plain
    line now and then ('lines', which Ray forwards to this console) when a person watches this
    driver (a terminal or a notebook), nothing otherwise; ``FEDLORA_STEP_PROGRESS`` set here wins."""
    from fedlora.training import STEP_PROGRESS_ENV, interactive

    chosen = os.environ.get(STEP_PROGRESS_ENV)
    if chosen:
        return {STEP_PROGRESS_ENV: "off" if chosen == "off" else "lines"}  # a worker draws no bar
    watched = interactive() or bool(getattr(sys.stdout, "isatty", lambda: False)())
    return {STEP_PROGRESS_ENV: "lines" if watched else "off"}


def setup_ray_worker() -> None:
    """Ray's worker setup hook: the quiet console (its output reaches the driver through Ray's log
    forwarding) and the run's log file, for the life of the worker process."""
    verbose = os.environ.get(ENV_VERBOSE) == "1"
    _SESSIONS.append(_install(verbose, console=True, own_console=True))
    if os.environ.get(ENV_LOG_FILE):
        handler = file_handler(Path(os.environ[ENV_LOG_FILE]), prefix=f"(ray worker pid={os.getpid()}) ")
        if handler is not None:
            for target in _targets():
                target.addHandler(handler)
