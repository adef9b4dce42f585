"""Output folders: nothing a command wrote before is ever lost.

Every command that writes an output folder (``fedlora run``, ``compare``, ``tune``, ``deploy
local``, and their Python functions) claims it with :func:`claim` before anything is created:

- a folder that does not exist, or is empty, is used;
- a folder that holds anything is refused in one line, unless the command is told to
  ``resume`` (continue what is there) or to ``overwrite``: the folder is then renamed to
  ``DIR.old-<YYYYMMDD-HHMMSS>`` beside it (never deleted; the new name is logged) and the
  command starts in a new, empty ``DIR``; ``overwrite`` only moves folders that hold fedlora's
  own output (:func:`looks_like_output`), never, say, a home directory given as ``--out``;
- ``resume`` and ``overwrite`` together are refused;
- the folder must be one the command can create and write: a path under a file, in a read-only
  folder, too long, ... is refused in one line. This is probed by creating and removing a
  temporary entry, so a refused command leaves nothing behind.

The rename itself happens in :meth:`Claim.take`, which a command calls after every other check
(config, model, data) has passed: a command that fails before training moves nothing.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fedlora.errors import ConfigError

PROBE_ATTEMPTS = 5  # writability probes of one folder when parallel runs' probes remove its parents meanwhile

logger = logging.getLogger("fedlora")

# Entries that only fedlora writes into an output folder (one of them marks a folder as its output).
OUTPUT_MARKERS = (
    "results.json", "checkpoint", "adapters", "accuracy_vs_round.png", "tensorboard", "summary.md",
    "summary.csv", "tuning.json", "deployment.json", "run_config.toml", "certs", "flwr", "logs", "run.log",
    ".ray", ".flwr", "generations.jsonl", "mlflow_run.json",
)  # fmt: skip
OLD_SUFFIX = ".old-"


def absolute(path: str | Path) -> Path:
    """``path`` made absolute and normalised (``.`` and ``..`` folded), symbolic links kept."""
    return Path(os.path.abspath(Path(path).expanduser()))


def same_folder(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name the same folder (after resolving links)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def looks_like_output(folder: Path) -> bool:
    """Whether ``folder`` holds something fedlora wrote (a run, a comparison, a tuning, a deployment)."""
    return any((folder / name).exists() for name in OUTPUT_MARKERS) or any(folder.glob("*/seed*"))


def holds_something(folder: Path) -> bool:
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError as error:
        raise ConfigError(f"cannot read {folder}: {error.strerror or error}") from None


def check_writable(path: str | Path, flag: str) -> None:
    """ConfigError (one line) unless ``path`` is a folder, or can become one, that this process can
    write. Probed for real (a temporary file, or the missing folders created and removed again):
    permission bits do not tell, e.g. for root or on a read-only mount."""
    target = absolute(path)
    try:
        if target.exists() and not target.is_dir():
            raise ConfigError(f"{flag} {path} is a file; give a folder (new or empty) for the output")
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            try:
                _probe(target, path, flag)
                return
            except FileNotFoundError:  # a parallel run's probe removed a parent meanwhile: again
                if attempt == PROBE_ATTEMPTS:
                    raise
    except OSError as error:
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(target) else ""
        raise ConfigError(f"{flag} {path} cannot be written: {error.strerror or error}{where}") from None


def _probe(target: Path, path: str | Path, flag: str) -> None:
    """Create the missing folders down to ``target``, write a temporary file in it, and remove
    what was created. Parallel runs (the seeds of a comparison) probe beside each other under the
    same parents, so a folder made meanwhile by another is used and never removed."""
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} is under {existing}, which is a file; give a folder path")
    missing = []
    folder = target
    while folder != existing:
        missing.append(folder)
        folder = folder.parent
    created: list[Path] = []
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
                created.append(folder)
            except FileExistsError:
                if not folder.is_dir():
                    raise
        with tempfile.TemporaryFile(dir=target):
            pass
    finally:
        for folder in reversed(created):
            _remove_if_empty(folder)


def _remove_if_empty(folder: Path) -> None:
    """Remove a folder the probe created, unless a parallel run (say, another seed writing beside
    it under the same parent) has put something in it or removed it meanwhile."""
    try:
        folder.rmdir()
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise


@dataclass
class Claim:
    """An output folder checked by :func:`claim`; :meth:`take` moves earlier output aside."""

    path: Path
    what: str  # "run", "comparison", "tuning", "deployment"
    earlier: bool  # the folder held something when claimed
    overwrite: bool
    resume: bool
    moved_to: Path | None = None

    def take(self) -> Path | None:
        """With ``overwrite`` and earlier output: rename the folder aside (logged) and return its new
        path; otherwise nothing happens (None). Call it after every other check passed."""
        if not (self.overwrite and self.earlier) or self.moved_to is not None:
            return None
        self.moved_to = move_aside(self.path, self.what, "--overwrite")
        return self.moved_to


def move_aside(path: str | Path, what: str, why: str) -> Path:
    """Rename ``path`` to ``<path>.old-<YYYYMMDD-HHMMSS>`` beside it (a counter is appended if that
    exists), log it (``why``: what asked for it) and return the new path; ConfigError if it fails."""
    source = absolute(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = source.with_name(f"{source.name}{OLD_SUFFIX}{stamp}")
    count = 1
    while target.exists():
        count += 1
        target = source.with_name(f"{source.name}{OLD_SUFFIX}{stamp}-{count}")
    try:
        os.rename(source, target)
    except OSError as error:
        raise ConfigError(f"{why}: cannot move {path} aside to {target}: {error.strerror or error}") from None
    logger.warning("%s: the earlier %s in %s was moved aside to %s (nothing was deleted)", why, what, path, target)
    return target


def claim(path: str | Path, *, what: str, resume: bool = False, overwrite: bool = False, flag: str = "--out",
          resume_hint: str = "--resume") -> Claim:
    """Check the output folder ``path`` of a ``what`` (see the module docstring); ConfigError, one
    line, when it cannot be used as asked. ``resume_hint`` is how the command's resume is spelled
    (``--resume DIR`` for ``run``, ``--resume`` for ``compare``)."""
    if resume and overwrite:
        raise ConfigError(f"--resume and --overwrite contradict each other: --resume continues the {what} in "
                          f"{path}, --overwrite moves it aside and starts afresh; give one of them")
    check_writable(path, flag)
    folder = absolute(path)
    earlier = holds_something(folder)
    if earlier and not looks_like_output(folder):
        raise ConfigError(f"{flag} {path} is a folder with other files in it (not a fedlora output); fedlora "
                          f"never writes into or moves such a folder: choose a new or empty {flag} folder")
    if earlier and not (resume or overwrite):
        raise ConfigError(f"{flag} {path} holds an earlier {what}; continue it with {resume_hint}, move it aside "
                          f"with --overwrite (nothing is deleted), or choose another {flag} folder")
    if overwrite and folder.parent == folder:
        raise ConfigError(f"--overwrite cannot move {path} aside; choose another {flag} folder")
    return Claim(Path(path), what, earlier, overwrite, resume)
