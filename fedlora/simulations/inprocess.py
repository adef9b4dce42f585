"""An in-process Flower Grid: the real ServerApp logic and the real ClientApp, no Ray.

Every node is a Flower ``Context`` (with its own ``node_config`` and persistent ``state``);
``send_and_receive`` calls the ClientApp directly, one message after the other, and turns a
client exception into an error reply exactly as Flower does. Every message travels as it does in a
deployment (:func:`over_the_wire`): the ServerApp's message and the ClientApp's reply are each
deflated into Flower's object tree (bytes, arrays included) and inflated on the other side, so
each side gets its own copy and what Flower cannot serialise fails here too: a message of the
ServerApp raises in ``push_messages``, a reply comes back as the error reply Flower's SuperNode
sends for a ClientApp that could not push its reply. Use it for fast strategy tests and
for debugging a strategy step by step. This module is an engine only: running the ServerApp on it
is :func:`fedlora.app.runner.run_inprocess`; the Ray engine is Flower's own simulation engine.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterable
from typing import Any, cast

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from fedlora import protocol

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
            self._replies[message_id] = self._deliver(over_the_wire(message))
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))

    def _deliver(self, message: Message) -> Message:
        """The reply to ``message`` (what the node received), as the ServerApp receives it."""
        context = self.contexts[message.metadata.dst_node_id]
        try:
            reply = self.client_app(message, context)
        except Exception as error:  # noqa: BLE001 - Flower turns ClientApp exceptions into error replies too
            reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        try:
            return over_the_wire(reply)
        except Exception as error:  # noqa: BLE001 - any serialisation failure: the reply never leaves the node
            # A deployed ClientApp that cannot push its reply exits; its SuperNode then answers
            # with CLIENT_APP_CRASHED ("ClientApp stopped responding."). Here the cause is known.
            reason = f"the ClientApp's reply cannot be serialised as Flower sends it: {type(error).__name__}: {error}"
            return over_the_wire(Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason), reply_to=message))


def deflate(message: Message) -> tuple[str, dict[str, bytes]]:
    """``message`` as Flower puts it on the wire (flwr 1.39: the grid's ``push_messages`` and the
    ClientApp's ``push_message``): every object of its tree (the message, its RecordDict, each
    record, each array and its chunks) deflated to bytes, keyed by object id (the SHA-256 of
    those bytes); and the message's own id."""
    with no_object_id_recompute():  # as Flower does: each object id computed once
        contents = {object_id: obj.deflate() for object_id, obj in get_all_nested_objects(message).items()}
        return message.object_id, contents


def over_the_wire(message: Message) -> Message:
    """The message the other side receives: ``message`` deflated (:func:`deflate`) and inflated
    from those bytes alone, as Flower's SuperNode and grid do (``inflate_object_from_contents``).
    A copy that shares nothing with ``message``; what Flower cannot serialise raises here.
    Flower's message id (the object id, which a deployment sets on both copies) is not set: the
    in-process engine's message ids are its own."""
    message_id, contents = deflate(message)
    return cast(Message, inflate_object_from_contents(message_id, contents))


def node_configs(num_clients: int) -> list[dict[str, Any]]:
    """The node configs Flower's simulation engine gives its virtual SuperNodes."""
    return [{protocol.NODE_PARTITION_ID: i, protocol.NODE_NUM_PARTITIONS: num_clients} for i in range(num_clients)]
