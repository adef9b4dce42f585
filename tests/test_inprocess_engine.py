"""The in-process engine carries messages as Flower's wire does (simulations/inprocess.py).

Each message and each reply is deflated into Flower's object tree and inflated on the other side,
so the two sides share no object and what Flower cannot serialise fails in process too, as it
would in a deployment: the ServerApp's push raises, a ClientApp's reply becomes an error reply.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedlora.simulations.inprocess import InProcessGrid, node_configs

NODE = 1000  # InProcessGrid: node 1000 + k holds partition k
CLIENT_APP_CRASHED = 8  # Flower's ErrorCode for a ClientApp whose reply never arrived


def train_message(grid: InProcessGrid, config: dict[str, int | str]) -> Message:
    arrays = ArrayRecord({"w": Array(np.array([1.0, 2.0, 3.0], dtype=np.float32))})
    return grid.create_message(RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), "train", NODE, "1")


def test_each_side_gets_its_own_copy() -> None:
    """The ClientApp rewrites what it received and the ServerApp what came back: neither change
    reaches the other side (with messages passed as objects, both would)."""
    kept: dict[str, RecordDict] = {}

    def client_app(msg: Message, context: Context) -> Message:
        msg.content["arrays"]["w"] = Array(np.zeros(3, dtype=np.float32))  # the client's own edit of the download
        msg.content["config"]["lr"] = "changed"
        upload = ArrayRecord({"w": Array(np.array([7.0, 8.0, 9.0], dtype=np.float32))})
        context.state["upload"] = upload
        kept["state"] = context.state
        return Message(RecordDict({"arrays": upload, "metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)

    grid = InProcessGrid(client_app, node_configs(1))
    sent = train_message(grid, {"lr": "1e-3"})
    (reply,) = grid.send_and_receive([sent])
    # the server's message is as it sent it
    np.testing.assert_array_equal(sent.content["arrays"]["w"].numpy(), [1.0, 2.0, 3.0])
    assert sent.content["config"]["lr"] == "1e-3"
    # the reply is what the client sent; the server's edit of it leaves the client's state alone
    np.testing.assert_array_equal(reply.content["arrays"]["w"].numpy(), [7.0, 8.0, 9.0])
    assert reply.content["metrics"]["num-examples"] == 5
    reply.content["arrays"]["w"] = Array(np.full(3, -1.0, dtype=np.float32))
    np.testing.assert_array_equal(kept["state"]["upload"]["w"].numpy(), [7.0, 8.0, 9.0])


def test_what_flower_cannot_serialise_fails_in_process() -> None:
    """A value outside protobuf's 64-bit integers is accepted by Flower's records but cannot be
    serialised: a ServerApp message with one raises on push; a reply with one comes back as the
    error reply of a ClientApp that never answered."""
    def client_app(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": 2**70})}), reply_to=msg)

    grid = InProcessGrid(client_app, node_configs(1))
    (reply,) = grid.send_and_receive([train_message(grid, {"lr": "1e-3"})])
    assert reply.has_error() and not reply.has_content()
    assert reply.error.code == CLIENT_APP_CRASHED
    assert "cannot be serialised" in reply.error.reason and "out of range" in reply.error.reason
    with pytest.raises(ValueError, match="out of range"):
        grid.push_messages([train_message(grid, {"seed": 2**70})])


# ------------------------------------------------------------------- Flower's rules for replies
TIMEOUT = 1.0  # seconds: the round_timeout of these tests (a late client sleeps LATE)
LATE = 2.0


def two_nodes(client_app) -> tuple[InProcessGrid, list[Message]]:
    """A grid of two nodes and one training message for each."""
    grid = InProcessGrid(client_app, node_configs(2))
    return grid, [grid.create_message(RecordDict({"config": ConfigRecord({"lr": "1e-3"})}), "train", NODE + k, "1")
                  for k in range(2)]


def answer(msg: Message) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=msg)


@pytest.mark.e2e
def test_a_late_reply_is_no_reply_and_a_silent_node_cannot_hang_the_server() -> None:
    """As Flower's grid: send_and_receive(timeout=T) returns the replies that came within T and
    leaves a late one out; a ClientApp that never returns costs the server T, not the run. The
    silent node's next message waits behind its running call: no reply either."""
    release = threading.Event()

    def client_app(msg: Message, context: Context) -> Message:
        if context.node_id == NODE + 1:
            if msg.content["config"]["lr"] == "late":
                time.sleep(LATE)
            else:
                release.wait()  # never answers (until the test ends)
        return answer(msg)

    grid, messages = two_nodes(client_app)
    try:
        # a node that answers after the timeout: its reply is left out
        late = InProcessGrid(client_app, node_configs(2))
        message = late.create_message(RecordDict({"config": ConfigRecord({"lr": "late"})}), "train", NODE + 1, "1")
        assert list(late.send_and_receive([message], timeout=TIMEOUT)) == []
        # without a timeout (Flower's default) the engine waits for it
        message = late.create_message(RecordDict({"config": ConfigRecord({"lr": "late"})}), "train", NODE + 1, "1")
        (reply,) = late.send_and_receive([message])
        assert reply.metadata.reply_to_message_id == message.metadata.message_id
        # a node that never answers: the server waits about T, not forever
        started = time.monotonic()
        replies = list(grid.send_and_receive(messages, timeout=TIMEOUT))
        assert [r.metadata.src_node_id for r in replies] == [NODE]
        assert time.monotonic() - started < TIMEOUT + 0.9
        # the silent node's call still runs: its next message waits behind it, and is not answered
        assert list(grid.send_and_receive(messages[1:], timeout=TIMEOUT)) == []
    finally:
        release.set()


def test_calls_run_on_a_reused_worker_and_a_hung_call_keeps_its_own() -> None:
    """One worker thread runs call after call (a fresh thread per call faulted its memory in
    anew); a call that never returns keeps its worker, and the next call gets another."""
    release = threading.Event()
    threads: list[tuple[int, str]] = []

    def client_app(msg: Message, context: Context) -> Message:
        threads.append((context.node_id, threading.current_thread().name))
        if msg.content["config"]["lr"] == "hang":
            release.wait()
        return answer(msg)

    grid, messages = two_nodes(client_app)
    try:
        for _ in range(3):
            assert len(list(grid.send_and_receive(messages, timeout=TIMEOUT))) == 2
        assert threads[0][1] != threading.current_thread().name
        assert {name for _, name in threads} == {threads[0][1]}  # six calls, one worker
        hung = grid.create_message(RecordDict({"config": ConfigRecord({"lr": "hang"})}), "train", NODE + 1, "1")
        assert list(grid.send_and_receive([hung], timeout=TIMEOUT)) == []
        assert len(list(grid.send_and_receive(messages[:1], timeout=TIMEOUT))) == 1
        assert threads[-2][1] == threads[0][1] and threads[-1][1] not in (threads[0][1], "")  # a new worker
    finally:
        release.set()


def forged_source(msg: Message) -> Message:
    """Node 1001's reply to its own message, claiming to come from node 1000."""
    reply = answer(msg)
    reply.metadata.__dict__["_src_node_id"] = NODE
    return reply


def other_message(msg: Message) -> Message:
    """Node 1001's reply to a message the server never sent (made up by the client)."""
    return answer(Message(RecordDict(), dst_node_id=NODE + 1, message_type="train"))


def speaks_for_node_0(msg: Message) -> Message:
    """Node 1001 answers node 1000's message as node 1000."""
    return answer(Message(RecordDict(), dst_node_id=NODE, message_type="train"))


@pytest.mark.parametrize("forge", [forged_source, other_message, speaks_for_node_0])
def test_a_reply_must_come_from_the_node_and_answer_the_message(forge) -> None:
    """As Flower's link state (store_message_res): a reply whose source is not the node the
    message went to, or that answers another message, is refused: the server sees no reply."""
    def client_app(msg: Message, context: Context) -> Message:
        return forge(msg) if context.node_id == NODE + 1 else answer(msg)

    grid, messages = two_nodes(client_app)
    (reply,) = grid.send_and_receive(messages, timeout=TIMEOUT)
    assert reply.metadata.src_node_id == NODE
    assert reply.metadata.reply_to_message_id == messages[0].metadata.message_id != ""


def test_a_client_app_that_exits_is_a_crashed_client_app() -> None:
    def client_app(msg: Message, context: Context) -> Message:
        raise SystemExit(3)

    grid, messages = two_nodes(client_app)
    replies = list(grid.send_and_receive(messages, timeout=TIMEOUT))
    assert [r.error.code for r in replies] == [CLIENT_APP_CRASHED] * 2
    assert "SystemExit" in replies[0].error.reason


def test_an_error_of_the_engine_itself_reaches_the_caller() -> None:
    """Only the ClientApp's failures become error replies: an exception of the engine (or of a
    test's grid subclass) in the worker thread is raised to the caller, not taken for a silent node."""
    class Broken(InProcessGrid):
        def _deliver(self, message: Message) -> Message:
            raise RuntimeError("engine bug")

    grid = Broken(lambda msg, context: answer(msg), node_configs(1))
    message = grid.create_message(RecordDict({"config": ConfigRecord({"lr": "1e-3"})}), "train", NODE, "1")
    with pytest.raises(RuntimeError, match="engine bug"):
        grid.send_and_receive([message], timeout=TIMEOUT)
