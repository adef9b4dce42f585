"""Content-keyed on-disk caches of derived files (a dequantised model, a tokenizer folder).

An entry is the folder ``ROOT/<name>-<key[:16]>/``: its files plus ``manifest.json``
(``{"name", "key", "files": {relative path: size}}``). The key is the sha256 of everything the
content derives from (the source file's bytes, the versions of the code that derives it, the
settings), so a changed source or setting finds another folder: a stale entry is never read.

- **Atomic:** an entry is built in a temporary sibling folder (named after the process) and
  renamed into place; a reader sees a complete entry or none; of two processes building the
  same entry at once (silos on one machine) the first rename wins and the other drops its copy.
- **Checked on every use** (cheaply, without reading the data): the manifest names this key and
  every listed file exists at its recorded size; a safetensors file's JSON header parses and its
  tensors end exactly at the end of the file. A damaged entry (truncated, overwritten, a file
  missing) is moved aside (``.<folder>.damaged-<pid>``, then deleted) and rebuilt once; if the
  rebuilt entry is damaged too, :class:`CacheError` says so in one line.
- **No pickle:** entries hold JSON and safetensors only; the file digest memo is JSON.

``file_digest`` hashes a source file once and remembers the digest in ``ROOT/digests.json`` under
the file's path, size, modification time and inode (a file changed in place gets a new digest).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

from fedlora.errors import ConfigError

MANIFEST = "manifest.json"
DIGESTS = "digests.json"
KEY_CHARS = 16  # of the key's hex digest, in the folder name


class CacheError(ConfigError):
    """A cache entry that cannot be built or stays damaged; the CLI prints it as one line."""


def content_key(*parts: str | bytes) -> str:
    """sha256 (hex) of ``parts``, each length-prefixed (``("ab", "c")`` and ``("a", "bc")`` differ)."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else part
        digest.update(struct.pack("<Q", len(data)))
        digest.update(data)
    return digest.hexdigest()


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomic(path: Path, value: object) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def file_digest(path: Path, root: Path) -> str:
    """sha256 (hex) of the file ``path``'s bytes, remembered in ``root/digests.json`` while the
    file keeps its size, modification time and inode."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    memo_path = root / DIGESTS
    memo: dict[str, dict[str, object]] = {}
    with contextlib.suppress(OSError, ValueError):
        loaded = json.loads(memo_path.read_text(encoding="utf-8"))
        memo = loaded if isinstance(loaded, dict) else {}
    known = memo.get(str(path))
    if isinstance(known, dict) and all(known.get(k) == v for k, v in stamp.items()) and isinstance(known.get("sha256"), str):
        return str(known["sha256"])
    digest = _sha256_of(path)
    memo[str(path)] = {**stamp, "sha256": digest}
    with contextlib.suppress(OSError):  # a read-only cache still works, it only hashes again
        root.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(memo_path, memo)
    return digest


def check_safetensors(path: Path) -> str:
    """Why the safetensors file ``path`` is damaged ('' when its header parses and its tensors end
    exactly at the end of the file); reads the header only."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{path.name}: shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            return f"{path.name}: header length {length} beyond the file's {size} bytes"
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return f"{path.name}: header is not JSON"
    if not isinstance(header, dict):
        return f"{path.name}: header is not a JSON object"
    ends = [int(entry["data_offsets"][1]) for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    if max(ends, default=0) != size - 8 - length:
        return f"{path.name}: tensors end at byte {max(ends, default=0)}, the data holds {size - 8 - length}"
    return ""


def check_entry(folder: Path, key: str) -> str:
    """Why the entry ``folder`` is not a complete, undamaged entry for ``key`` ('' when it is)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{MANIFEST} missing or not JSON"
    if not isinstance(manifest, dict) or manifest.get("key") != key or not isinstance(manifest.get("files"), dict):
        return f"{MANIFEST} is not this entry's"
    for name, size in manifest["files"].items():
        file = folder / name
        if not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != size:
            return f"{name}: {file.stat().st_size} bytes, the manifest says {size}"
        if name.endswith(".safetensors"):
            problem = check_safetensors(file)
            if problem:
                return problem
    return ""


@contextlib.contextmanager
def _building(folder: Path) -> Iterator[Path]:
    """A temporary sibling folder renamed to ``folder`` on success (another process that got
    there first wins; this copy is then dropped)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
        try:
            os.rename(tmp, folder)
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build(folder: Path, name: str, key: str, build: Callable[[Path], None]) -> None:
    with _building(folder) as tmp:
        tmp.mkdir(parents=True)
        build(tmp)
        files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"name": name, "key": key, "files": files}, indent=1), encoding="utf-8")


def cached_folder(root: Path, name: str, key: str, build: Callable[[Path], None]) -> Path:
    """The entry ``root/<name>-<key[:16]>``: built by ``build(folder)`` (which writes the files
    into the folder it is given) when missing, checked (:func:`check_entry`) when present, moved
    aside and rebuilt once when damaged."""
    folder = Path(root) / f"{name}-{key[:KEY_CHARS]}"
    if not folder.is_dir():
        _build(folder, name, key, build)
    problem = check_entry(folder, key)
    if problem:
        aside = folder.parent / f".{folder.name}.damaged-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(OSError):  # another process may have moved it already
            os.rename(folder, aside)
        if not folder.is_dir():
            _build(folder, name, key, build)
        shutil.rmtree(aside, ignore_errors=True)
        again = check_entry(folder, key)
        if again:
            raise CacheError(f"cache entry {folder} is damaged ({problem}) and stayed damaged after a rebuild "
                             f"({again}); delete it or set FEDLORA_CACHE to another folder")
    return folder
