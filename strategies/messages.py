"""The Flower message of one :class:`~fedlora.strategies.download.Download`: its arrays and the
config a fedlora client reads (every key declared in ``fedlora/protocol.py``).

:class:`~fedlora.strategies.base.LoRAStrategy` gathers the entries of the run (the experiment, the
client's rank, where files go) and of the round; :func:`download_message` puts them together with
the method's own entries and Flower's config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedlora import protocol
from fedlora.lora import to_array_record
from fedlora.strategies.download import Download


@dataclass(frozen=True)
class RunPaths:
    """Where the ServerApp keeps a run's files, given to the strategy's constructor
    (:func:`fedlora.app.server.run_paths`); a keyword-built strategy has none."""

    adapter_dir: str = ""  # personalised adapters are saved there by the clients
    checkpoint_dir: str = ""  # clients keep their state there (simulation: one file system)
    state_on_disk: bool = False  # simulation: clients keep their state only there between messages
    resumed_from: int = 0  # > 0: a resumed run, clients restore their state of this round
    # the server's class names, in the head's order: a silo with its own data file encodes its labels
    # with them (it need not read [data].source)
    label_names: tuple[str, ...] = ()

    def entries(self) -> dict[str, Any]:
        """The config entries every message of the run carries about these paths (and its labels)."""
        entries: dict[str, Any] = {}
        if self.label_names:
            entries[protocol.LABEL_NAMES] = list(self.label_names)
        if self.checkpoint_dir:
            entries[protocol.CHECKPOINT_DIR] = self.checkpoint_dir
            if self.state_on_disk:
                entries[protocol.STATE_ON_DISK] = True
        if self.resumed_from:
            entries[protocol.RESUME_ROUND] = self.resumed_from
        return entries


def download_message(download: Download, server_round: int, node_id: int, entries: Mapping[str, Any],
                     flower_config: ConfigRecord | None = None) -> Message:
    """The message carrying ``download`` to ``node_id`` in ``server_round``: Flower's config
    (``flower_config``, without fedlora's own keys), the round, fedlora's ``entries`` and the
    method's (``download.config``), later ones first."""
    config = ConfigRecord({
        **{key: value for key, value in (flower_config or {}).items() if key not in protocol.MESSAGE_KEYS},
        protocol.SERVER_ROUND: server_round,
        **entries,
        **download.config,
    })
    message_type = MessageType.TRAIN if download.phase == "train" else MessageType.EVALUATE
    content = RecordDict({protocol.ARRAYS_RECORD: to_array_record(download.payload), protocol.CONFIG_RECORD: config})
    return Message(content=content, dst_node_id=node_id, message_type=message_type)
