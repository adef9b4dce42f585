"""Poisoning: which defence stops which attack, and what it costs (docs/robustness.md).

    python benchmarks/poisoning.py                        # the standard attacks' table (real training)
    python benchmarks/poisoning.py --synthetic            # the synthetic table: no training, about a minute
    python benchmarks/poisoning.py --clean --seeds 0,1,2  # the cost on clean accuracy (real training, 6 rounds)

**The standard attacks** (the default): ALIE, IPM (epsilon 0.1 and 100), min-max and min-sum,
Fang's Krum and trimmed-mean attacks, sign flip, label flip and Gaussian noise, each by 1 and by 3
of 7 attackers, against the mean, the median, the trimmed mean, Krum, MultiKrum, Bulyan and the
anomaly rule (``faults.anomaly_action = 'reject'``), at 3 seeds, with real fedit training of the
honest clients (:data:`ATTACK_CONFIG`: configs/quick.toml's MiniLM, 7 clients, 3 rounds). Every
finished run is one record under benchmarks/results/poisoning/<rule>/ (committed); the command runs
only the runs without one (``--workers`` at a time), then prints the tables and writes them into
docs/robustness.md between its markers. 147 runs a seed, about 12 s of CPU each (the recorded
``cpu_seconds``' median) but, on the shared 2-core machine they were recorded on, 70 to 100 s of wall
time each: a seed took about two hours with 2 workers (``--table`` only rebuilds the tables from the
records).

**Synthetic** (``--synthetic``, no training, as tests/test_poisoning.py): seven fedit clients of
rank 4 on configs/smoke.toml's tiny random BERT; an honest client's upload is its download plus the
round's common direction and its own noise (x 0.01); the attackers change theirs in round 2. For
each attack it reports the clients the norm bounds refused, the clients the anomaly rule flagged,
and for each ``faults.aggregation`` rule how far the attack moved the aggregate (the distance of the
global adapter from the same round without the attack under the same rule, over the honest round's
change of it).

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
from collections.abc import Sequence
from dataclasses import dataclass, field
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
    server = GlobalEvaluator(config.model, config.train, build_federated_data(config.data))
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


# ------------------------------------------------------------------------------------------------
# The standard attacks, real training (the default command)
# ------------------------------------------------------------------------------------------------
#
# Seven fedit clients of rank 8 on configs/quick.toml's MiniLM task (query and value, WordNet
# nouns, Dirichlet(0.5) label skew), three rounds of five local steps, every client every round;
# the server evaluates its global adapter on 300 held-out glosses after round 3. One attacked run is
# one (rule, attack, attacker count, seed): the attackers are the last partitions (6; 4, 5 and 6),
# they attack every round, and every honest client trains for real. An omniscient attacker (the
# literature's strongest) sees the honest uploads of the round before it crafts its own: the grid
# below hands the honest replies to the attack and replaces the attackers' replies with its result.

HONEST = "none"
ATTACK_NAMES = ("alie", "ipm-0.1", "ipm-100", "min-max", "min-sum", "fang-krum", "fang-trimmed-mean",
                "sign-flip", "label-flip", "gaussian")
TRAINING_ATTACKS = ("sign-flip", "label-flip")  # the attackers train (on their own, or on flipped labels) first
DEFENCES: dict[str, tuple[str, ...]] = {  # rule -> its faults overrides (the anomaly rule logs everywhere else)
    "mean": ("faults.aggregation=mean",),
    "median": ("faults.aggregation=median",),
    "trimmed_mean": ("faults.aggregation=trimmed_mean",),  # trim_fraction 0.2: one value cut at each end of 7
    "krum": ("faults.aggregation=krum", "faults.num_malicious=2"),  # f = 2: the most Krum takes with 7 (2f + 3)
    "multikrum": ("faults.aggregation=multikrum", "faults.num_malicious=2"),  # keeps n - f = 5
    "bulyan": ("faults.aggregation=bulyan", "faults.num_malicious=1"),  # f = 1: the most Bulyan takes with 7 (4f + 3)
    "anomaly": ("faults.aggregation=mean", "faults.anomaly_action=reject"),  # the anomaly rule refuses what it flags
}
ATTACK_CLIENTS = 7
FRACTIONS = (1, 3)  # attackers of 7: one client, and just under half
ATTACK_ROUNDS = 3
ATTACK_CONFIG = (f"data.num_clients={ATTACK_CLIENTS}", f"train.rounds={ATTACK_ROUNDS}", "train.lr=0.015",
                 "train.max_length=24", "data.global_test_size=300", "federation.fraction_evaluate=0",
                 f"federation.evaluate_every={ATTACK_ROUNDS}", "output.save_adapters=false", "output.tensorboard=false")
RESULTS = ROOT / "benchmarks/results/poisoning"  # one record per finished run (committed)
EFFECTS = ROOT / "runs/poisoning-attacks"  # the honest runs' final adapters (to measure movement; not committed)
EVASION = 0.01  # colluders add noise of this fraction of their change's norm, so no two uploads are duplicates


def attackers_of(count: int) -> list[int]:
    return list(range(ATTACK_CLIENTS - count, ATTACK_CLIENTS))


def flat(payload: dict[str, np.ndarray], keys: list[str]) -> np.ndarray:
    return np.concatenate([np.asarray(payload[k], np.float64).ravel() for k in keys])


def unflat(vector: np.ndarray, like: dict[str, np.ndarray], keys: list[str]) -> dict[str, np.ndarray]:
    out, start = {}, 0
    for key in keys:
        size = like[key].size
        out[key] = vector[start:start + size].reshape(like[key].shape)
        start += size
    return out


def largest(condition: Any, low: float = 0.0, high: float = 1.0, steps: int = 40) -> float:
    """The largest gamma in [low, inf) with ``condition(gamma)`` (true at ``low``), by doubling
    ``high`` until it fails and then bisecting: the binary search of min-max and min-sum."""
    for _ in range(40):
        if not condition(high):
            break
        low, high = high, 2 * high
    else:
        return high
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if condition(middle) else (low, middle)
    return low


def krum_picks_attacker(honest: np.ndarray, malicious: np.ndarray, f: int) -> bool:
    """Whether Krum (fedlora's own selection, Flower's score) over the honest and malicious
    changes keeps a malicious one."""
    from fedlora.strategies.robust import select_uploads

    payloads = [{"x": row} for row in np.vstack([honest, malicious])]
    return select_uploads(payloads, "krum", f)[0] >= len(honest)


def craft(attack: str, honest: np.ndarray, own: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The attackers' changes (m, d) from the honest clients' changes ``honest`` (h, d) of the
    round (what an omniscient attacker sees) and the attackers' own trained changes ``own`` (m, d:
    their honest training, or training on flipped labels; zeros where the attack does not train).

    - ``alie`` (Baruch et al., NeurIPS 2019, "A little is enough"): mean - z std per coordinate,
      z = Phi^-1((n - s) / n), s = floor(n / 2 + 1) - m;
    - ``ipm-<eps>`` (Xie et al., UAI 2020, inner product manipulation): -eps x the honest mean;
    - ``min-max`` / ``min-sum`` (Shejwalkar and Houmansadr, NDSS 2021, AGR-agnostic): mean - gamma
      std, gamma the largest (binary search) whose distance to every honest change is at most the
      largest distance between two honest ones (min-max), or whose sum of squared distances to them
      is at most the largest such sum of an honest one (min-sum);
    - ``fang-krum`` (Fang et al., USENIX Security 2020, full knowledge): -lambda sign(honest mean),
      lambda halved from a large value until Krum (f = the attackers, at most 2) keeps it;
    - ``fang-trimmed-mean`` (ibid.): per coordinate, against the direction the honest mean moves,
      a value drawn beyond the honest extreme (between it and twice it, b = 2);
    - ``sign-flip``: minus its own trained change; ``label-flip``: its change trained on labels
      y -> y + 1 (mod 8) (the data are flipped, the upload is sent as it is);
    - ``gaussian``: N(0, sigma^2) per coordinate, sigma such that its norm is the honest median norm.

    Colluders sending one vector each add noise of :data:`EVASION` x its norm (no duplicates)."""
    m, (h, d) = len(own), honest.shape
    mean, std = honest.mean(axis=0), honest.std(axis=0)
    n = h + m
    if attack == "alie":
        from scipy.stats import norm

        s = math.floor(n / 2 + 1) - m
        one = mean - norm.ppf((n - s) / n) * std
    elif attack.startswith("ipm-"):
        one = -float(attack.removeprefix("ipm-")) * mean
    elif attack in ("min-max", "min-sum"):
        gaps = np.linalg.norm(honest[:, None, :] - honest[None, :, :], axis=2)  # (h, h)
        if attack == "min-max":
            def fits(gamma: float) -> bool:
                return bool(np.linalg.norm(honest - (mean - gamma * std), axis=1).max() <= gaps.max())
        else:
            def fits(gamma: float) -> bool:
                return bool(np.sum(np.linalg.norm(honest - (mean - gamma * std), axis=1) ** 2) <= (gaps ** 2).sum(axis=1).max())
        one = mean - largest(fits) * std
    elif attack == "fang-krum":
        direction = np.sign(mean)
        f = min(m, (n - 3) // 2)
        lam = 10 * float(np.abs(honest).max())
        while lam > 1e-7 and not krum_picks_attacker(honest, np.tile(-lam * direction, (m, 1)), f):
            lam /= 2
        one = -lam * direction
    elif attack == "fang-trimmed-mean":
        up = mean > 0  # the honest mean moves this coordinate up: push it down (and the other way)
        top, bottom = honest.max(axis=0), honest.min(axis=0)
        u = rng.uniform(1.0, 2.0, size=(m, d))
        low_side = np.where(bottom > 0, bottom / u, bottom * u)  # below the smallest honest value
        high_side = np.where(top > 0, top * u, top / u)  # above the largest
        return np.where(up, low_side, high_side)
    elif attack == "sign-flip":
        return -own
    elif attack == "label-flip":
        return own
    elif attack == "gaussian":
        sigma = float(np.median(np.linalg.norm(honest, axis=1))) / math.sqrt(d)
        return rng.standard_normal((m, d)) * sigma
    else:
        raise ValueError(f"unknown attack {attack!r}")
    noise = rng.standard_normal((m, d))
    noise *= EVASION * float(np.linalg.norm(one)) / np.linalg.norm(noise, axis=1, keepdims=True)
    return one[None, :] + noise if m > 1 else one[None, :]


class AttackGrid(InProcessGrid):
    """The in-process grid of a run with attackers: honest nodes run fedlora's ClientApp; an
    attacker's training reply is replaced by :func:`craft`'s upload (its download plus the crafted
    change, with the example count of its whole partition), once the honest replies of the round
    are in. Round 1's download (the initial adapter) is kept in ``initial``."""

    def __init__(self, node_configs: list[dict[str, Any]], attack: str, attackers: list[int], seed: int,
                 examples: dict[int, int]) -> None:
        from fedlora.clients.app import app as client_app

        super().__init__(client_app, node_configs)
        self.attack, self.attackers, self.examples = attack, attackers, examples
        self.rng = np.random.default_rng([seed, 63])
        self.initial: dict[str, np.ndarray] | None = None

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if not messages or messages[0].metadata.message_type != "train":
            return list(super().send_and_receive(messages, timeout=timeout))
        if self.initial is None:
            self.initial = arrays_of(messages[0])
        if self.attack == HONEST:
            return list(super().send_and_receive(messages, timeout=timeout))
        sent = {m.metadata.dst_node_id - NODE: m for m in messages}
        attacking = sorted(k for k in sent if k in self.attackers)
        train = [m for k, m in sent.items() if k not in attacking or self.attack in TRAINING_ATTACKS]
        for k in attacking:
            if self.attack == "label-flip":
                flip_labels(sent[k])
        replies = {r.metadata.src_node_id - NODE: r for r in super().send_and_receive(train, timeout=timeout)
                   if not r.has_error()}
        keys = sorted(arrays_of(messages[0]))
        change = {k: flat(arrays_of(r), keys) - flat(arrays_of(sent[k]), keys) for k, r in replies.items()}
        honest = sorted(k for k in replies if k not in attacking)
        size = len(flat(arrays_of(messages[0]), keys))
        own = np.vstack([change.get(k, np.zeros(size)) for k in attacking])
        crafted = craft(self.attack, np.vstack([change[k] for k in honest]), own, self.rng)
        loss = float(np.median([float(replies[k].content.metric_records["metrics"]["train-loss"]) for k in honest]))
        out = [replies[k] for k in honest]
        for k, row in zip(attacking, crafted):
            download = arrays_of(sent[k])
            upload = unflat(flat(download, keys) + row, download, keys)
            out.append(Message(RecordDict({
                "arrays": ArrayRecord({key: Array(np.ascontiguousarray(v, dtype=np.float32)) for key, v in upload.items()}),
                "metrics": MetricRecord({"num-examples": self.examples[k], "partition-id": k, "train-loss": loss}),
            }), reply_to=sent[k]))
        return out


def arrays_of(message: Message) -> dict[str, np.ndarray]:
    return {key: a.numpy() for key, a in message.content.array_records["arrays"].items()}


def flip_labels(message: Message) -> None:
    """The attacker trains on its partition with its labels moved to the next class (its
    experiment's data.label_noise = 'pairflip' at rate 0.99, the largest the schema takes)."""
    import json

    config = message.content.config_records["config"]
    experiment = json.loads(str(config["experiment"]))
    experiment["data"].update(label_noise="pairflip", noise_rate=0.99)
    config["experiment"] = json.dumps(experiment)


@dataclass(frozen=True)
class AttackRun:
    """One run of the attack table: a rule, an attack (or none), how many attackers, a seed."""

    rule: str
    attack: str
    count: int
    seed: int

    @property
    def name(self) -> str:
        if not self.count:
            return f"{self.rule}/honest-seed{self.seed}"
        return f"{self.rule}/{self.attack}-{self.count}of{ATTACK_CLIENTS}-seed{self.seed}"

    def record_path(self, results: Path) -> Path:
        return results / f"{self.name}.json"

    def overrides(self) -> tuple[str, ...]:
        return (*ATTACK_CONFIG, *DEFENCES[self.rule], f"data.seed={self.seed}", f"train.seed={self.seed}")


def attack_runs(rules: Sequence[str], attacks: Sequence[str], counts: Sequence[int], seeds: Sequence[int]) -> list[AttackRun]:
    """Every run of the table, seed by seed (a whole seed's table is there before the next one
    starts): the honest run of each rule first (the movement of an attacked run is measured from
    it), then the attacked ones."""
    return [run for seed in seeds for run in (
        [AttackRun(rule, HONEST, 0, seed) for rule in rules]
        + [AttackRun(rule, attack, count, seed) for count in counts for attack in attacks for rule in rules])]


def adapter_effect(payload: dict[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """What an adapter does to the model: s B A per module (d_out, d_in) and the head's arrays."""
    from fedlora.lora import split_payload

    factors, head = split_payload(payload)
    return {**{m: scale * (f.B.astype(np.float64) @ f.A.astype(np.float64)) for m, f in factors.items()},
            **{k: v.astype(np.float64) for k, v in head.items()}}


def effect_distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a))


def play_attack(run: AttackRun, results: Path, effects: Path) -> dict[str, Any]:
    """Run ``run`` (fedlora's own server, in process, in a scratch folder), write its record and
    return it; the honest run also keeps its final adapter's effect (``effects``)."""
    import json
    import shutil
    import time

    from fedlora.app.server import run_server
    from fedlora.checkpoint import load_server
    from fedlora.simulations.inprocess import node_configs

    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fedlora").setLevel(logging.WARNING)
    config = load_config(QUICK, list(run.overrides()))
    federated = build_federated_data(config.data)
    examples = {k: len(federated.client(k).train) for k in range(ATTACK_CLIENTS)}
    attackers = attackers_of(run.count)
    grid = AttackGrid(node_configs(ATTACK_CLIENTS), run.attack, attackers, run.seed, examples)
    scratch = effects / "scratch" / run.name.replace("/", "-")
    shutil.rmtree(scratch, ignore_errors=True)
    started, cpu = time.perf_counter(), time.process_time()
    error = ""
    try:
        run_server(grid, config, scratch, client_checkpoints=False)
    except Exception as failure:  # noqa: BLE001 - a run the defences stopped is a result, recorded
        error = f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
    results_file = scratch / "results.json"
    rounds = json.loads(results_file.read_text())["rounds"] if results_file.is_file() else []
    final = load_server(scratch, config)["strategy"]["global_adapter"] if (scratch / "checkpoint").is_dir() else grid.initial
    scale = config.model.lora_alpha / config.model.lora_rank
    effect = adapter_effect(final or {}, scale)
    movement = None
    honest_file = effects / f"{run.rule}-seed{run.seed}.npz"
    if run.attack == HONEST:
        np.savez(honest_file, **effect)
        movement = 0.0
    elif honest_file.is_file() and grid.initial is not None:
        honest = dict(np.load(honest_file))
        start = adapter_effect(grid.initial, scale)
        movement = effect_distance(effect, honest) / effect_distance(honest, start)
    record = {
        "benchmark": "poisoning attacks", "rule": run.rule, "attack": run.attack, "attackers": attackers,
        "seed": run.seed, "config": "configs/quick.toml", "overrides": list(run.overrides()),
        "final_accuracy": next((r.get("global_accuracy") for r in reversed(rounds)
                                if r.get("global_accuracy") is not None and not _nan(r.get("global_accuracy"))), None),
        "movement": movement, "error": error,
        "rounds": [compact_round(r) for r in rounds],
        "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
        "fedlora_version": __version__,
    }
    path = run.record_path(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)
    shutil.rmtree(scratch, ignore_errors=True)
    return record


def _nan(value: Any) -> bool:
    return isinstance(value, float) and math.isnan(value)


def compact_round(record: dict[str, Any]) -> dict[str, Any]:
    """What the table needs of a round: its refusals and flags by client, each client's measures."""
    def by_client(lines: list[str]) -> dict[str, str]:
        out = {}
        for line in lines:
            head, _, reason = line.partition(": ")
            out[head.split(" (node")[0].removeprefix("client ")] = reason[:160]
        return out

    clients = {}
    for partition, entry in (record.get("per_client_train") or {}).items():
        clients[partition] = {key: entry.get(key) for key in ("update_norm", "update_cosine", "byzantine_kept")
                              if key in entry}
    return {"round": record.get("round"), "clients_aggregated": record.get("clients"),
            "rejected": by_client(record.get("rejections") or []), "flagged": by_client(record.get("anomalies") or []),
            "measures": clients}


# configs/scenarios/ have the fidelity records; the cheapest runs first
SHIPPED = tuple(ROOT / "configs" / f"{name}.toml" for name in (
    "smoke", "cross-silo", "llm_smoke", "quick", "feddr_lora", "baselines", "fedpissa", "fedhera", "fedtreelora", "demo",
    "quickstart", "llm"))
HONEST_RESULTS = ROOT / "benchmarks/results/poisoning-honest"  # one record per shipped config and seed (committed)
SCENARIO_RECORDS = ROOT / "docs/results/records"  # the fidelity benchmark's honest runs of configs/scenarios/


def honest_config_run(path: Path, seed: int, results: Path, scratch: Path) -> dict[str, Any]:
    """A shipped config's own run (its strategy, seed ``seed``: data.seed and train.seed offset by
    it), in process, without any attacker: the anomaly rule's measures of every honest upload."""
    import json
    import shutil
    import time

    from fedlora.app.runner import run_inprocess

    logging.getLogger("flwr").setLevel(logging.ERROR)
    logging.getLogger("fedlora").setLevel(logging.WARNING)
    base = load_config(path)
    overrides = [f"data.seed={base.data.seed + seed}", f"train.seed={base.train.seed + seed}",
                 "output.save_adapters=false", "output.tensorboard=false"]
    config = load_config(path, overrides)
    out = scratch / f"{path.stem}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    started, cpu = time.perf_counter(), time.process_time()
    run_inprocess(config, out)
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    record = {"benchmark": "poisoning honest configs", "config": str(path.relative_to(ROOT)), "seed": seed,
              "strategy": config.strategy.name, "overrides": overrides, "rounds": [compact_round(r) for r in rounds],
              "seconds": round(time.perf_counter() - started, 1), "cpu_seconds": round(time.process_time() - cpu, 1),
              "fedlora_version": __version__}
    target = results / f"{path.stem}-seed{seed}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    return record


def run_honest_configs(paths: Sequence[Path], seeds: Sequence[int], results: Path, scratch: Path) -> None:
    """Every shipped config's honest run without a record, one at a time."""
    for path in paths:
        for seed in seeds:
            if (results / f"{path.stem}-seed{seed}.json").is_file():
                continue
            try:
                record = honest_config_run(path, seed, results, scratch)
            except Exception as failure:  # noqa: BLE001 - one config that cannot run here leaves the others
                print(f"{path.name} seed {seed}: no record ({failure!r})", flush=True)
                continue
            print(f"{path.name} seed {seed}: {len(record['rounds'])} rounds, {record['seconds']} s", flush=True)


def flags_under(measures: dict[str, dict[str, Any]], recorded: dict[str, str], faults: Any) -> set[str]:
    """The clients of one round the anomaly rule ``faults`` flags, from the round's recorded
    measures (``update_norm``, ``update_cosine`` by client: the server's own :func:`verdict`); a
    recorded duplicate stays flagged (its thresholds are not in question)."""
    from fedlora.strategies.anomaly import lower_median, verdict

    measured = {k: m for k, m in measures.items() if m.get("update_norm") is not None}
    middle = lower_median([m["update_norm"] for m in measured.values()])
    flagged = {k for k, m in measured.items() if verdict(
        m["update_norm"], middle, math.nan if m.get("update_cosine") is None else m["update_cosine"],
        len(measured), faults)}
    return flagged | {k for k, reason in recorded.items() if "identical to" in reason}


def honest_rounds() -> dict[str, list[dict[str, Any]]]:
    """The honest runs' rounds, by where they come from: the attack table's runs without attackers,
    the shipped configs' own runs, the fidelity benchmark's runs of the scenarios."""
    import json

    table = [r for record in load_records(RESULTS) if record["attack"] == HONEST for r in record["rounds"]]
    configs = [r for path in sorted(HONEST_RESULTS.glob("*.json")) for r in json.loads(path.read_text())["rounds"]]
    scenarios = []
    for path in sorted(SCENARIO_RECORDS.glob("**/results.json")):
        for r in json.loads(path.read_text())["rounds"]:
            scenarios.append({"measures": {k: {"update_norm": e.get("update_norm"), "update_cosine": e.get("update_cosine")}
                                           for k, e in (r.get("per_client_train") or {}).items()},
                              "flagged": {k: e.get("update_anomaly", "") for k, e in (r.get("per_client_train") or {}).items()
                                          if e.get("update_anomaly")}})
    return {"the attack table's runs": table, "configs/*.toml": configs, "configs/scenarios/ (fidelity records)": scenarios}


RULE_CANDIDATES = ((3.0, 0.0), (2.5, -0.15), (2.5, -0.1), (2.5, 0.0), (2.0, -0.15), (3.0, -0.15))


def rule_table(candidates: Sequence[tuple[float, float]], attacks: Sequence[str], counts: Sequence[int]) -> str:
    """For each anomaly rule (norm factor, min cosine), a column: the honest uploads it flags (false
    flags) in every honest run on record, and under each attack the attackers' uploads it flags of
    theirs and the honest uploads it flags beside them (the runs where the rule logs: every rule
    but 'anomaly')."""
    from fedlora.schema import FaultsConfig

    rules = [FaultsConfig(anomaly_norm_factor=factor, anomaly_min_cosine=cosine) for factor, cosine in candidates]
    lines = ["| honest runs: honest uploads flagged; attacks: attackers' uploads flagged, honest flagged | "
             + " | ".join(f"{factor:g} x, cosine {cosine:g}" for factor, cosine in candidates) + " |",
             "|---|" + "---|" * len(candidates)]
    for name, rounds in honest_rounds().items():
        uploads = sum(len(r["measures"]) for r in rounds)
        lines.append(f"| no attacker, {name}: {uploads} uploads | " + " | ".join(
            str(sum(len(flags_under(r["measures"], r["flagged"], faults)) for r in rounds)) for faults in rules) + " |")
    attacked = [r for r in load_records(RESULTS) if r["attack"] != HONEST and r["rule"] != "anomaly"]
    for attack in attacks:
        for count in counts:
            bad = [(set(map(str, run["attackers"])), r) for run in attacked
                   if run["attack"] == attack and len(run["attackers"]) == count for r in run["rounds"]]
            if not bad:
                continue
            total = sum(len(attackers & set(r["measures"])) for attackers, r in bad)
            cells = []
            for faults in rules:
                flags = [(attackers, flags_under(r["measures"], r["flagged"], faults)) for attackers, r in bad]
                cells.append(f"{sum(len(a & f) for a, f in flags)}/{total}, {sum(len(f - a) for a, f in flags)}")
            lines.append(f"| {attack}, {count} of {ATTACK_CLIENTS} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_records(results: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(path.read_text()) for path in sorted(results.glob("*/*.json"))]


@dataclass
class Cell:
    """One (rule, attack, attackers) over the seeds."""

    accuracy: list[float] = field(default_factory=list)
    movement: list[float] = field(default_factory=list)
    attacker_uploads: int = 0
    attackers_flagged: int = 0
    attackers_rejected: int = 0
    honest_uploads: int = 0
    honest_flagged: int = 0
    honest_rejected: int = 0
    seeds: list[int] = field(default_factory=list)  # the seeds recorded
    stopped: int = 0  # runs the defences stopped (too many failed rounds)


def cells(records: Sequence[dict[str, Any]]) -> dict[tuple[str, str, int], Cell]:
    """The records summed by (rule, attack, attacker count)."""
    out: dict[tuple[str, str, int], Cell] = {}
    for record in records:
        cell = out.setdefault((record["rule"], record["attack"], len(record["attackers"])), Cell())
        cell.seeds.append(record["seed"])
        cell.stopped += bool(record["error"])
        if record["final_accuracy"] is not None:
            cell.accuracy.append(record["final_accuracy"])
        if record["movement"] is not None:
            cell.movement.append(record["movement"])
        attackers = {str(k) for k in record["attackers"]}
        for round_ in record["rounds"]:
            for k in range(ATTACK_CLIENTS):
                bad = str(k) in attackers
                flagged, rejected = str(k) in round_["flagged"], str(k) in round_["rejected"]
                if bad:
                    cell.attacker_uploads += 1
                    cell.attackers_flagged += flagged
                    cell.attackers_rejected += rejected
                else:
                    cell.honest_uploads += 1
                    cell.honest_flagged += flagged
                    cell.honest_rejected += rejected
    return out


def _mean(values: Sequence[float]) -> str:
    return f"{float(np.mean(values)):.2f}" if values else "-"


def attack_tables(records: Sequence[dict[str, Any]], rules: Sequence[str], attacks: Sequence[str],
                  counts: Sequence[int]) -> str:
    """The three markdown tables of docs/robustness.md: final accuracy, movement, detection."""
    table = cells(records)
    rows = [(HONEST, 0)] + [(attack, count) for attack in attacks for count in counts]
    seeds = sorted({r["seed"] for r in records})

    def only(recorded: Sequence[int]) -> str:
        return ("seed " if len(recorded) == 1 else "seeds ") + ", ".join(map(str, sorted(recorded)))

    def label(attack: str, count: int) -> str:
        return "no attack (clean accuracy)" if attack == HONEST else f"{attack}, {count} of {ATTACK_CLIENTS}"

    def grid(title: str, value: Any) -> list[str]:
        lines = [f"| {title} | " + " | ".join(rules) + " |", "|---|" + "---|" * len(rules)]
        for attack, count in rows:
            cells = []
            for rule in rules:
                cell = table.get((rule, attack, count))
                few = f" ({only(cell.seeds)})" if cell is not None and len(cell.seeds) < len(seeds) else ""
                cells.append("-" if cell is None else value(cell) + few)
            lines.append(f"| {label(attack, count)} | " + " | ".join(cells) + " |")
        return lines

    clean = {(r["rule"], r["seed"]): r["final_accuracy"] for r in records
             if r["attack"] == HONEST and r["final_accuracy"] is not None}

    def cost(rule: str) -> str:  # paired by seed with the mean's clean accuracy
        paired = {seed: clean[(rule, seed)] - clean[("mean", seed)] for seed in seeds
                  if (rule, seed) in clean and ("mean", seed) in clean}
        few = f" ({only(list(paired))})" if len(paired) < len(seeds) else ""
        return f"{float(np.mean(list(paired.values()))):+.2f}{few}" if paired else "-"

    accuracy = grid("final accuracy", lambda c: _mean(c.accuracy) + ("*" if c.stopped else ""))
    accuracy.insert(3, "| clean-accuracy cost (the rule's clean accuracy minus the mean's, same seed) | "
                    + " | ".join(cost(rule) for rule in rules) + " |")
    movement = grid("movement from the honest run", lambda c: _mean(c.movement))
    detection = grid("attackers flagged / rejected of their uploads; honest flagged, rejected", lambda c: (
        f"{c.attackers_flagged}/{c.attackers_rejected} of {c.attacker_uploads}; {c.honest_flagged}, {c.honest_rejected}"
        if c.attacker_uploads else f"-; {c.honest_flagged}, {c.honest_rejected}"))
    return "\n".join([(f"Seeds {', '.join(map(str, seeds))} recorded; each cell the mean over them, or over the "
                       "seeds in brackets where fewer are recorded yet (`-`: none; * a run stopped: too many rounds "
                       "without enough valid uploads; the accuracy is that of the runs that did not; the detection "
                       "counts are sums over the seeds)."),
                      "", *accuracy, "", *movement, "", *detection])


DOCS = ROOT / "docs/robustness.md"
BEGIN, END = "<!-- attacks table: python benchmarks/poisoning.py -->", "<!-- end of the attacks table -->"


def write_docs(text: str) -> bool:
    """Replace the block between :data:`BEGIN` and :data:`END` in docs/robustness.md (False: no markers)."""
    page = DOCS.read_text()
    if BEGIN not in page or END not in page:
        return False
    head, rest = page.split(BEGIN, 1)
    DOCS.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    return True


def run_attacks(runs: Sequence[AttackRun], workers: int, results: Path, effects: Path) -> None:
    """Every run of ``runs`` without a record (the honest ones first), ``workers`` processes at a time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    effects.mkdir(parents=True, exist_ok=True)
    todo = [run for run in runs if not run.record_path(results).is_file()
            or (run.attack == HONEST and not (effects / f"{run.rule}-seed{run.seed}.npz").is_file())]
    batches = [[run for run in todo if run.seed == seed and (run.attack == HONEST) == honest]
               for seed in dict.fromkeys(run.seed for run in todo) for honest in (True, False)]
    print(f"{len(runs) - len(todo)} of {len(runs)} runs recorded, {len(todo)} to run", flush=True)
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for batch in batches:
            futures = {pool.submit(play_attack, run, results, effects): run for run in batch}
            for done, future in enumerate(futures, 1):
                try:
                    record = future.result()
                except Exception as failure:  # noqa: BLE001 - one broken run leaves the others (and no record)
                    print(f"[{done}/{len(batch)}] {futures[future].name}: no record ({failure!r})", flush=True)
                    continue
                print(f"[{done}/{len(batch)}] {futures[future].name}: accuracy {record['final_accuracy']}, "
                      f"movement {record['movement']}, {record['seconds']} s {record['error']}", flush=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--synthetic", action="store_true", help="the synthetic table (no training)")
    parser.add_argument("--clean", action="store_true", help="the cost on clean accuracy (real training runs)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (fresh partitions)")
    parser.add_argument("--workers", type=int, default=2, help="runs at a time")
    parser.add_argument("--rules", default=",".join(DEFENCES), help="the attack table's rules")
    parser.add_argument("--attacks", default=",".join(ATTACK_NAMES), help="the attack table's attacks")
    parser.add_argument("--counts", default=",".join(map(str, FRACTIONS)), help="attackers of 7")
    parser.add_argument("--table", action="store_true", help="only rebuild the tables from the records")
    parser.add_argument("--honest-configs", action="store_true",
                        help="only the shipped configs' honest runs (the anomaly rule's false flags)")
    parser.add_argument("--out", default=str(ROOT / "runs/poisoning-clean"), help="--clean: comparison folder")
    parser.add_argument("--resume", action="store_true", help="--clean: continue the comparison in --out")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.clean:
        clean_accuracy(Path(args.out), seeds, args.workers, args.resume)
        return
    if args.synthetic:
        attack_table()
        return
    if args.honest_configs:
        run_honest_configs(SHIPPED, [0], HONEST_RESULTS, EFFECTS / "honest")
        return
    rules, attacks = args.rules.split(","), args.attacks.split(",")
    counts = [int(c) for c in args.counts.split(",")]
    if not args.table:
        run_attacks(attack_runs(rules, attacks, counts, seeds), args.workers, RESULTS, EFFECTS)
    text = attack_tables(load_records(RESULTS), list(DEFENCES), list(ATTACK_NAMES), list(FRACTIONS))
    text += ("\n\nThe anomaly rule's thresholds judged on the records (`strategies/anomaly.py`'s `verdict` over "
             "each round's recorded measures; the defaults are 2.5 and -0.15, the rule before them 3 and 0): the "
             "honest uploads each flags in every honest run on record, and under each attack the attackers' "
             "uploads it flags of theirs, then the honest uploads it flags beside them (every rule's runs but "
             "the anomaly column's, where it rejected).\n\n")
    text += rule_table(RULE_CANDIDATES, list(ATTACK_NAMES), list(FRACTIONS))
    print(text)
    if write_docs(text):
        print(f"written into {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
