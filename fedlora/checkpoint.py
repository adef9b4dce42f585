"""Checkpoint / resume: the server's state after every round, the clients' kept state.

Server side, ``DIR/checkpoint/server.pkl`` is rewritten atomically (write, then rename) at the
end of every round with the round number, the strategy's state
(:meth:`strategies.base.LoRAStrategy.state_dict`: global factors, per-client state keyed by
partition id, the client sampler ``strategy.rng``, the round books) and the results so far.

Client side, a client's ``context.state`` (its kept adapter and whatever its trainer stores
there) is written after every training round to ``<checkpoint-dir>/<partition id>/round_<r>.bin``
(Flower's RecordDict protobuf). In simulation ``<checkpoint-dir>`` is ``DIR/checkpoint/clients``,
told by the server; in a deployment a silo sets its own folder with the node config
``checkpoint-dir``. On resume from round ``k`` a client with an empty ``context.state`` restores
the newest file of a round <= ``k``: a file from the interrupted round ``k + 1`` is ignored.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

from fedlora.errors import ConfigError
from fedlora.schema import ExperimentConfig

SERVER_FILE = "server.pkl"
CLIENTS_DIR = "clients"
FORMAT = 1


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
                rounds: list, privacy: dict[str, float] | None = None, partitions: list[int] | None = None) -> Path:
    """Write the server checkpoint of the completed round ``server_round`` (atomically)."""
    path = checkpoint_dir(out_dir) / SERVER_FILE
    blob = {"format": FORMAT, "round": server_round, "config": _comparable(config), "strategy": state,
            "rounds": rounds, "privacy": privacy, "partitions": list(partitions or [])}
    _atomic_write(path, pickle.dumps(blob, protocol=pickle.HIGHEST_PROTOCOL))
    return path


def load_server(out_dir: str | Path, config: ExperimentConfig | None = None) -> dict[str, Any]:
    """The last server checkpoint in ``out_dir`` (ConfigError if none or if ``config`` differs)."""
    path = checkpoint_dir(out_dir) / SERVER_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {out_dir}: no checkpoint {path}; resume needs the output folder of a "
                          f"run that completed at least one round")
    blob = pickle.loads(path.read_bytes())
    if config is not None and blob["config"] != _comparable(config):
        saved, now = blob["config"], _comparable(config)
        keys = sorted(f"{s}.{k}" for s in now for k in (now[s] if isinstance(now[s], dict) else {})
                      if isinstance(saved.get(s), dict) and saved[s].get(k) != now[s].get(k))
        raise ConfigError(f"--resume {out_dir}: the config differs from the checkpointed run in "
                          f"{', '.join(keys) or 'its sections'}; resume with the same config (train.rounds "
                          f"may grow, except under a DP target_epsilon planned for it)")
    return blob


# ---------------------------------------------------------------------------------- clients
_ROUND_FILE = re.compile(r"round_(\d+)\.bin$")


def _client_files(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := _ROUND_FILE.match(p.name))}


def save_client_state(root: str | Path, partition_id: int, server_round: int, state) -> Path:
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


def restore_client_state(root: str | Path, partition_id: int, upto_round: int, state) -> int:
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
