"""Failures and malformed updates: counted, rejected, never aggregated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedlora.app.runner import run_inprocess
from fedlora.clients.app import app as client_app
from fedlora.clients.faults import corrupt
from fedlora.config import ConfigError, load_config
from fedlora.data import build_federated_data
from fedlora.evaluation import GlobalEvaluator
from fedlora.lora import to_array_record
from fedlora.simulations.inprocess import InProcessGrid, node_configs
from fedlora.strategies.registry import create_strategy

ROOT = Path(__file__).resolve().parents[1]
KINDS = ["nan", "inf", "shape", "rank", "keys", "norm"]


def fedit_round(num_clients: int, overrides: tuple[str, ...] = ()):
    """A FedIT strategy that has queried real in-process clients, and its round-1 messages."""
    config = load_config(ROOT / "configs/smoke.toml",
                         [f"data.num_clients={num_clients}", f"clients.ranks={[4] * num_clients}", *overrides])
    evaluator = GlobalEvaluator(config.model, config.train, build_federated_data(config.data))
    strategy = create_strategy(config, evaluator.initial_adapter, evaluator.module_shapes())
    grid = InProcessGrid(client_app, node_configs(num_clients))
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    return strategy, messages


def reply(msg: Message, payload: dict, num_examples: int) -> Message:
    partition = msg.metadata.dst_node_id - 1000  # InProcessGrid: node 1000 + k holds partition k
    metrics = MetricRecord({"num-examples": num_examples, "train-loss": 1.0, "partition-id": partition})
    return Message(RecordDict({"arrays": to_array_record(payload), "metrics": metrics}), reply_to=msg)


# Why each corruption is refused: the check meant for it, not a later one that happens to catch it
# too (a NaN update also has a NaN norm, which the ratio bound refuses). ("norm", off): the ratio
# bound off, the round's median bound (faults.norm_outlier_factor, >= 3 updates) refuses it.
REASONS = {"nan": "contains NaN or Inf", "inf": "contains NaN or Inf", "shape": "has shape", "rank": "has shape",
           "keys": "missing keys [] / unexpected keys ['unexpected::A']", "norm": "faults.max_update_ratio"}
RATIO_OFF = ("faults.max_update_ratio=0",)


@pytest.mark.parametrize(("kind", "overrides"), [*((kind, ()) for kind in KINDS), ("norm", RATIO_OFF)],
                         ids=[*KINDS, "norm-ratio-off"])
def test_malformed_update_is_rejected_and_aggregate_is_of_valid_updates(kind: str, overrides: tuple[str, ...]) -> None:
    # Prepare: 4 clients; the last sends a malformed version of a plausible update
    strategy, messages = fedit_round(4, overrides)
    rng = np.random.default_rng(0)
    base = strategy.global_payload()
    updates = [{k: (v + 0.01 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in base.items()} for _ in messages]
    replies = [reply(m, u, 10 * (i + 1)) for i, (m, u) in enumerate(zip(messages, updates))]
    replies[-1] = reply(messages[-1], corrupt(updates[-1], kind), 40)
    # Execute
    strategy.aggregate_train(1, replies)
    # Assert: rejected, counted, and the aggregate is FedAvg of the three valid updates alone
    record = strategy.record(1)
    assert record.rejected == 1 and record.failures == 1 and record.clients == 3
    assert len(record.rejections) == 1
    reason = "above the bound" if overrides == RATIO_OFF else REASONS[kind]
    assert reason in record.rejections[0], record.rejections[0]
    for key in updates[0]:  # FedAvg of the three valid updates, computed here in float64
        expected = np.average(np.stack([u[key] for u in updates[:3]]).astype(np.float64), axis=0, weights=[10, 20, 30])
        np.testing.assert_allclose(strategy.global_payload()[key], expected, rtol=1e-6, atol=1e-9)


@pytest.mark.e2e
def test_too_few_valid_updates_stop_the_run_after_max_failed_rounds(tmp_path: Path) -> None:
    # Prepare: every client crashes (drop 0.99, seeded): no round has the 2 valid updates it needs
    config = load_config(ROOT / "configs/smoke.toml", [
        "clients.ranks=[4, 4, 4]", "faults.drop_rate=0.99", "federation.min_clients=2", "faults.max_failed_rounds=2",
    ])
    # Execute / Assert: round 1 fails and the run goes on; the second failed round in a row stops it
    with pytest.raises(RuntimeError, match=r"round 2: 0 valid updates < federation.min_clients=2, 2 rounds in a row"):
        run_inprocess(config, tmp_path)
    # Assert: what round 1 computed is kept: its record (3 failures, nothing aggregated or uploaded)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [(r["round"], r["clients"], r["failures"], r["bytes_up"]) for r in results["rounds"]] == [(1, 0, 3, 0)]


def nature_or_machine_csv(path: Path, rows: int = 600) -> Path:
    """A learnable two-topic task (majority class 0.5): six nature words or six machine words."""
    import csv
    import random

    rng = random.Random(0)
    words = {"nature": ["river", "mountain", "forest", "ocean", "valley", "desert", "island", "meadow"],
             "machine": ["engine", "circuit", "battery", "software", "laptop", "router", "sensor", "robot"]}
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        for i in range(rows):
            label = "nature" if i % 2 == 0 else "machine"
            writer.writerow([" ".join(rng.choices(words[label], k=6)), label])
    return path


@pytest.mark.e2e
def test_drop_rate_30_percent_still_learns_the_task(tmp_path: Path) -> None:
    # Prepare: MiniLM on a task it learns within a few rounds, the same seeds with and without crashes
    data = nature_or_machine_csv(tmp_path / "topics.csv")
    overrides = [f"data.source={data}", "model.path=minilm", "train.max_length=16", "clients.ranks=[4, 4, 4]",
                 "train.rounds=4", "federation.min_clients=1", "train.lr=3e-3"]
    clean = run_inprocess(load_config(ROOT / "configs/smoke.toml", overrides), tmp_path / "clean")
    flaky = run_inprocess(load_config(ROOT / "configs/smoke.toml", [*overrides, "faults.drop_rate=0.3"]), tmp_path / "flaky")
    # Assert: failures were counted and fewer updates were aggregated, yet the federation learned the
    # task as well as without failures (majority class: 0.5); the training loss fell in both
    assert sum(r.failures for r in flaky.rounds) > 0 and len(flaky.rounds) == 4
    assert sum(r.clients for r in flaky.rounds) < sum(r.clients for r in clean.rounds)
    assert clean.final()["global_accuracy"] >= 0.9 and flaky.final()["global_accuracy"] >= 0.9
    assert abs(flaky.final()["global_accuracy"] - clean.final()["global_accuracy"]) <= 0.05
    for writer in (clean, flaky):
        assert writer.rounds[-1].train_loss < 0.5 * writer.rounds[0].train_loss


@pytest.mark.parametrize("override", ["faults.drop_rate=1.0", "faults.drop_rate=-0.1", "faults.corrupt_rate=2", "faults.corrupt_kinds=['bogus']"])
def test_bad_fault_values_are_config_errors(override: str) -> None:
    with pytest.raises(ConfigError, match="faults"):
        load_config(ROOT / "configs/smoke.toml", [override])


class _RestartingGrid(InProcessGrid):
    """Partition 2's node dies after round 1's training and comes back as a new node with an empty
    state (a restarted SuperNode); a dead node never replies."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.restarted = False

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Context, MessageType

        messages = list(messages)
        replies = list(super().send_and_receive([m for m in messages if m.metadata.dst_node_id in self.contexts]))
        if not self.restarted and any(m.metadata.message_type == MessageType.TRAIN for m in messages):
            old = self.contexts.pop(1002)
            self.contexts[9002] = Context(run_id=old.run_id, node_id=9002, node_config=dict(old.node_config),
                                          state=RecordDict(), run_config={})
            self.restarted = True
        return replies


@pytest.mark.e2e
def test_a_restarted_client_on_a_new_node_is_addressed_there(tmp_path: Path) -> None:
    from fedlora.app.server import run_server

    # Prepare: 3 clients, 2 rounds; client 2's node restarts after round 1's training
    config = load_config(ROOT / "configs/smoke.toml", ["train.max_steps=2", "federation.fraction_evaluate=0"])
    grid = _RestartingGrid(client_app, node_configs(config.data.num_clients))

    # Execute
    writer = run_server(grid, config, tmp_path)

    # Assert: round 2 reached all 3 clients (client 2 at its new node), no failure
    assert grid.restarted
    assert [(r.clients, r.failures) for r in writer.rounds] == [(3, 0), (3, 0)]
    assert {int(p) for p in writer.rounds[1].per_client_train} == {0, 1, 2}
