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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from queue import Queue
from typing import Any

POLL_SECONDS = 0.1  # Flower's pause between two sweeps


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
    """Flower's ``add_messages_to_queue`` (same arguments), sweeping only the waiting nodes."""
    if waiting_nodes(state) is None:
        FLOWER_LOOP[0](state, queue, nodes_mapping, f_stop)
        return
    while not f_stop.is_set():
        waiting = waiting_nodes(state) or set()
        for node_id in (node for node in nodes_mapping if node in waiting):
            for message in state.get_message_ins(node_id=node_id, limit=1):
                queue.put(message)
        f_stop.wait(POLL_SECONDS)


FLOWER_LOOP: list[Any] = []  # Flower's own loop, while ours stands in for it


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
