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

Flower's rules for replies hold here too (a client is untrusted; in process its ClientApp is
still code run inside the server's process: these rules guard the messages, not the process):

- **Timeout.** ``send_and_receive(..., timeout=T)`` (Flower's strategies pass
  ``federation.round_timeout``) returns the replies that arrived in time and leaves the others
  out, as Flower's grid does: a late reply is a missing reply, which the strategy counts as a
  failure of the round. The calls run one after the other (a ClientApp's results must not depend
  on another's running beside it in this process: torch's RNG and thread pool are global), so each
  call gets ``T`` seconds of its own, measured from its start, as if every node had started when
  the message was pushed; one ``send_and_receive`` takes at most ``n x T`` seconds for ``n``
  messages. ``timeout=None`` (and ``pull_messages``, which has no timeout) waits for every reply,
  as Flower's grid does.
- **A client that never answers cannot hang the run.** Each ClientApp call runs in a daemon worker
  thread (:meth:`InProcessGrid._call`); the server waits for it until the deadline and then goes on without it.
  A worker whose call has returned runs the next call (:class:`Worker`): with a fresh thread per
  call, every call faulted its memory in anew (glibc gives a new thread its own heap): about
  50,000 page faults for a MiniLM client's 8 training steps against 5,000 to 10,000 on a thread
  that ran calls before, and 2 to 11 % more time than the same steps on the main thread in
  interleaved runs (docs/results/overhead.md, runs 12 and 13).
  A thread, not a process, because the ClientApp shares this process by design (its node
  ``Context`` and state, the loaded backbone, torch) and a process would have to pickle the app
  and send the node's state back. The honest limit on CPU: Python cannot kill a thread, so a call
  that never returns keeps its thread, and whatever CPU and memory it uses, until the process
  ends (a daemon thread does not keep the process alive at exit); the node's later messages wait
  behind it (one call per node at a time, as a SuperNode runs its messages) and go unanswered
  too, as a hung SuperNode's would. A late call that does finish has its reply discarded (logged).
- **A reply must come from the node the message went to and answer that message**, as Flower's
  link state checks before it stores a reply (``store_message_res``): its ``src_node_id`` must be
  the message's ``dst_node_id`` and its ``reply_to_message_id`` the message's id (Flower's:
  the object id of the message, set on the sender's copy and on the node's). Any other reply is
  refused (logged), so the server sees no reply from that node: a failure of the round, as in a
  deployment, where the SuperLink refuses to store it.
- A ClientApp that raises becomes an error reply (``CLIENT_APP_RAISED_EXCEPTION``); one that exits
  the call (``SystemExit`` and other ``BaseException`` subclasses, which would end a deployed ClientApp's
  process) becomes the error reply of a crashed ClientApp (``CLIENT_APP_CRASHED``), as its
  SuperNode would send.
"""

from __future__ import annotations

import contextvars
import functools
import queue
import threading
import time
import traceback
from collections.abc import Iterable
from logging import WARNING, getLogger
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

log = getLogger("flwr").log  # Flower's logger, by its name, as the strategies log a client's failure


class Worker:
    """A daemon thread that runs the calls handed to it (:meth:`run`) one after the other.

    Reused because a fresh thread per call trained measurably slower (docs/results/overhead.md,
    runs 12-13); not a ``concurrent.futures.ThreadPoolExecutor`` because its threads are not
    daemons: a client call that never returns would keep the process from exiting, while here the
    grid gives up on it at its timeout and the next call gets a worker of its own."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(target=self._loop, daemon=True, name=name).start()

    def run(self, call: Any) -> None:
        """Run ``call()`` in this worker's thread (not waiting for it)."""
        self._calls.put(call)

    def _loop(self) -> None:
        while True:
            self._calls.get()()


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
        self._pending: dict[str, Message] = {}  # pushed, not yet delivered: message id -> the node's copy
        self._busy: dict[int, threading.Lock] = {}  # one ClientApp call per node at a time (made on first use)
        self._idle: list[Worker] = []  # workers whose call has returned (a call that never returns keeps its own)
        self._idle_lock = threading.Lock()
        self._workers = 0  # workers started (names them)
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

    def partition_binding(self) -> dict[int, int]:
        """The engine's binding of node ids to partitions: the partition id of each node's node config,
        as this engine wrote it (a node's reply claiming another is refused)."""
        return {node_id: int(context.node_config[protocol.NODE_PARTITION_ID])
                for node_id, context in self.contexts.items() if protocol.NODE_PARTITION_ID in context.node_config}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Carry each message to its node (:func:`over_the_wire`: what Flower cannot serialise raises
        here) and return the message ids: Flower's, the message's object id, set on the sender's
        copy and on the node's as a deployment does. The ClientApp runs when the reply is pulled."""
        ids = []
        for message in messages:
            if message.metadata.dst_node_id not in self.contexts:
                raise KeyError(f"no node {message.metadata.dst_node_id} in this in-process grid")
            message_id, received = carried(message)
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's grid does on push
            self._pending[message_id] = received
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The replies to the pushed messages ``message_ids``, each waited for with no time limit."""
        return self._collect(message_ids, timeout=None)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages`` and return the replies that came in time (each call gets ``timeout``
        seconds of its own; None: no limit) from the node each message went to (module docstring)."""
        return self._collect(self.push_messages(messages), timeout)

    def _collect(self, message_ids: Iterable[str], timeout: float | None) -> list[Message]:
        replies = []
        for message_id in message_ids:
            received = self._pending.pop(message_id, None)
            if received is None:
                continue
            reply = self._call(received, timeout)
            if reply is not None:
                replies.append(reply)
        return replies

    def _call(self, message: Message, timeout: float | None) -> Message | None:
        """Run the ClientApp on ``message`` (the node's copy) in a daemon worker thread (an idle
        :class:`Worker`, or a new one) and wait for it at most ``timeout`` seconds (None: no
        limit); the reply as the ServerApp receives it, or None for a reply that did not come in
        time or that Flower's link state refuses."""
        node = message.metadata.dst_node_id
        busy = self._busy.setdefault(node, threading.Lock())  # in the caller's thread: one lock per node
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        outcome: list[tuple[Message | BaseException, float]] = []  # the reply (or the engine's own error), when

        def call() -> None:
            reply: Message | BaseException
            with busy:  # behind the node's earlier call, if that one still runs
                try:
                    reply = self._deliver(message)  # a client's exception is an error reply already
                except BaseException as error:  # noqa: BLE001 - the engine's (or a subclass's) own: raised by the caller
                    reply = error
            finished = time.monotonic()
            if deadline is not None and finished > deadline:
                log(WARNING, "in-process engine: node %d replied after %.1f s, past the %.1f s timeout: reply discarded",
                    node, finished - started, timeout)
            outcome.append((reply, finished))
            with self._idle_lock:
                self._idle.append(worker)  # free for the next call
            done.set()

        done = threading.Event()
        with self._idle_lock:
            if not self._idle:
                self._workers += 1
                self._idle.append(Worker(f"ClientApp worker {self._workers}"))
            worker = self._idle.pop()
        worker.run(functools.partial(contextvars.copy_context().run, call))
        done.wait(timeout)
        if not outcome or (deadline is not None and outcome[0][1] > deadline):
            log(WARNING, "in-process engine: node %d did not reply within %s s (the round's timeout): no reply, "
                "as Flower's grid leaves it out", node, timeout)
            return None
        reply = outcome[0][0]
        if isinstance(reply, BaseException):
            raise reply
        problem = foreign(reply, message)
        if problem:
            log(WARNING, "in-process engine: reply refused (as Flower's link state refuses it): %s", problem)
            return None
        return reply

    def _deliver(self, message: Message) -> Message:
        """The reply to ``message`` (what the node received), as the ServerApp receives it."""
        context = self.contexts[message.metadata.dst_node_id]
        try:
            reply = self.client_app(message, context)
        except Exception as error:  # noqa: BLE001 - Flower turns ClientApp exceptions into error replies too
            reason = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=3)}"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        except BaseException as error:  # noqa: BLE001 - SystemExit & co. end a deployed ClientApp's process
            reason = f"the ClientApp exited: {type(error).__name__}: {error}"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason), reply_to=message)
        try:
            return carried(reply)[1]
        except Exception as error:  # noqa: BLE001 - any serialisation failure: the reply never leaves the node
            # A deployed ClientApp that cannot push its reply exits; its SuperNode then answers
            # with CLIENT_APP_CRASHED ("ClientApp stopped responding."). Here the cause is known.
            reason = f"the ClientApp's reply cannot be serialised as Flower sends it: {type(error).__name__}: {error}"
            return carried(Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason), reply_to=message))[1]


def foreign(reply: Message, message: Message) -> str:
    """Why Flower's link state would refuse ``reply`` as the answer to ``message`` (``store_message_res``:
    it must come from the node the message went to and name that message), '' if it would not."""
    sent_to, answers = message.metadata.dst_node_id, message.metadata.message_id
    if reply.metadata.src_node_id != sent_to:
        return f"the reply to a message for node {sent_to} comes from node {reply.metadata.src_node_id}"
    if reply.metadata.reply_to_message_id != answers:
        return (f"node {sent_to} replied to message {reply.metadata.reply_to_message_id[:16]!r}, "
                f"not to the message it was sent ({answers[:16]!r})")
    return ""


def carried(message: Message) -> tuple[str, Message]:
    """``message``'s id and the copy the other side receives (:func:`over_the_wire`), with that id
    set as Flower sets it on the receiving side (the SuperNode on a pulled message, the grid on a
    pulled reply)."""
    message_id, contents = deflate(message)
    received = cast(Message, inflate_object_from_contents(message_id, contents))
    received.metadata.__dict__["_message_id"] = message_id
    return message_id, received


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
    Flower's message id (the object id, which a deployment sets on both copies) is not set here;
    :func:`carried` sets it."""
    message_id, contents = deflate(message)
    return cast(Message, inflate_object_from_contents(message_id, contents))


def node_configs(num_clients: int) -> list[dict[str, Any]]:
    """The node configs Flower's simulation engine gives its virtual SuperNodes."""
    return [{protocol.NODE_PARTITION_ID: i, protocol.NODE_NUM_PARTITIONS: num_clients} for i in range(num_clients)]
