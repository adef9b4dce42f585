"""The in-process engine carries messages as Flower's wire does (fedlora/simulations/inprocess.py).

Each message and each reply is deflated into Flower's object tree and inflated on the other side,
so the two sides share no object and what Flower cannot serialise fails in process too, as it
would in a deployment: the ServerApp's push raises, a ClientApp's reply becomes an error reply.
"""

from __future__ import annotations

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
