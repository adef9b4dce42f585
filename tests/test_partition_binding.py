"""Partitions bound to identity (strategies/roster.py): a node holds the partition its identity is
bound to (a deployment's operator binds each silo's authenticated key; the in-process engine its
node configs), not the first claim; a node claiming another's partition is refused and logged, and
the honest node trains. Also: the checks a deployment's run makes of every silo before its first
round (versions, a client that cannot take part in secure aggregation) refuse the run in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedlora import protocol
from fedlora.app.run_config import node_binding
from fedlora.app.server import run_server
from fedlora.clients import app as fedlora_client
from fedlora.config import ConfigError, load_config
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.roster import ClientRoster, PreflightError, profile_problem
from fedlora.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
# one round of the smoke experiment, no client evaluation: enough for every client to train once
ONE_ROUND = ["train.rounds=1", "train.max_steps=1", "federation.fraction_evaluate=0", "output.save_adapters=false"]
CLAIM = "claim"  # node config key of the liar below: the partition its profile claims


liar = ClientApp()


@liar.query()
def query(msg: Message, context: Context) -> Message:
    """fedlora's own query reply, except on a node with ``claim = k``: its profile says partition k."""
    reply = fedlora_client.query(msg, context)
    if CLAIM not in context.node_config:
        return reply
    profile = json.loads(reply.content.config_records[protocol.PROFILE_RECORD][protocol.PROFILE_JSON])
    profile["partition_id"] = int(context.node_config[CLAIM])
    return Message(RecordDict({protocol.PROFILE_RECORD: ConfigRecord({protocol.PROFILE_JSON: json.dumps(profile)})}),
                   reply_to=msg)


liar.train()(fedlora_client.train)
liar.evaluate()(fedlora_client.evaluate)


@pytest.mark.e2e
@pytest.mark.parametrize("binding", ["operator", "engine"])
def test_a_node_claiming_another_nodes_partition_is_refused_and_the_honest_node_trains(
        tmp_path: Path, binding: str) -> None:
    # Prepare: node 1000 answers first and claims partition 0; its identity holds partition 1 (the
    # operator's binding of its key, or the node config the engine wrote); node 1001 holds partition 0
    config = load_config(SMOKE, ONE_ROUND)
    grid = InProcessGrid(liar, [{"partition-id": 1, CLAIM: 0}, {"partition-id": 0}, {"partition-id": 2}])
    nodes = ({1000: 1, 1001: 0, 1002: 2}, {1000: "mallory", 1001: "alice", 1002: "bob"}) if binding == "operator" else None

    # Execute
    writer = run_server(grid, config, tmp_path, nodes=nodes)

    # Assert: the liar is refused (logged in results.json), the honest node holds partition 0 and trained
    refused = writer.strategy_info["refused"]
    assert refused == ["claims partition 0, but its identity is bound to partition 1"], refused
    record = writer.rounds[-1]
    assert record.clients == 2 and sorted(record.per_client_train) == ["0", "2"]
    assert sorted(writer.strategy_info["clients"]) == ["0", "2"]


def roster_with(profiles: dict[int, ClientProfile], bound: dict[int, int] | None = None, strict: bool = False,
                secure: bool = False) -> ClientRoster:
    """A roster that asked ``profiles`` (node id -> the profile it answered) through an in-process grid."""
    def app(msg: Message, context: Context) -> Message:
        profile = profiles[context.node_id]
        return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)

    grid = InProcessGrid(app, [{} for _ in profiles])
    roster = ClientRoster()
    if bound is not None:
        roster.bind(bound, {node: f"silo{node - 1000}" for node in bound}, strict=strict)
    roster.query(grid, "{}", len(profiles), 30.0,
                 lambda p: profile_problem(p, {"m": (8, 8)}, len(profiles), secure=secure), connect_timeout=5.0)
    return roster


def profile(partition: int, **fields: object) -> ClientProfile:
    values: dict[str, object] = {"partition_id": partition, "rank": 4, "num_train_examples": 10,
                                 "fedlora_version": __version__, "capabilities": ["secure-aggregation"]}
    return ClientProfile.model_validate(values | fields)


def test_without_a_binding_the_first_claim_holds_and_a_second_claim_is_refused() -> None:
    # Flower's own simulation engine: the node configs are the engine's, no binding to check against
    roster = roster_with({1000: profile(0), 1001: profile(0), 1002: profile(1)})
    assert roster.node_of == {0: 1000, 1: 1002}
    assert roster.refused == {"node 1001": "claims partition 0, already held by node 1000"}


def test_a_node_with_no_bound_partition_is_refused() -> None:
    roster = roster_with({1000: profile(0), 1001: profile(1), 1002: profile(2)}, bound={1000: 0, 1001: 1})
    assert roster.partitions == [0, 1]
    assert "no partition is bound to its identity" in roster.refused["node 1002"]


@pytest.mark.parametrize(
    ("bad", "line"),
    [
        ({"fedlora_version": "0.0.9"}, (f"silo silo1 (node 1001), partition 1: it runs fedlora 0.0.9, this server "
                                        f"runs fedlora {__version__}: install the same fedlora on every node")),
        ({"flower_version": "1.38.0"}, ("silo silo1 (node 1001), partition 1: it runs Flower 1.38.0, this server runs "
                                       "Flower 1.39")),
        ({"capabilities": []}, ("silo silo1 (node 1001), partition 1: its client cannot take part in secure "
                               "aggregation")),
    ],
    ids=["fedlora-version", "flower-version", "secure-aggregation"],
)
def test_a_deployment_refuses_the_run_when_a_silo_cannot_take_part(bad: dict, line: str) -> None:
    # Prepare / Execute: silo 1 answers with another version, or a client without secure aggregation
    with pytest.raises(PreflightError) as refused:
        roster_with({1000: profile(0), 1001: profile(1, **bad), 1002: profile(2)}, bound={1000: 0, 1001: 1, 1002: 2},
                    strict=True, secure=True)
    # Assert: one line, naming the silo and the fix
    assert line in str(refused.value) and "\n" not in str(refused.value)


def test_without_strict_a_silo_that_cannot_take_part_is_refused_alone() -> None:
    roster = roster_with({1000: profile(0), 1001: profile(1, capabilities=[]), 1002: profile(2)}, secure=True)
    assert roster.partitions == [0, 2] and "secure aggregation" in roster.refused["partition 1"]


def test_the_run_config_binding_is_read_or_refused_in_one_line() -> None:
    assert node_binding({"nodes": '{"17": {"partition": 1, "silo": "beta"}}'}) == ({17: 1}, {17: "beta"})
    assert node_binding({}) == ({}, {})
    with pytest.raises(ConfigError, match="must be JSON"):
        node_binding({"nodes": '{"17": 3}'})
