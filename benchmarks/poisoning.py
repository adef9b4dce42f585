"""Poisoning within the bounds: which defence catches which attack, and what it costs (docs/robustness.md).

    python benchmarks/poisoning.py                        # the attack table, about a minute on 2 cores
    python benchmarks/poisoning.py --clean --seeds 0,1,2  # the cost on clean accuracy (real training)

**Attacks** (no training, as tests/test_poisoning.py): seven fedit clients of rank 4 on
configs/smoke.toml's tiny random BERT; an honest client's upload is its download plus the round's
common direction and its own noise (x 0.01); the attackers change theirs in round 2. For each
attack it reports the clients the norm bounds refused (``faults.max_update_ratio`` /
``norm_outlier_factor``, defaults), the clients the anomaly rule flagged (defaults,
``anomaly_action = 'log'``; both look at the uploads, so they are the same under every rule), and
for each ``faults.aggregation`` rule how far the attack moved the aggregate: the distance of the
global adapter from the same round without the attack under the same rule, over the honest
round's change of it (0: no effect, 1: as far as a whole honest round moves it). Krum, MultiKrum
and Bulyan run with ``faults.num_malicious = 1`` (Bulyan needs 4f + 3 = 7 clients).

**Clean accuracy** (``--clean``): real fedit runs without any attacker on configs/quick.toml
(MiniLM, WordNet nouns) with seven clients, one per rule and seed, fresh partitions per seed, in
process; the comparison folder (``--out``, default runs/poisoning-clean) gets fedlora's summary and
the paired differences of every rule minus 'mean' (global and personalised accuracy), and
``--resume`` continues it.
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

from fedlora.config import load_config
from fedlora.data import build_federated_data
from fedlora.evaluation import GlobalEvaluator
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.registry import create_strategy
from fedlora.version import __version__

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
    "2 of 7 collude: +0.3 on every coordinate": {1: ("shift", 0.3), 2: ("shift", 0.3)},
    "3 of 7 collude: +0.3 on every coordinate": {1: ("shift", 0.3), 2: ("shift", 0.3), 3: ("shift", 0.3)},
}
RULES = ("mean", "median", "trimmed_mean", "krum", "multikrum", "bulyan")
CLIENTS = 7
QUICK = ROOT / "configs/quick.toml"
CLEAN = (f"data.num_clients={CLIENTS}", "train.rounds=6")


def profile_app(msg: Message, context: Context) -> Message:
    k = int(context.node_config["partition-id"])
    profile = ClientProfile(partition_id=k, rank=4, num_train_examples=100, fedlora_version=__version__)
    return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)


def strategy_for(rule: str) -> tuple[Any, InProcessGrid]:
    config = load_config(SMOKE, [f"data.num_clients={CLIENTS}", f"clients.ranks=[{', '.join(['4'] * CLIENTS)}]",
                                 f"faults.aggregation={rule}"])
    server = GlobalEvaluator(config, build_federated_data(config.data))
    strategy = create_strategy(config, server.initial_adapter, server.module_shapes())
    return strategy, InProcessGrid(profile_app, [{"partition-id": k} for k in range(CLIENTS)])


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


def attack_table() -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)  # the rounds' log lines; the table says what they would
    moved: dict[str, dict[str, float]] = {name: {} for name in ATTACKS}
    caught: dict[str, tuple[str, str]] = {}
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
            moved[name][rule] = distance(strategy.global_payload(), honest.global_payload()) / honest_step
            if rule == "mean":
                caught[name] = (clients_in(record.rejections), clients_in(record.anomalies))
    print(f"| attack | refused by the norm bounds | flagged by the anomaly rule | aggregate moved: {' | '.join(RULES)} |")
    print("|---|---|---|" + "---|" * len(RULES))
    for name in ATTACKS:
        print(f"| {name} | {caught[name][0]} | {caught[name][1]} | "
              + " | ".join(f"{moved[name][rule]:.2f}" for rule in RULES) + " |")


def clean_accuracy(out: Path, seeds: list[int], workers: int, resume: bool) -> None:
    """Every rule without an attacker, real training: fedlora's comparison table and paired differences."""
    from fedlora.app.jobs import Job, claim_output, resolve_base, run_jobs
    from fedlora.app.summary import summarize

    base = resolve_base(str(QUICK), CLEAN)
    jobs = [Job("fedit", seed, (f"faults.aggregation={rule}",), label=rule, fresh_partition=True)
            for rule in RULES for seed in seeds]
    folder = claim_output(out, "comparison", resume, overwrite=False)
    run_jobs(base, jobs, out, engine="inprocess", workers=workers, folder=folder)
    table = summarize(out, labels=list(RULES), seeds=seeds)
    paired = table.paired("mean")
    paired.write(out)
    with (out / "summary.md").open("a") as summary:
        summary.write("\n" + paired.to_markdown())
    print(table.to_text())
    print(paired.to_markdown())
    print(f"results: {out}/ (summary.md, paired.csv)")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="the cost on clean accuracy (real training runs)")
    parser.add_argument("--seeds", default="0,1,2", help="--clean: comma-separated train seeds (fresh partitions)")
    parser.add_argument("--workers", type=int, default=2, help="--clean: runs at a time")
    parser.add_argument("--out", default=str(ROOT / "runs/poisoning-clean"), help="--clean: comparison folder")
    parser.add_argument("--resume", action="store_true", help="--clean: continue the comparison in --out")
    args = parser.parse_args()
    if args.clean:
        clean_accuracy(Path(args.out), [int(s) for s in args.seeds.split(",")], args.workers, args.resume)
    else:
        attack_table()


if __name__ == "__main__":
    main()
