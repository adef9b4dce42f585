"""Flower's simulation engine (Ray), asking only the nodes that have a message waiting.

Flower 1.39's engine (``flwr.server.superlink.fleet.vce.vce_api``) finds the messages to run in a
thread that, every 0.1 s, calls ``LinkState.get_message_ins(node_id, limit=1)`` for **every**
node; the in-memory LinkState answers each call by scanning every stored message. At 1,000 nodes
that thread costs about 0.16 ms x 1,000 calls per sweep, most of a core on the 2-core machine,
while 10 clients train (``benchmarks/scale.py --trace-engine``; docs/results/scale.md).

:func:`polling_pending_nodes` swaps in :func:`add_messages_to_queue`: the same loop, the same
queue, the same order of nodes and the same ``get_message_ins`` call per node, but only for the
nodes that the stored messages name and that have not been delivered yet (read under the state's
lock), so a sweep costs one pass over the stored messages plus one call per waiting message. A
LinkState other than the in-memory one gets Flower's own loop. Listed in docs/design.md's table
of Flower internals.

Neither wait of a round is Flower's fixed 0.1 s poll any more. With it, a round waited on average
0.05 s for its messages to be picked up and 0.05 s for its last reply to be seen
(``benchmarks/overhead.py``, docs/results/overhead.md). Now the sweep runs as soon as a message is
stored, and :func:`send_and_receive` checks for replies as soon as one is stored: each loop waits
on an event that the state's ``store_message_ins`` / ``store_message_res`` also sets (wrapped on
that one state instance while the loop runs), for at most :data:`POLL_SECONDS` (Flower's 0.1 s),
so a stop or a deadline is still seen, and a state that is not the one wrapped still works at
Flower's pace.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from queue import Queue
from typing import Any

POLL_SECONDS = 0.1  # Flower's pause between two sweeps and between two reply checks: now the longest wait
FLOWER_LOOP: list[Any] = []  # Flower's own loop, while ours stands in for it (polling_pending_nodes)


@contextlib.contextmanager
def telling(state: Any, method: str) -> Iterator[threading.Event]:
    """Within the block, ``state.<method>`` (a store) also sets the event yielded."""
    stored = threading.Event()
    store = getattr(state, method)

    def store_and_tell(*args: Any, **kwargs: Any) -> Any:
        result = store(*args, **kwargs)
        stored.set()
        return result

    setattr(state, method, store_and_tell)  # this instance only
    try:
        yield stored
    finally:
        delattr(state, method)


def send_and_receive(grid: Any, messages: list[Any], timeout: float | None) -> list[Any]:
    """``grid.send_and_receive(messages=messages, timeout=timeout)``; on Flower's simulation grid
    (``InMemoryGrid``) the same loop (push, then pull the replies until every message has one or
    the deadline passes), checking as soon as a reply is stored instead of every
    ``pull_interval`` (0.1 s)."""
    if "flwr.superlink.grid" not in sys.modules:  # not imported (by the engine): the grid cannot be one, and
        return list(grid.send_and_receive(messages=messages, timeout=timeout))  # importing it costs ~1 s (SQLAlchemy)
    from flwr.superlink.grid import InMemoryGrid

    if not isinstance(grid, InMemoryGrid):
        return list(grid.send_and_receive(messages=messages, timeout=timeout))
    with telling(grid.state, "store_message_res") as replied:
        pending = set(grid.push_messages(messages))
        end = time.time() + (timeout or 0.0)
        replies: list[Any] = []
        while timeout is None or time.time() < end:
            replied.clear()  # a reply stored from here on wakes the wait below
            found = list(grid.pull_messages(pending))
            replies.extend(found)
            pending.difference_update(message.metadata.reply_to_message_id for message in found)
            if not pending:
                break
            replied.wait(POLL_SECONDS if timeout is None else max(0.0, min(POLL_SECONDS, end - time.time())))
    return replies


def waiting_nodes(state: Any) -> set[int] | None:
    """The node ids of the messages stored in ``state`` and not delivered yet; None when
    ``state`` is not Flower's in-memory LinkState (its store cannot be read)."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    if not isinstance(state, InMemoryLinkState):
        return None
    with state.lock:
        return {message.metadata.dst_node_id for message in state.message_ins_store.values()
                if message.metadata.delivered_at == ""}


def add_messages_to_queue(state: Any, queue: Queue[Any], nodes_mapping: dict[int, int],
                          f_stop: threading.Event) -> None:
    """Flower's ``add_messages_to_queue`` (same arguments), sweeping only the waiting nodes, and
    as soon as a message is stored rather than every 0.1 s."""
    if waiting_nodes(state) is None:
        FLOWER_LOOP[0](state, queue, nodes_mapping, f_stop)
        return
    with telling(state, "store_message_ins") as stored:
        while not f_stop.is_set():
            stored.clear()  # a message stored from here on wakes the next wait
            waiting = waiting_nodes(state) or set()
            for node_id in (node for node in nodes_mapping if node in waiting):
                for message in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(message)
            stored.wait(POLL_SECONDS)


@contextlib.contextmanager
def polling_pending_nodes() -> Iterator[None]:
    """Within the block, Flower's simulation engine uses :func:`add_messages_to_queue`."""
    from flwr.server.superlink.fleet.vce import vce_api

    FLOWER_LOOP[:] = [vce_api.add_messages_to_queue]
    vce_api.add_messages_to_queue = add_messages_to_queue  # type: ignore[assignment]
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = FLOWER_LOOP[0]
