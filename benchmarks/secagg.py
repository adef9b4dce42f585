"""What does secure aggregation (SecAgg+) cost per round: seconds and bytes, plain vs secure, at 5, 10, 20 clients,
without and with one client dropping out in every round.

    python benchmarks/secagg.py                     # 5 / 10 / 20 clients, no dropout and one, in process,
                                                    # 1 warm-up + 5 runs per arm
    python benchmarks/secagg.py --dropout none --engine ray --repeat 3
    python benchmarks/secagg.py --quick             # 3 clients, 3 rounds, 1 run per arm: a smoke test (~40 s)

Two arms per federation size N (``--sizes``): **plain**, ``fedlora run`` with strategy ``fedit``,
and **secure**, the same run with ``--set secure_aggregation.enabled=true`` (docs/secure-aggregation.md:
fedlora's SecAgg+ port, its masks from ChaCha20, commitments to every share, proofs of key
possession) and ``secure_aggregation.clip_norm = --clip-norm`` (every client clips its update
before masking, the server checks the unmasked mean). With ``--dropout one`` (or ``both``, the
default: both pairs of arms) the pair ``plain-N-drop`` / ``secure-N-drop`` has exactly one client
fail its training in every round (``faults.drop_rate = 1 / N`` with a ``faults.seed`` for which the
draws of every round fail exactly one client: :func:`drop_seed`), after the secure stages' key
exchange, so that the secure server rebuilds the dropped client's pairwise masks from its key's
shares; ``federation.min_clients = N - 1``.
The base config is ``configs/smoke.toml`` (the tiny random-weight test backbone), made into an
N-client federation: every client holds the same ``--per-client`` examples (IID; the pool is
``per_client x N`` plus the global test set) and trains at one rank (``model.lora_rank``,
``--rank``; smoke's three per-client ranks are cleared), every client is sampled in every round
(``federation.fraction_train = 1``) and every one must reply (``federation.min_clients = N``;
SecAgg+ needs at least 3), no personalised evaluation (``federation.fraction_evaluate = 0``) and
the server's evaluation only in the last round (``federation.evaluate_every = rounds``). So a
round is training and aggregation only, and both arms do the same training.

Every run is a fresh process (``fedlora run --engine inprocess``, or ``--engine ray``) writing
its results.json to a temporary folder. Per run, from ``rounds[]`` of its results.json:

- ``seconds``: the median round time over the **steady rounds** 2..R-1 (round 1 also loads the
  backbone and tokenises every client's split; round R carries the evaluation); with R < 3, rounds
  2..R. ``train_seconds`` is the clients' summed training loops (``client_train_seconds``) and
  ``rest_seconds`` the round minus them, medians over the same rounds;
- ``bytes_up`` / ``bytes_down``: fedlora's payload bytes (the arrays; a secure upload is the
  masked int64 vector), ``wire_bytes_up`` / ``wire_bytes_down``: every message as serialised, the
  secure stages' messages included (steady-round medians; they do not change between rounds);
- secure arm only, from ``extra.secure_aggregation``: the stages the server runs outside Flower's
  training exchange, ``setup_seconds``, ``share_keys_seconds``, ``unmask_seconds`` (the unmask
  stage includes the server regenerating the masks), their wire bytes, and the error bound;
  ``train_stage_seconds`` is the round minus those stages (the training messages, with the
  clients' masking, and the aggregation); on the plain arm it is the whole round.

Every run is checked: every round must sample N clients and aggregate all of them (N - 1 with a
dropout, one failure), and a secure run must have masked them and, with a dropout, rebuilt one
dropped client's masks (a run that is not what it claims stops the benchmark).

The arms run through :mod:`harness` (benchmarks/harness.py): ``--warmup`` runs of every arm
(default 1, discarded), then plain-5, secure-5, plain-10, secure-10, plain-20, secure-20, ...
``--repeat`` times (default 5), so a drifting machine hits every arm alike; min / median / max per
arm and figure, and for each N the ratio secure / plain of the medians with its spread (max / min
of the per-pair ratios). The JSON record (``benchmarks/results/secagg.json``; ``--quick``:
``runs/benchmarks/secagg-quick.json``) holds the machine, every run and the side-by-side table.
The last line gives, per pair of arms in the order of ``clients=`` (N, then N-drop: with a
dropout), the medians and ratios:

    clients=5,10,20,5-drop,10-drop,20-drop plain_seconds=... secure_seconds=... seconds_ratio=... spread=...
    bytes_up_ratio=... wire_up_ratio=... wire_down_ratio=...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # the repository, then benchmarks/ (for harness)

import harness

NAME = "secagg"
MIN_CLIENTS = 3  # SecAgg+ in fedlora needs at least 3 clients a round (docs/secure-aggregation.md)
STAGES = ("setup", "share_keys", "unmask")  # the stages outside Flower's training exchange
# what the arms may differ in: secure aggregation, the number of clients (and so the pool of
# examples: every client keeps per_client), the clients dropping out every round
VARIES = ("secure", "clients", "dropped")
DEFAULTS = {"sizes": "5,10,20", "rounds": 5, "per_client": 100, "dropout": "both"}
QUICK = {"sizes": "3", "rounds": 3, "per_client": 40, "dropout": "none"}


def drop_seed(size: int, rounds: int) -> int:
    """The smallest ``faults.seed`` whose draws (``fedlora.clients.faults.maybe_fail`` at
    ``drop_rate = 1 / size``) fail exactly one of ``size`` clients in every round 1..``rounds``."""
    from fedlora.clients.faults import SimulatedClientFailure, maybe_fail
    from fedlora.schema import FaultsConfig

    def fails(faults: FaultsConfig, server_round: int, partition: int) -> bool:
        try:
            maybe_fail(faults, server_round, partition)
        except SimulatedClientFailure:
            return True
        return False

    for seed in range(100_000):
        faults = FaultsConfig(drop_rate=1 / size, seed=seed)
        if all(sum(fails(faults, r, p) for p in range(size)) == 1 for r in range(1, rounds + 1)):
            return seed
    raise SystemExit(f"secagg: no faults.seed below 100000 drops exactly one of {size} clients in each of {rounds} rounds")


def overrides(size: int, secure: bool, args: argparse.Namespace, dropped: int = 0) -> list[str]:
    """configs/smoke.toml as a ``size``-client FedIT federation, every client sampled and needed
    (with ``dropped = 1``: one client fails every round, the others needed)."""
    drop = [f"faults.drop_rate={1 / size}", f"faults.seed={drop_seed(size, args.rounds)}"] if dropped else []
    return [
        "strategy.name=\"fedit\"",
        f"model.lora_rank={args.rank}",
        f"data.num_clients={size}",
        f"data.max_examples={args.per_client * size + args.global_test}",
        f"data.global_test_size={args.global_test}",
        "data.partition=\"iid\"",
        f"train.rounds={args.rounds}",
        "train.device=\"cpu\"",
        "federation.fraction_train=1.0",
        "federation.fraction_evaluate=0.0",
        f"federation.evaluate_every={args.rounds}",
        f"federation.min_clients={size - dropped}",
        "clients.ranks=[]",  # smoke's three ranks are for its three clients: every client at model.lora_rank
        "clients.rank_tiers={}",
        "output.save_adapters=false",
        "output.tensorboard=false",
        f"secure_aggregation.enabled={'true' if secure else 'false'}",
        *([f"secure_aggregation.clip_norm={args.clip_norm}"] if secure else []),
        *drop,
    ]


def steady_rounds(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rounds 2..R-1 (round 1 loads and tokenises, round R evaluates); 2..R when R < 3; all when R = 1."""
    if len(rounds) >= 3:
        return rounds[1:-1]
    return rounds[1:] or rounds


def figures(results: dict[str, Any], wall: float, size: int, secure: bool, dropped: int = 0) -> dict[str, float]:
    """One run's figures (module docstring), after checking that every round was what it claims
    (``dropped``: clients that fail every round)."""
    rounds = results["rounds"]
    summed = size - dropped
    for r in rounds:
        if (r["sampled"], r["clients"], r["failures"]) != (size, summed, dropped):
            raise SystemExit(f"secagg: round {r['round']} of a {size}-client run sampled {r['sampled']}, aggregated "
                             f"{r['clients']}, {r['failures']} failures: not a round of {size} clients, {dropped} "
                             "dropping out")
        report = r.get("extra", {}).get("secure_aggregation")
        if secure and (report is None or report.get("masked") != summed or "failed_stage" in report
                       or report.get("dead_recovered") != dropped or report.get("culprits")):
            raise SystemExit(f"secagg: round {r['round']} was not securely aggregated over {summed} clients with "
                             f"{dropped} dropped: {report}")
        if not secure and report is not None:
            raise SystemExit(f"secagg: round {r['round']} of a plain run reports secure aggregation")
    steady = steady_rounds(rounds)

    def median(values: list[float]) -> float:
        return float(statistics.median(values))

    out = {
        "seconds": median([r["seconds"] for r in steady]),
        "train_seconds": median([r["client_train_seconds"] for r in steady]),
        "rest_seconds": median([r["seconds"] - r["client_train_seconds"] for r in steady]),
        "first_round_seconds": float(rounds[0]["seconds"]),
        "bytes_up": median([r["bytes_up"] for r in steady]),
        "bytes_down": median([r["bytes_down"] for r in steady]),
        "wire_bytes_up": median([r["wire_bytes_up"] for r in steady]),
        "wire_bytes_down": median([r["wire_bytes_down"] for r in steady]),
    }
    if secure:
        reports = [r["extra"]["secure_aggregation"] for r in steady]
        for stage in STAGES:
            out[f"{stage}_seconds"] = median([rep["seconds"][stage] for rep in reports])
            out[f"{stage}_wire_bytes_down"] = median([rep["wire_bytes"][stage]["down"] for rep in reports])
            out[f"{stage}_wire_bytes_up"] = median([rep["wire_bytes"][stage]["up"] for rep in reports])
        out["train_stage_seconds"] = median([r["seconds"] - sum(rep["seconds"][s] for s in STAGES)
                                             for r, rep in zip(steady, reports, strict=True)])
        out["error_bound"] = max(float(rep["error_bound"]) for rep in reports)
    else:
        out["train_stage_seconds"] = out["seconds"]
    out["wall_seconds"] = wall
    out["global_accuracy"] = float(results["final"]["global_accuracy"])
    return out


def arms(args: argparse.Namespace, tmp: Path) -> dict[str, harness.Arm]:
    """plain-N and secure-N for every N, each a fresh ``fedlora run`` per call, writing under ``tmp``."""
    runs = iter(range(1_000_000))

    def arm(size: int, secure: bool, dropped: int) -> harness.Arm:
        def run() -> harness.Run:
            out = tmp / f"{'secure' if secure else 'plain'}-{size}-{dropped}-{next(runs)}"
            results, wall = harness.fedlora_run(args.config, overrides(size, secure, args, dropped), out, args.engine,
                                                 name="secagg")
            return harness.Run(figures(results, wall, size, secure, dropped), settings(results, args, secure, dropped))
        return run

    return {f"{side}-{size}{suffix}": arm(size, side == "secure", dropped)
            for dropped, suffix in variants(args) for size in args.sizes for side in ("plain", "secure")}


def settings(results: dict[str, Any], args: argparse.Namespace, secure: bool, dropped: int) -> harness.Settings:
    """What a run ran at: its clients' precision and threads and its config (harness.reported_settings),
    its data section hashed without the two keys that grow with N (``num_clients`` and the pool,
    ``max_examples``: every client keeps ``per_client`` examples, which is what the arms share)."""
    shared = {key: value for key, value in results["config"]["data"].items() if key not in ("num_clients", "max_examples")}
    return harness.reported_settings(results, "secagg") | {
        "data": hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16], "engine": args.engine,
        "secure": secure, "dropped": dropped, "per_client": args.per_client}


def variants(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(clients dropping out every round, the arms' name suffix) for ``--dropout``."""
    return {"none": [(0, "")], "one": [(1, "-drop")], "both": [(0, ""), (1, "-drop")]}[args.dropout]


# the figures compared secure / plain per N, as (record key, column name)
COMPARED = (("seconds", "seconds"), ("train_stage_seconds", "train_stage"), ("rest_seconds", "rest"),
            ("bytes_up", "bytes_up"), ("bytes_down", "bytes_down"), ("wire_bytes_up", "wire_up"),
            ("wire_bytes_down", "wire_down"))


def side_by_side(measured: harness.Measurements, sizes: list[int],
                 kinds: Sequence[tuple[int, str]] = ((0, ""),)) -> list[dict[str, Any]]:
    """Per N: min / median / max of both arms' figures, the ratio of the medians secure / plain and
    its spread for every compared figure, and the secure stages' medians."""
    rows = []
    for (dropped, suffix), size in ((kind, size) for kind in kinds for size in sizes):
        plain, secure = f"plain-{size}{suffix}", f"secure-{size}{suffix}"
        stats = {arm: {k: vars(v) for k, v in harness.describe(measured.samples[arm]).items()} for arm in (plain, secure)}
        row: dict[str, Any] = {"clients": f"{size}{suffix}", "size": size, "dropped": dropped, "plain": stats[plain],
                               "secure": stats[secure], "ratio": {}, "spread": {}}
        for key, _ in COMPARED:
            c = harness.compare(measured, secure, plain, key)
            row["ratio"][key], row["spread"][key] = c.ratio, c.spread
            row.setdefault("pair_ratios", {})[key] = c.pair_ratios
        rows.append(row)
    return rows


SECONDS_HEADER = ("| clients | plain s/round | secure s/round | ratio (spread) | plain train loops s "
                  "| secure train loops s | plain rest s | secure rest s |")
BYTES_HEADER = ("| clients | payload up KB plain / secure (ratio) | payload down KB plain / secure (ratio) "
                "| wire up KB plain / secure (ratio) | wire down KB plain / secure (ratio) |")
STAGES_HEADER = ("| clients | secure s/round | setup s | share keys s | training messages + aggregation s "
                 "| the same, plain (whole round) s | unmask s | stage wire KB down / up: setup; share keys; unmask |")


def table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side tables (markdown): seconds per round, then bytes per round, then the secure stages."""
    def mmm(stats: dict[str, float], digits: int = 2) -> str:
        return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"

    lines = [SECONDS_HEADER, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, s = r["plain"], r["secure"]
        lines.append(f"| {r['clients']} | {mmm(p['seconds'])} | {mmm(s['seconds'])} | **{r['ratio']['seconds']:.2f}** "
                     f"({r['spread']['seconds']:.2f}) | {mmm(p['train_seconds'])} | {mmm(s['train_seconds'])} "
                     f"| {mmm(p['rest_seconds'])} | {mmm(s['rest_seconds'])} |")
    lines += ["", BYTES_HEADER, "|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
            cells.append(f"{r['plain'][key]['median'] / 1e3:.1f} / {r['secure'][key]['median'] / 1e3:.1f} "
                         f"({r['ratio'][key]:.2f})")
        lines.append(f"| {r['clients']} | " + " | ".join(cells) + " |")
    lines += ["", STAGES_HEADER, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, p = r["secure"], r["plain"]
        wire = "; ".join(f"{s[f'{stage}_wire_bytes_down']['median'] / 1e3:.1f} / {s[f'{stage}_wire_bytes_up']['median'] / 1e3:.1f}"
                         for stage in STAGES)
        lines.append(f"| {r['clients']} | {mmm(s['seconds'])} | {mmm(s['setup_seconds'], 3)} "
                     f"| {mmm(s['share_keys_seconds'])} | {mmm(s['train_stage_seconds'])} "
                     f"| {mmm(p['train_stage_seconds'])} | {mmm(s['unmask_seconds'])} | {wire} |")
    return "\n".join(lines)


def last_line(rows: list[dict[str, Any]]) -> str:
    """``key=value`` per figure, each value the comma-separated list over the sizes in ``clients=``."""
    def joined(values: list[float], digits: int = 3) -> str:
        return ",".join(f"{v:.{digits}f}" for v in values)

    return " ".join([
        "clients=" + ",".join(str(r["clients"]) for r in rows),
        "plain_seconds=" + joined([r["plain"]["seconds"]["median"] for r in rows]),
        "secure_seconds=" + joined([r["secure"]["seconds"]["median"] for r in rows]),
        "seconds_ratio=" + joined([r["ratio"]["seconds"] for r in rows]),
        "spread=" + joined([r["spread"]["seconds"] for r in rows]),
        "bytes_up_ratio=" + joined([r["ratio"]["bytes_up"] for r in rows]),
        "wire_up_ratio=" + joined([r["ratio"]["wire_bytes_up"] for r in rows]),
        "wire_down_ratio=" + joined([r["ratio"]["wire_bytes_down"] for r in rows]),
    ])


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/smoke.toml"), help="base config (model, data source)")
    parser.add_argument("--sizes", default=None, help=f"numbers of clients (default {DEFAULTS['sizes']}; "
                        f"--quick {QUICK['sizes']}); at least {MIN_CLIENTS}")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds per run (default {DEFAULTS['rounds']}; --quick {QUICK['rounds']})")
    parser.add_argument("--per-client", type=int, default=None,
                        help=f"examples per client (default {DEFAULTS['per_client']}; --quick {QUICK['per_client']})")
    parser.add_argument("--global-test", type=int, default=100, help="global test set size")
    parser.add_argument("--rank", type=int, default=4, help="model.lora_rank, every client's rank")
    parser.add_argument("--engine", choices=("inprocess", "ray"), default="inprocess", help="fedlora's engine")
    parser.add_argument("--dropout", choices=("none", "one", "both"), default=None,
                        help=f"arms without a dropout, with one client dropping out every round, or both (default "
                        f"{DEFAULTS['dropout']}; --quick {QUICK['dropout']})")
    parser.add_argument("--clip-norm", type=float, default=1.0,
                        help="secure arms: secure_aggregation.clip_norm, the L2 norm every client clips its update to")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 3 clients, 3 rounds, no warm-up, 1 run per arm (checks the plumbing, "
                        "measures nothing)")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else DEFAULTS
    args.sizes = [int(s) for s in str(args.sizes or preset["sizes"]).split(",")]
    args.rounds = args.rounds or preset["rounds"]
    args.per_client = args.per_client or preset["per_client"]
    args.dropout = args.dropout or preset["dropout"]
    if min(args.sizes) < MIN_CLIENTS or len(set(args.sizes)) != len(args.sizes):
        parser.exit(2, f"error: --sizes must be distinct numbers of clients >= {MIN_CLIENTS} "
                       f"(secure aggregation needs {MIN_CLIENTS} a round), got {args.sizes}\n")
    if args.rounds < 1 or args.per_client < 1 or args.rank < 1 or not args.clip_norm > 0:
        parser.exit(2, "error: need --rounds >= 1, --per-client >= 1, --rank >= 1 and --clip-norm > 0\n")
    harness.settle(args, NAME, quick=args.quick, repeat=1 if args.quick else harness.DEFAULT_REPEAT,
                   warmup=0 if args.quick else harness.DEFAULT_WARMUP)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    env = harness.environment(args.note)
    print(f"secagg: fedit on {Path(args.config).name}, sizes {args.sizes}, {args.rounds} rounds (steady: "
          f"{'2..R-1' if args.rounds >= 3 else '2..R'}), {args.per_client} examples per client, rank {args.rank}, "
          f"dropout {args.dropout}, clip norm {args.clip_norm:g}, engine {args.engine}; {args.warmup} warm-up + "
          f"{args.repeat} interleaved runs per arm", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedlora-secagg-") as tmp:
        measured = harness.run_interleaved(arms(args, Path(tmp)), repeat=args.repeat, warmup=args.warmup,
                                           varies=VARIES)
    rows = side_by_side(measured, args.sizes, variants(args))
    largest, suffix = args.sizes[-1], variants(args)[0][1]
    comparison = harness.compare(measured, f"secure-{largest}{suffix}", f"plain-{largest}{suffix}", "seconds")
    print(harness.report(measured, comparison))
    text = table(rows)
    print(text)
    extra = {"side_by_side": rows, "table": text,
             "steady_rounds": "2..R-1" if args.rounds >= 3 else "2..R",
             "overrides": {f"{side}-{largest}{suffix}": overrides(largest, side == "secure", args, dropped)
                           for dropped, suffix in variants(args) for side in ("plain", "secure")}}
    return harness.finish(NAME, args, measured, comparison, last_line(rows), extra, env)


if __name__ == "__main__":
    raise SystemExit(main())
