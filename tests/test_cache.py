"""Content-keyed on-disk caches (fedlora/cache.py): hit, miss on a changed key, damaged entries
rebuilt (or one clear error), atomic under a concurrent builder, never unpickled."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fedlora import cache
from fedlora.cache import CacheError, cached_folder, check_entry, content_key, file_digest

WEIGHTS = "model.safetensors"


def writer(value: float, calls: list[str], label: str = "built") -> cache.Callable[[Path], None]:
    """A build function that writes a 2x3 safetensors file of ``value`` and a JSON config."""
    from safetensors.numpy import save_file

    def build(folder: Path) -> None:
        calls.append(label)
        save_file({"w": np.full((2, 3), value, dtype=np.float32)}, str(folder / WEIGHTS))
        (folder / "config.json").write_text(json.dumps({"value": value}), encoding="utf-8")

    return build


def weights(folder: Path) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(folder / WEIGHTS))["w"]


def test_content_key_is_the_sha256_of_length_prefixed_parts() -> None:
    by_hand = hashlib.sha256(struct.pack("<Q", 2) + b"ab" + struct.pack("<Q", 1) + b"c").hexdigest()
    assert content_key("ab", "c") == by_hand
    assert content_key("ab", "c") != content_key("a", "bc")  # the parts' boundaries count


def test_a_second_use_hits_the_entry_without_building(tmp_path: Path) -> None:
    calls: list[str] = []
    first = cached_folder(tmp_path, "float32", "k" * 64, writer(1.5, calls))
    again = cached_folder(tmp_path, "float32", "k" * 64, writer(9.0, calls, "rebuilt"))
    assert first == again == tmp_path / f"float32-{'k' * 16}"
    assert calls == ["built"]  # the second call read the entry
    assert weights(again).tolist() == [[1.5] * 3] * 2
    manifest = json.loads((again / cache.MANIFEST).read_text())
    assert manifest["key"] == "k" * 64 and manifest["files"][WEIGHTS] == (again / WEIGHTS).stat().st_size


def test_a_changed_key_misses_and_never_reads_the_stale_entry(tmp_path: Path) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"quantised weights v1")
    calls: list[str] = []
    old = cached_folder(tmp_path / "cache", "float32", content_key(file_digest(source, tmp_path)), writer(1.0, calls, "v1"))
    source.write_bytes(b"quantised weights v2")  # the source changes in place
    new_digest = file_digest(source, tmp_path)
    assert new_digest == hashlib.sha256(b"quantised weights v2").hexdigest()
    new = cached_folder(tmp_path / "cache", "float32", content_key(new_digest), writer(2.0, calls, "v2"))
    assert new != old and calls == ["v1", "v2"]
    assert weights(new).tolist() == [[2.0] * 3] * 2 and weights(old).tolist() == [[1.0] * 3] * 2


def test_file_digest_is_remembered_while_the_file_is_unchanged(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"abc")
    hashed: list[Path] = []
    real = cache._sha256_of
    monkeypatch.setattr(cache, "_sha256_of", lambda path: hashed.append(path) or real(path))
    assert file_digest(source, tmp_path) == file_digest(source, tmp_path) == hashlib.sha256(b"abc").hexdigest()
    assert len(hashed) == 1  # the second digest came from digests.json
    assert json.loads((tmp_path / cache.DIGESTS).read_text())[str(source.resolve())]["size"] == 3


@pytest.mark.parametrize("damage", ["truncate", "header", "missing", "manifest"])
def test_a_damaged_entry_is_rebuilt(tmp_path: Path, damage: str) -> None:
    calls: list[str] = []
    folder = cached_folder(tmp_path, "float32", "d" * 64, writer(3.0, calls))
    target = folder / WEIGHTS
    if damage == "truncate":  # an interrupted copy: tensors end beyond the file
        target.write_bytes(target.read_bytes()[:-4])
        (folder / cache.MANIFEST).write_text(json.dumps({"key": "d" * 64, "files": {WEIGHTS: target.stat().st_size}}))
    elif damage == "header":  # same size, garbage header
        data = bytearray(target.read_bytes())
        data[8:16] = b"\x00garbage"
        target.write_bytes(bytes(data))
    elif damage == "missing":
        target.unlink()
    else:
        (folder / cache.MANIFEST).write_text("{not json")
    assert check_entry(folder, "d" * 64)  # the check sees it
    again = cached_folder(tmp_path, "float32", "d" * 64, writer(3.0, calls, "rebuilt"))
    assert calls == ["built", "rebuilt"] and again == folder
    assert check_entry(again, "d" * 64) == "" and weights(again).tolist() == [[3.0] * 3] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no damaged copy or temporary left


def test_an_entry_that_stays_damaged_is_one_clear_error(tmp_path: Path) -> None:
    def broken(folder: Path) -> None:
        (folder / WEIGHTS).write_bytes(struct.pack("<Q", 10**9) + b"{}")  # header length beyond the file

    with pytest.raises(CacheError) as error:
        cached_folder(tmp_path, "float32", "e" * 64, broken)
    message = str(error.value)
    assert "\n" not in message and "stayed damaged after a rebuild" in message and "header length" in message


def test_a_concurrent_builder_that_renames_first_wins(tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []
    other = writer(7.0, calls, "other process")

    def slow(folder: Path) -> None:  # another process finishes the same entry while this one builds
        writer(5.0, calls, "this process")(folder)
        pid = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda: pid + 1)
        cached_folder(tmp_path, "float32", "c" * 64, other)
        monkeypatch.setattr(os, "getpid", lambda: pid)

    folder = cached_folder(tmp_path, "float32", "c" * 64, slow)
    assert calls == ["this process", "other process"]
    assert weights(folder).tolist() == [[7.0] * 3] * 2 and check_entry(folder, "c" * 64) == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # this process's copy dropped


def test_entries_are_json_and_safetensors_and_read_without_unpickling(tmp_path: Path, monkeypatch) -> None:
    calls: list[str] = []
    cached_folder(tmp_path, "float32", "p" * 64, writer(4.0, calls))

    def refuse(*_args, **_kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    folder = cached_folder(tmp_path, "float32", "p" * 64, writer(4.0, calls))
    assert weights(folder).tolist() == [[4.0] * 3] * 2
    assert {p.suffix for p in folder.iterdir()} == {".json", ".safetensors"}
    source = Path(cache.__file__).read_text()
    assert "import pickle" not in source and "torch.load" not in source
