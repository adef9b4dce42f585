"""An in-process Flower Grid: the real ServerApp logic and the real ClientApp, no Ray.

Every node is a Flower ``Context`` (with its own ``node_config`` and persistent ``state``);
``send_and_receive`` calls the ClientApp directly, one message after the other, and turns a
client exception into an error reply exactly as Flower does. Use it for fast strategy tests and
for debugging a strategy step by step. This module is an engine only: running the ServerApp on it
is :func:`fedlora.app.runner.run_inprocess`; the Ray engine is Flower's own simulation engine.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

RUN_ID = 1
SERVER_NODE_ID = 0


class InProcessGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process."""

    def __init__(self, client_app: Any, node_configs: list[dict[str, Any]]) -> None:
        self.client_app = client_app
        self.contexts = {
            1000 + i: Context(
                run_id=RUN_ID, node_id=1000 + i, node_config=dict(cfg), state=RecordDict(), run_config={}
            )
            for i, cfg in enumerate(node_configs)
        }
        self._ids = itertools.count(1)
        self._replies: dict[str, Message] = {}
        self._run = Run.create_empty(RUN_ID)
        TaskIdentity.run_id = RUN_ID
        TaskIdentity.node_id = SERVER_NODE_ID
        TaskIdentity.task_id = 0

    def set_run(self, run: Run) -> None:
        """Replace the run this grid reports (the in-process engine has exactly one)."""
        self._run = run

    @property
    def run(self) -> Run:
        """The one in-process run (run id :data:`RUN_ID`, no FAB: the apps are imported)."""
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None) -> Message:
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for message in messages:
            message_id = str(next(self._ids))
            self._replies[message_id] = self._deliver(message)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, message: Message) -> Message:
        context = self.contexts[message.metadata.dst_node_id]
        try:
            return self.client_app(message, context)
        except Exception as error:  # noqa: BLE001 - Flower turns ClientApp exceptions into error replies too
            reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)


def node_configs(num_clients: int) -> list[dict[str, Any]]:
    """The node configs Flower's simulation engine gives its virtual SuperNodes."""
    return [{"partition-id": i, "num-partitions": num_clients} for i in range(num_clients)]
