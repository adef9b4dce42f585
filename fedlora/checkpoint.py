"""Checkpoint / resume: the server's state after every round, the clients' kept state.

Server side, at the end of every round: ``DIR/checkpoint/server-<round>.safetensors`` (every array
of the state) and ``DIR/checkpoint/server.json`` (the round number, the comparable config, the
partitions that took part, and the structure of the strategy's state, the results so far and the
privacy ledger; :mod:`fedlora.state`), each written atomically (write, then rename), the JSON last.
Nothing is pickled: a corrupt or foreign checkpoint gives one ConfigError line, never code.

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

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlora.errors import ConfigError
from fedlora.schema import ExperimentConfig
from fedlora.state import StateError, decode, encode

if TYPE_CHECKING:
    from flwr.app import RecordDict

SERVER_FILE = "server.json"  # the structure; its arrays are in the safetensors file it names
CLIENTS_DIR = "clients"
FORMAT = 2  # 1 was a pickle (no longer read: a checkpoint must never run code)


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


def _comparable(config: ExperimentConfig) -> dict[str, Any]:
    """The config without what may change on resume: the output folder, and the number of rounds
    unless a DP target epsilon was planned for it."""
    data = config.model_dump(mode="json")
    data.pop("output", None)
    if not (config.privacy.dp and config.privacy.target_epsilon is not None):
        data["train"].pop("rounds", None)
    return data


def save_server(out_dir: str | Path, server_round: int, config: ExperimentConfig, state: dict[str, Any],
                rounds: list[Any], privacy: dict[str, Any] | None = None, partitions: list[int] | None = None) -> Path:
    """Write the server checkpoint of the completed round ``server_round``: the arrays first (a new
    file per round), then the JSON that names them (atomically), then the older arrays go."""
    from safetensors.numpy import save_file

    folder = checkpoint_dir(out_dir)
    structure, arrays = encode({"strategy": state, "rounds": rounds, "privacy": privacy})
    arrays_name = f"server-{server_round}.safetensors"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(arrays, str(folder / (arrays_name + ".tmp")))
    os.replace(folder / (arrays_name + ".tmp"), folder / arrays_name)
    blob = {"format": FORMAT, "round": server_round, "config": _comparable(config), "arrays": arrays_name,
            "partitions": list(partitions or []), "state": structure}
    path = folder / SERVER_FILE
    _atomic_write(path, json.dumps(blob).encode())
    for old in folder.glob("server-*.safetensors"):
        if old.name != arrays_name:
            old.unlink(missing_ok=True)
    return path


def load_server(out_dir: str | Path, config: ExperimentConfig | None = None) -> dict[str, Any]:
    """The last server checkpoint in ``out_dir``: ``round``, ``partitions``, ``strategy`` (state),
    ``rounds``, ``privacy``. ConfigError (one line) if there is none, if it is corrupt or not a
    fedlora checkpoint, or if ``config`` differs from the checkpointed run's."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = checkpoint_dir(out_dir)
    path = folder / SERVER_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {out_dir}: no checkpoint {path}; resume needs the output folder of a "
                          f"run that completed at least one round")
    try:
        blob = json.loads(path.read_text())
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise StateError(f"format {blob.get('format') if isinstance(blob, dict) else None!r}, expected {FORMAT}")
        arrays_path = folder / str(blob["arrays"])
        if arrays_path.parent != folder:
            raise StateError("the arrays file is outside the checkpoint folder")
        saved = decode(blob["state"], load_file(str(arrays_path)))
        round_done, partitions = int(blob["round"]), [int(p) for p in blob["partitions"]]
    except (OSError, ValueError, KeyError, TypeError, StateError, SafetensorError) as error:
        raise ConfigError(f"--resume {out_dir}: the checkpoint is corrupt or not a fedlora checkpoint "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from None
    if config is not None and blob["config"] != _comparable(config):
        stored, now = blob["config"], _comparable(config)
        keys = sorted(f"{s}.{k}" for s in now for k in (now[s] if isinstance(now[s], dict) else {})
                      if isinstance(stored.get(s), dict) and stored[s].get(k) != now[s].get(k))
        raise ConfigError(f"--resume {out_dir}: the config differs from the checkpointed run in "
                          f"{', '.join(keys) or 'its sections'}; resume with the same config (train.rounds "
                          f"may grow, except under a DP target_epsilon planned for it)")
    return {"round": round_done, "partitions": partitions, **saved}


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
