"""Poisoning within the bounds: which defence catches which attack (docs/robustness.md's table).

    python benchmarks/poisoning.py            # prints the markdown rows, about a minute on 2 cores

Three fedit clients of rank 4 on configs/smoke.toml's tiny random BERT, without training (as
tests/test_poisoning.py): an honest client's upload is its download plus the round's common
direction and its own noise (x 0.01); the attackers change theirs. For each attack and each
``faults.aggregation`` rule it reports, in the attacked round: the clients the norm bounds refused
(``faults.max_update_ratio`` / ``norm_outlier_factor``, defaults), the clients the anomaly rule
flagged (defaults, ``anomaly_action = 'log'``), and how far the attack moved the aggregate: the
distance of the global adapter from the same round without the attack, over the honest round's
change of it (0: no effect, 1: as far as a whole honest round moves it). It measures detection
and the aggregate's shift, not accuracy: the cost on clean accuracy is not measured here.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this repository's fedlora, not an installed one

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedlora.app.server import GlobalEvaluator
from fedlora.config import load_config
from fedlora.data import build_federated_data
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.registry import create_strategy

SMOKE = ROOT / "configs/smoke.toml"
NODE = 1000  # InProcessGrid: node 1000 + k holds partition k
ATTACKS: dict[str, dict[int, Any]] = {  # attacked round 2; client -> what it sends
    "upload x5 (its arrays scaled)": {1: ("upload", 5.0)},
    "upload x9": {1: ("upload", 9.0)},
    "change x5 (its update scaled)": {1: ("change", 5.0)},
    "change x9": {1: ("change", 9.0)},
    "sign flip (change x -1)": {1: ("change", -1.0)},
    "replay (its round-1 upload)": {1: ("replay", 0.0)},
    "copy (client 0's upload)": {2: ("copy", 0.0)},
    "2 of 3 collude: +0.3 on every coordinate": {1: ("shift", 0.3), 2: ("shift", 0.3)},
}
RULES = ("mean", "median", "trimmed_mean")


def profile_app(msg: Message, context: Context) -> Message:
    k = int(context.node_config["partition-id"])
    profile = ClientProfile(partition_id=k, rank=4, num_train_examples=100)
    return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)


def strategy_for(rule: str) -> tuple[Any, InProcessGrid]:
    config = load_config(SMOKE, ["clients.ranks=[4, 4, 4]", f"faults.aggregation={rule}"])
    server = GlobalEvaluator(config, build_federated_data(config.data))
    strategy = create_strategy(config, server.initial_adapter, server.module_shapes())
    return strategy, InProcessGrid(profile_app, [{"partition-id": k} for k in range(3)])


def honest_change(download: dict[str, np.ndarray], k: int, server_round: int) -> dict[str, np.ndarray]:
    change = {}
    for key, value in sorted(download.items()):
        common = np.random.default_rng([server_round, len(key)]).standard_normal(value.shape)
        own = np.random.default_rng([server_round, k, len(key)]).standard_normal(value.shape)
        change[key] = 0.01 * (common + 0.5 * own)
    return change


def play(strategy: Any, grid: InProcessGrid, server_round: int, attack: dict[int, Any],
         earlier: dict[int, dict[str, np.ndarray]]) -> dict[int, dict[str, np.ndarray]]:
    messages = sorted(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid),
                      key=lambda m: m.metadata.dst_node_id)
    uploads: dict[int, dict[str, np.ndarray]] = {}
    for msg in messages:
        k = msg.metadata.dst_node_id - NODE
        download = {key: a.numpy() for key, a in msg.content.array_records["arrays"].items()}
        change = honest_change(download, k, server_round)
        kind, value = attack.get(k, ("honest", 1.0))
        scale = value if kind == "change" else 1.0
        upload = {key: download[key] + scale * change[key] for key in download}
        if kind == "upload":
            upload = {key: value * array for key, array in upload.items()}
        elif kind == "shift":
            upload = {key: array + value for key, array in upload.items()}
        elif kind == "replay":
            upload = earlier[k]
        elif kind == "copy":
            upload = uploads[0]
        uploads[k] = {key: np.asarray(array, np.float32) for key, array in upload.items()}
    replies = [Message(RecordDict({
        "arrays": ArrayRecord({key: Array(np.ascontiguousarray(v)) for key, v in uploads[m.metadata.dst_node_id - NODE].items()}),
        "metrics": MetricRecord({"num-examples": 100, "partition-id": m.metadata.dst_node_id - NODE, "train-loss": 1.0}),
    }), reply_to=m) for m in messages]
    strategy.aggregate_train(server_round, replies)
    return uploads


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a))


def clients_in(lines: list[str]) -> str:
    found = sorted({line.split(" (node")[0].removeprefix("client ") for line in lines})
    return ", ".join(found) or "none"


def main() -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)  # the rounds' log lines; the table says what they would
    print("| attack | faults.aggregation | refused by the norm bounds | flagged by the anomaly rule | aggregate moved |")
    print("|---|---|---|---|---|")
    for rule in RULES:
        honest, honest_grid = strategy_for(rule)
        play(honest, honest_grid, 1, {}, {})
        before = {k: v.copy() for k, v in honest.global_payload().items()}
        play(honest, honest_grid, 2, {}, {})
        honest_step = distance(honest.global_payload(), before)
        for name, attack in ATTACKS.items():
            strategy, grid = strategy_for(rule)
            first = play(strategy, grid, 1, {}, {})
            play(strategy, grid, 2, attack, first)
            record = strategy.record(2)
            moved = distance(strategy.global_payload(), honest.global_payload()) / honest_step
            print(f"| {name} | {rule} | {clients_in(record.rejections)} | {clients_in(record.anomalies)} | {moved:.2f} |")


if __name__ == "__main__":
    main()
