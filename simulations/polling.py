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

Neither wait of a round is Flower's fixed 0.1 s any more (on average 0.05 s for a round's messages
to be picked up and 0.05 s for its last reply to be seen; ``benchmarks/overhead.py``,
docs/results/overhead.md): the sweep runs as soon as a message is stored (the state's
``store_message_ins`` also sets an event the loop waits on, at most 0.1 s, so it still sees a
stop), and the grid checks for replies every :func:`poll_seconds` of the round's messages
(Flower's ``InMemoryGrid.pull_interval``, a constructor parameter that ``run_simulation`` leaves
at 0.1 s): 10 ms for a round of up to 100 messages, growing with the messages to Flower's 0.1 s
at 1,000, since a check reads every message of the round.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from queue import Queue
from typing import Any

MIN_POLL_SECONDS = 0.01  # the shortest pause between two polls (a round of up to 100 messages)
MAX_POLL_SECONDS = 0.1  # Flower's pause between two sweeps and between two reply checks
POLL_SECONDS = MAX_POLL_SECONDS  # the longest the sweep waits for a stored message (then it checks for a stop)
POLL_SECONDS_PER_MESSAGE = 1e-4  # a reply check reads every message of the round: wait longer the more there are
FLOWER_LOOP: list[Any] = []  # Flower's own loop, while ours stands in for it (polling_pending_nodes)


def poll_seconds(in_flight: int) -> float:
    """The pause between two polls with ``in_flight`` messages outstanding: :data:`MIN_POLL_SECONDS`
    up to 100 messages, then :data:`POLL_SECONDS_PER_MESSAGE` a message, at most Flower's
    :data:`MAX_POLL_SECONDS`."""
    return min(MAX_POLL_SECONDS, max(MIN_POLL_SECONDS, in_flight * POLL_SECONDS_PER_MESSAGE))


def prompt_replies(grid: Any, in_flight: int) -> None:
    """Set the pause between two reply checks of Flower's simulation grid (``InMemoryGrid``, its
    public ``pull_interval``) for a round of ``in_flight`` messages; any other grid is left as it is."""
    from flwr.superlink.grid import InMemoryGrid

    if isinstance(grid, InMemoryGrid):
        grid.pull_interval = poll_seconds(in_flight)


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
    stored = threading.Event()
    store = state.store_message_ins

    def store_and_tell(*args: Any, **kwargs: Any) -> Any:
        result = store(*args, **kwargs)
        stored.set()
        return result

    state.store_message_ins = store_and_tell  # this state only, for as long as the loop runs
    try:
        while not f_stop.is_set():
            stored.clear()  # a message stored from here on wakes the next wait
            waiting = waiting_nodes(state) or set()
            for node_id in (node for node in nodes_mapping if node in waiting):
                for message in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(message)
            stored.wait(POLL_SECONDS)
    finally:
        del state.store_message_ins


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
