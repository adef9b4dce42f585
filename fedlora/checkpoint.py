"""Checkpoint / resume: the server's state after every round, the clients' kept state.

Server side, at the end of every round: ``DIR/checkpoint/server-<round>.safetensors`` (every array
of the state) and ``DIR/checkpoint/server.json`` (the round number, the comparable config, the
partitions that took part, and the structure of the strategy's state, the results so far and the
privacy ledger; :mod:`fedlora.state`), each written atomically (write, then rename), the JSON
last: it is the commit point. The JSON carries a manifest (the sha256 of the arrays file and of
every client state file a resume restores) and its own digest (the sha256 of the rest of it, as
canonical JSON).

On resume (:func:`load_server`) everything is verified before anything runs or changes: every
file of the manifest against its sha256 (flipped bits, a replaced file), the JSON against its
digest (an edit), the structure against what fedlora writes (entries, types, ranges, nesting
depth, round records 1..k, partitions that exist in the config), every array finite (no NaN /
inf), and, once the strategy is built, its state's attributes and their kinds
(:func:`check_strategy_state`). The manifest detects corruption and edits; it is not a signature
(whoever can write the folder can write a consistent checkpoint), which is why the structure is
validated as well. Nothing is pickled: the JSON names only allow-listed types (fedlora.state),
arrays are safetensors, client states Flower's protobuf (numpy's ``allow_pickle=False``). A
refusal is one CheckpointError line, and leaves the folder as it was.

Client side, a client's ``context.state`` (its kept adapter and whatever its trainer stores
there) is written after every training round to ``<checkpoint-dir>/<partition id>/round_<r>.bin``
(Flower's RecordDict protobuf). In simulation ``<checkpoint-dir>`` is ``DIR/checkpoint/clients``,
told by the server; in a deployment a silo sets its own folder with the node config
``checkpoint-dir``. On resume from round ``k`` a client with an empty ``context.state`` restores
the newest file of a round <= ``k``: a file from the interrupted round ``k + 1`` is ignored (in
simulation the server also deletes such files, :func:`drop_client_states_after`). In simulation
the file is the only copy between messages: the client restores it before every message and
empties ``context.state`` after (the engine would otherwise hold every idle client's state).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedlora.errors import ConfigError
from fedlora.schema import ExperimentConfig, comparable_config
from fedlora.state import StateError, decode, encode

if TYPE_CHECKING:
    from flwr.app import RecordDict

SERVER_FILE = "server.json"  # the structure; its arrays are in the safetensors file it names
CLIENTS_DIR = "clients"
FORMAT = 3  # 1 was a pickle (never read: a checkpoint must never run code); 2 had no manifest (cannot be verified)
_ARRAYS_FILE = re.compile(r"server-\d+\.safetensors")
_CLIENT_FILE = re.compile(rf"{CLIENTS_DIR}/(\d+)/round_(\d+)\.bin")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed: missing, corrupt, changed after it was written, or not
    one fedlora wrote (one line; the folder is left as it was)."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoint"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(2**20):
            digest.update(chunk)
    return digest.hexdigest()


def blob_digest(blob: dict[str, Any]) -> str:
    """The sha256 of ``blob`` without its own ``digest`` entry, as canonical JSON."""
    body = {key: value for key, value in blob.items() if key != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _comparable(config: ExperimentConfig) -> dict[str, Any]:
    """The config without what may change on resume (:func:`fedlora.schema.comparable_config`: the output
    folder, a disabled secure aggregation's inert options), and the number of rounds
    unless a DP target epsilon was planned for it."""
    data = comparable_config(config.model_dump(mode="json"))
    if not (config.privacy.dp and config.privacy.target_epsilon is not None):
        data["train"].pop("rounds", None)
    return data


def _as_run_until(config: dict[str, Any], round_done: int) -> dict[str, Any]:
    """A comparable config as the rounds 1..``round_done`` ran it: a learning-rate decay from a
    later round (``train.lr_decay_rounds``) had not acted yet, so a resume may add or move one
    there (a finished run lengthened with a decay after its last round continues exactly); the
    decay factor counts only when a listed round was reached."""
    train = dict(config.get("train") or {})
    reached = [r for r in train.get("lr_decay_rounds") or [] if isinstance(r, int) and r <= round_done]
    train["lr_decay_rounds"] = reached
    if not reached:
        train.pop("lr_decay_factor", None)
    return {**config, "train": train}


def client_manifest(folder: Path, upto_round: int) -> dict[str, str]:
    """``clients/<partition>/round_<r>.bin`` -> sha256 of the state file each client would restore
    on a resume after ``upto_round`` (its newest of a round <= ``upto_round``)."""
    return {name: sha256_file(folder / name) for name in client_manifest_names(folder, upto_round)}


def save_server(out_dir: str | Path, server_round: int, config: ExperimentConfig, state: dict[str, Any],
                rounds: list[Any], privacy: dict[str, Any] | None = None, partitions: list[int] | None = None) -> Path:
    """Write the server checkpoint of the completed round ``server_round``: the arrays first (a new
    file per round), then the JSON that names them with the manifest (the sha256 of the arrays and
    of every client state a resume restores) and its own digest, atomically, then the older
    arrays go. The JSON is the commit point: a crash before it leaves the previous checkpoint whole."""
    from safetensors.numpy import save_file

    folder = checkpoint_dir(out_dir)
    structure, arrays = encode({"strategy": state, "rounds": rounds, "privacy": privacy})
    arrays_name = f"server-{server_round}.safetensors"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(folder / (arrays_name + ".tmp")))
    os.replace(folder / (arrays_name + ".tmp"), folder / arrays_name)
    manifest = {arrays_name: sha256_file(folder / arrays_name), **client_manifest(folder, server_round)}
    blob: dict[str, Any] = {"format": FORMAT, "round": server_round, "config": _comparable(config),
                            "arrays": arrays_name, "partitions": list(partitions or []), "state": structure,
                            "manifest": manifest}
    blob["digest"] = blob_digest(json.loads(json.dumps(blob)))  # of the JSON as it will be read back
    path = folder / SERVER_FILE
    _atomic_write(path, json.dumps(blob).encode())
    for old in folder.glob("server-*.safetensors"):
        if old.name != arrays_name:
            old.unlink(missing_ok=True)
    return path


def load_server(out_dir: str | Path, config: ExperimentConfig | None = None) -> dict[str, Any]:
    """The last server checkpoint in ``out_dir``, verified: ``round``, ``partitions``, ``strategy``
    (state), ``rounds``, ``privacy``. CheckpointError (one line; nothing is changed) if there is none,
    if a file does not match its sha256 in the manifest, if the structure is not one fedlora wrote
    (:func:`check_blob`), if an array holds NaN or inf, or if ``config`` differs from the
    checkpointed run's (or has fewer ``train.rounds`` than it completed)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = checkpoint_dir(out_dir)
    path = folder / SERVER_FILE
    where = f"--resume {out_dir}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no checkpoint {path}; resume needs the output folder of a "
                              f"run that completed at least one round")
    try:
        blob = json.loads(path.read_bytes())
        check_blob(blob, folder)
        arrays = load_file(str(folder / blob["arrays"]))
        check_arrays(arrays)
        saved = decode(blob["state"], arrays)
        check_saved(saved, blob["round"])
    except CheckpointError:
        raise
    except RecursionError:
        raise CheckpointError(f"{where}: the checkpoint is corrupt or not a fedlora checkpoint (its JSON nests too "
                              f"deeply)") from None
    except (OSError, ValueError, KeyError, TypeError, StateError, SafetensorError) as error:
        raise CheckpointError(f"{where}: the checkpoint is corrupt or not a fedlora checkpoint "
                              f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    round_done, partitions = blob["round"], list(blob["partitions"])
    if config is not None:
        stored = _as_run_until(comparable_config(blob["config"]), round_done)
        now = _as_run_until(_comparable(config), round_done)
        if stored != now:
            keys = sorted(f"{s}.{k}" for s in now for k in (now[s] if isinstance(now[s], dict) else {})
                          if not isinstance(stored.get(s), dict) or stored[s].get(k) != now[s].get(k))
            raise CheckpointError(f"{where}: the config differs from the checkpointed run in "
                                  f"{', '.join(keys[:8]) or 'its sections'}; resume with the same config (train.rounds "
                                  f"may grow, except under a DP target_epsilon planned for it, and "
                                  f"train.lr_decay_rounds may add rounds after {round_done})")
        if round_done > config.train.rounds:
            raise CheckpointError(f"{where}: the checkpoint completed round {round_done} but train.rounds is "
                                  f"{config.train.rounds}; resume with train.rounds >= {round_done}")
        outside = [p for p in partitions if p >= config.data.num_clients]
        if outside:
            raise CheckpointError(f"{where}: the checkpoint names partitions {outside[:5]} but data.num_clients is "
                                  f"{config.data.num_clients}")
    return {"round": round_done, "partitions": partitions, **saved}


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"the checkpoint is corrupt or not a fedlora checkpoint: {message}")


def check_blob(blob: Any, folder: Path) -> None:
    """``server.json`` as fedlora writes it: the format, its own digest, the types and ranges of
    its entries, and every file of its manifest present with its sha256 (StateError / CheckpointError)."""
    if not isinstance(blob, dict):
        raise _fail(f"server.json holds a {type(blob).__name__}, not an object")
    if blob.get("format") != FORMAT:
        found = blob.get("format")
        raise _fail(f"format {found!r}, expected {FORMAT}" + (
            " (written by an older fedlora without a manifest, so it cannot be verified; start the run afresh)"
            if found == 2 else ""))
    if not isinstance(blob.get("digest"), str) or blob["digest"] != blob_digest(blob):
        raise CheckpointError(f"{folder / SERVER_FILE} was changed after it was written (its digest does not "
                              f"match); refusing to resume from it")
    expected = {"format": int, "round": int, "config": dict, "arrays": str, "partitions": list, "state": dict,
                "manifest": dict, "digest": str}
    if set(blob) != set(expected):
        raise _fail(f"server.json has entries {sorted(set(blob) ^ set(expected))} it should not have or lacks")
    for key, kind in expected.items():
        if not isinstance(blob[key], kind) or isinstance(blob[key], bool):
            raise _fail(f"'{key}' is a {type(blob[key]).__name__}, not a {kind.__name__}")
    if blob["round"] < 1:
        raise _fail(f"round {blob['round']}; a checkpoint is written after round 1 at the earliest")
    partitions = blob["partitions"]
    if not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in partitions) \
            or len(set(partitions)) != len(partitions):
        raise _fail("'partitions' must be distinct partition ids >= 0")
    if not _ARRAYS_FILE.fullmatch(blob["arrays"]) or blob["arrays"] != f"server-{blob['round']}.safetensors":
        raise _fail(f"the arrays file {blob['arrays'][:80]!r} is not server-{blob['round']}.safetensors")
    manifest: dict[str, Any] = blob["manifest"]
    if blob["arrays"] not in manifest:
        raise _fail("the manifest does not list the arrays file")
    for name, digest in manifest.items():
        client = _CLIENT_FILE.fullmatch(name)
        if name != blob["arrays"] and not (client and int(client.group(2)) <= blob["round"]):
            raise _fail(f"the manifest names {name[:80]!r}, which is not a file of this checkpoint")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise _fail(f"the manifest's sha256 of {name} is not a sha256")
        file = folder / name
        late = (f"; if a client whose reply timed out wrote it late, move {file.parent} out of the folder to "
                f"resume that client without its state") if client else ""
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing (the manifest lists it); refusing to resume")
        if sha256_file(file) != digest:
            raise CheckpointError(f"checkpoint file {file} does not match its sha256 in the manifest (changed or "
                                  f"corrupt); refusing to resume{late}")
    unlisted = sorted(set(client_manifest_names(folder, blob["round"])) - set(manifest))
    if unlisted:
        raise CheckpointError(f"checkpoint file {folder / unlisted[0]} is not in the checkpoint's manifest (added by hand, "
                              f"or written late by a client whose reply timed out); a resume would restore it "
                              f"unverified: move {(folder / unlisted[0]).parent} out of the folder to resume that client "
                              f"without its state")
    for name in manifest:
        if name != blob["arrays"]:
            check_client_state(folder / name)


def client_manifest_names(folder: Path, upto_round: int) -> list[str]:
    """The client state files a resume after ``upto_round`` would restore (without hashing them)."""
    root = folder / CLIENTS_DIR
    names = []
    for client in sorted(root.iterdir()) if root.is_dir() else []:
        files = {r: path for r, path in _client_files(client).items() if r <= upto_round}
        if client.name.isdigit() and files:
            names.append(f"{CLIENTS_DIR}/{client.name}/{files[max(files)].name}")
    return names


def check_arrays(arrays: dict[str, np.ndarray]) -> None:
    """CheckpointError when an array of the checkpoint holds NaN or inf (a model never does: such
    an update is rejected before aggregation, so a checkpoint with one was tampered with)."""
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise CheckpointError(f"the checkpoint's array {name} holds NaN or inf values; refusing to resume")


def check_client_state(path: Path) -> None:
    """A client state file parses as Flower's RecordDict and its arrays are numeric and finite."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
    from google.protobuf.message import DecodeError

    try:
        proto = ProtoRecordDict()
        proto.ParseFromString(path.read_bytes())
        records = recorddict_from_proto(proto)
        arrays = [(key, name, array.numpy()) for key, record in records.array_records.items()
                  for name, array in record.items()]
    except (DecodeError, ValueError, TypeError, KeyError, OSError) as error:
        raise CheckpointError(f"client state {path} is corrupt ({type(error).__name__}); refusing to resume") from None
    for key, name, array in arrays:
        if array.dtype.kind not in "fiub" or (array.dtype.kind == "f" and not np.isfinite(array).all()):
            raise CheckpointError(f"client state {path}: array {key}/{name} is not finite numbers; refusing to resume")


def check_saved(saved: Any, server_round: int) -> None:
    """The decoded state: ``strategy`` a dict of attributes, ``privacy`` a dict or None, ``rounds``
    the round records 1..``server_round`` (a causal LM's zero-shot round 0 first), each field of its
    declared type and in range."""
    from fedlora.results import RoundRecord

    if not isinstance(saved, dict) or set(saved) != {"strategy", "rounds", "privacy"}:
        raise _fail("the state is not {strategy, rounds, privacy}")
    if not isinstance(saved["strategy"], dict) or not all(isinstance(k, str) for k in saved["strategy"]):
        raise _fail("the strategy's state is not a dict of attributes")
    if saved["privacy"] is not None and not isinstance(saved["privacy"], dict):
        raise _fail("the privacy ledger is not a dict")
    rounds = saved["rounds"]
    if not isinstance(rounds, list) or not all(isinstance(r, RoundRecord) for r in rounds):
        raise _fail("the round records are not a list of round records")
    numbers = [r.round for r in rounds]
    first = 0 if numbers[:1] == [0] else 1
    if numbers != list(range(first, server_round + 1)):
        raise _fail(f"the round records are rounds {numbers[:3]}...{numbers[-2:]}, not {first}..{server_round}")
    for record in rounds:
        check_record(record)


def check_record(record: Any) -> None:
    """Every field of a round record of its declared type: counts are ints >= 0, measures finite
    floats (NaN: not measured), accuracies and ROUGE-L in [0, 1]."""
    for field in dataclasses.fields(record):
        value, kind, where = getattr(record, field.name), str(field.type), f"round {record.round}: {field.name}"
        if kind == "int":
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _fail(f"{where} is {value!r}, not a count >= 0")
        elif kind == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isinf(value):
                raise _fail(f"{where} is {value!r}, not a finite number")
            if ("accuracy" in field.name or "rouge_l" in field.name) and not (math.isnan(value) or 0 <= value <= 1):
                raise _fail(f"{where} is {value!r}, outside [0, 1]")
        elif kind.startswith("list") and not isinstance(value, list):
            raise _fail(f"{where} is a {type(value).__name__}, not a list")
        elif kind.startswith("dict") and not isinstance(value, dict):
            raise _fail(f"{where} is a {type(value).__name__}, not a dict")


def check_strategy_state(saved: Mapping[str, Any], fresh: Mapping[str, Any], where: str,
                         retired: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``saved`` (a checkpointed strategy state) without the ``retired`` attributes (ones an older
    fedlora checkpointed and this one no longer keeps, dropped); CheckpointError unless the rest
    holds only attributes the strategy has (``fresh``: its state before any round) and each of
    the same kind: None stands for any kind; numbers, strings, containers, arrays (dtype kind and
    dimensions) and registered objects must match. A hand-edited state can then never replace a
    method or change a type."""
    saved = {key: value for key, value in saved.items() if key not in retired}
    unknown = sorted(set(saved) - set(fresh))
    if unknown:
        raise CheckpointError(f"{where}: the checkpointed strategy state has attributes {unknown[:5]} this strategy "
                              f"does not have; refusing to resume")
    for key, value in saved.items():
        problem = _kind_mismatch(value, fresh[key])
        if problem:
            raise CheckpointError(f"{where}: the checkpointed strategy state's '{key}' is {problem}; refusing to resume")
    return saved


def _kind_mismatch(value: Any, reference: Any) -> str:
    if value is None or reference is None:
        return ""
    if isinstance(reference, np.ndarray):
        if not isinstance(value, np.ndarray):
            return f"a {type(value).__name__}, not an array"
        if value.dtype.kind != reference.dtype.kind or value.ndim != reference.ndim:
            return f"a {value.dtype} array of {value.ndim} dimensions, not {reference.dtype} of {reference.ndim}"
        return ""
    if isinstance(reference, bool) or isinstance(value, bool):
        return "" if isinstance(value, bool) and isinstance(reference, bool) else f"a {type(value).__name__}"
    if isinstance(reference, (int, float, np.number)):  # a count may become a mean: numbers stand for numbers
        return "" if isinstance(value, (int, float, np.number)) else f"a {type(value).__name__}, not a number"
    for family in (str, dict, list, set, np.random.Generator):
        if isinstance(reference, family) and not hasattr(type(reference), "_fields"):
            return "" if isinstance(value, family) else f"a {type(value).__name__}, not a {family.__name__}"
    return "" if type(value) is type(reference) else f"a {type(value).__name__}, not a {type(reference).__name__}"


# ---------------------------------------------------------------------------------- clients
_ROUND_FILE = re.compile(r"round_(\d+)\.bin$")


def _client_files(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _ROUND_FILE.match(p.name))}


def save_client_state(root: str | Path, partition_id: int, server_round: int, state: RecordDict) -> Path:
    """Write a client's ``context.state`` after training in ``server_round``; keep only what a
    resume can still need (this round's file and the newest older one)."""
    from flwr.common.serde import recorddict_to_proto

    folder = Path(root) / str(partition_id)
    path = folder / f"round_{server_round}.bin"
    _atomic_write(path, recorddict_to_proto(state).SerializeToString())
    older = sorted(r for r in _client_files(folder) if r < server_round)
    for r in older[:-1]:
        _client_files(folder)[r].unlink(missing_ok=True)
    return path


def restore_client_state(root: str | Path, partition_id: int, upto_round: int, state: RecordDict) -> int:
    """Fill an empty ``state`` (RecordDict) from the newest file of a round <= ``upto_round``;
    returns that round (0: nothing to restore)."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    files = {r: p for r, p in _client_files(Path(root) / str(partition_id)).items() if r <= upto_round}
    if not files:
        return 0
    newest = max(files)
    proto = ProtoRecordDict()
    proto.ParseFromString(files[newest].read_bytes())
    for key, record in recorddict_from_proto(proto).items():
        state[key] = record
    return newest


def drop_client_states_after(root: str | Path, server_round: int) -> int:
    """Delete every client state file of a round after ``server_round`` under ``root`` (written
    during an interrupted round that a resumed run runs again); returns how many."""
    dropped = 0
    folder = Path(root)
    for client in folder.iterdir() if folder.is_dir() else []:
        for r, path in _client_files(client).items():
            if r > server_round:
                path.unlink(missing_ok=True)
                dropped += 1
    return dropped
