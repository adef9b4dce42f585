"""Does a federation of 1,000 simulated clients cost what one of 10 costs, when 10 train per round?

Runs the same experiment with 10, 100 and 1,000 clients (``--sizes``): ``configs/smoke.toml``
(the tiny random-weight test backbone), 10 clients sampled per round for training and for
personalised evaluation (``federation.fraction_train = fraction_evaluate = 10 / N``), evaluation
every round, a few rounds (``--rounds``). Every client holds the same amount of data at every size
(``--per-client`` examples, IID partition; the pool is ``per_client x N`` plus the global test
set), so a round does the same work at every size: what changes is only how many clients sit idle.

Each run is a fresh subprocess (``--worker``); the parent samples, every ``--interval`` seconds,
the memory of the worker process (the *server* process: ServerApp, Flower's engine and, on the Ray
engine, the Ray driver) and of its whole process tree (on Ray: gcs_server, raylet and the
ClientApp actors too): peak RSS, and peak PSS (shared pages counted once) where the kernel gives
it. Sizes run interleaved (10, 100, 1000, 10, 100, 1000, ... for ``--repeat``), each strategy and
engine side by side, so a busy machine hits every size alike; the tables give medians.

Per run: server peak RSS, all-process peak RSS / PSS, seconds per round (median over rounds 2..R
of ``rounds[*].seconds`` in results.json: round 1 also queries every client's profile, which does
grow with N and is reported on its own as ``round1_s``), wall time of the whole subprocess, and
the per-client state: on disk (``checkpoint/clients/<k>/round_<r>.bin``, the newest file per
client: clients with state, bytes per client, total), in the engine's memory (in-process engine:
the ``context.state`` of every node after the run, serialised), and the server checkpoint's size.

The last line is ``clients=<N> peak_rss_mb=<server> seconds_per_round=<s> ratio_vs_10=<r> ...``
for the largest size of the first strategy on the first engine, where ``ratio_vs_10`` is the worse
(larger) of the two ratios against 10 clients (server peak RSS, seconds per round), each also
printed on its own. The goal of issue 19 is ratio_vs_10 <= 1.3. A JSON record with the
environment (CPU, load average, versions, commit, command) and every raw run goes to
``benchmarks/results/scale.json`` (``--quick``: ``runs/benchmarks/scale-quick.json``).

    python benchmarks/scale.py                                   # 10 / 100 / 1000, Ray + in process
    python benchmarks/scale.py --quick                           # 10 / 100, 2 rounds, in process
    python benchmarks/scale.py --engines ray --strategies feddpa --repeat 3
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # for harness

import harness

RESULTS = ROOT / "benchmarks" / "results"
QUICK_RESULTS = ROOT / "runs" / "benchmarks"
SAMPLED = 10  # clients per round, training and evaluation
VERSIONED = ("numpy", "torch", "flwr", "flwr-datasets", "datasets", "transformers", "peft", "ray", "psutil")


# ---------------------------------------------------------------------------------- the experiment
def overrides(size: int, strategy: str, rounds: int, per_client: int, global_test: int) -> list[str]:
    """configs/smoke.toml made into an N-client federation that samples 10 clients per round."""
    fraction = SAMPLED / size
    return [
        f"strategy.name=\"{strategy}\"",
        f"data.num_clients={size}",
        f"data.max_examples={per_client * size + global_test}",
        f"data.global_test_size={global_test}",
        "data.partition=\"iid\"",
        f"train.rounds={rounds}",
        "train.device=\"cpu\"",
        f"federation.fraction_train={fraction!r}",
        f"federation.fraction_evaluate={fraction!r}",
        "federation.evaluate_every=1",
        "federation.min_clients=1",
        "federation.num_cpus=1",
        "clients.ranks=[]",  # smoke's three ranks are for its three clients: every client at model.lora_rank
        "output.tensorboard=false",
    ]


def _state_on_disk(out: Path) -> dict[str, float]:
    """The clients' kept state on disk: the newest round_<r>.bin of every client folder."""
    folder = out / "checkpoint" / "clients"
    newest = []
    for client in folder.iterdir() if folder.is_dir() else []:
        files = sorted(client.glob("round_*.bin"), key=lambda p: int(p.stem.split("_")[1]))
        if files:
            newest.append(files[-1].stat().st_size)
    server = sum(p.stat().st_size for p in (out / "checkpoint").glob("server*") if p.is_file())
    return {
        "clients_with_state": float(len(newest)),
        "state_bytes_per_client": statistics.mean(newest) if newest else 0.0,
        "state_bytes_on_disk": float(sum(newest)),
        "server_checkpoint_bytes": float(server),
    }


def _trace_engine_polling() -> dict[str, float]:
    """Diagnostic (``--trace-engine``): count the calls and thread CPU time of Flower's
    ``InMemoryLinkState.get_message_ins``, which its simulation engine calls once per node every
    0.1 s to find the messages to run (fedlora never calls it). A wrapper, same behaviour."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    polling = {"calls": 0.0, "cpu": 0.0}
    original = InMemoryLinkState.get_message_ins

    def get_message_ins(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            polling["calls"] += 1
            polling["cpu"] += time.thread_time() - started

    InMemoryLinkState.get_message_ins = get_message_ins  # type: ignore[method-assign]
    return polling


def worker(args: argparse.Namespace) -> None:
    """One run in this process; writes ``<out>/scale_worker.json`` (the parent measures memory)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray runs its workers at nice 15 otherwise
    from fedlora.app.runner import check_inputs, prepare_environment, quiet_flower, run
    from fedlora.config import load_config

    out = Path(args.out_dir)
    config = load_config(args.config, overrides(args.size, args.strategy, args.rounds, args.per_client, args.global_test))
    config.output.dir = str(out)
    facts: dict[str, Any] = {}
    started = time.perf_counter()
    if args.engine == "ray":
        polling = _trace_engine_polling() if args.trace_engine else None
        run(config, out_dir=out, engine="ray")
        if polling is not None:
            facts |= {"engine_poll_calls": float(polling["calls"]), "engine_poll_cpu_s": polling["cpu"]}
    else:
        from flwr.common.serde import recorddict_to_proto

        from fedlora.app.server import run_server
        from fedlora.clients.app import app as client_app
        from fedlora.simulations.inprocess import InProcessGrid, node_configs

        check_inputs(config)
        out.mkdir(parents=True, exist_ok=True)
        prepare_environment(out)
        quiet_flower(False)
        grid = InProcessGrid(client_app, node_configs(config.data.num_clients))
        run_server(grid, config, out)
        held = [recorddict_to_proto(c.state).ByteSize() for c in grid.contexts.values() if len(c.state)]
        facts |= {"clients_with_state_in_memory": float(len(held)), "state_bytes_in_memory": float(sum(held))}
    facts["run_seconds"] = time.perf_counter() - started
    results = json.loads((out / "results.json").read_text())
    seconds = [float(r["seconds"]) for r in results["rounds"]]
    reported = harness.reported_settings(results, f"scale {args.engine} {args.strategy} N={args.size}")
    facts |= {
        # what the run ran at: the clients' precision and threads, the config (not its data section:
        # the pool grows with N, every client's share stays per_client examples)
        "settings": {key: value for key, value in reported.items() if key != "data"}
        | {"strategy": args.strategy, "engine": args.engine, "per_client": args.per_client, "sampled": SAMPLED},
        "round_seconds": seconds,
        "round1_s": seconds[0],
        "seconds_per_round": statistics.median(seconds[1:] or seconds),
        "clients_per_round": [int(r["clients"]) for r in results["rounds"]],
        "final_personalized_accuracy": results["final"].get("personalized_accuracy"),
        **_state_on_disk(out),
    }
    (out / "scale_worker.json").write_text(json.dumps(facts))


# ---------------------------------------------------------------------------------- measuring
def _tree(pid: int) -> list[Any]:
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _memory(processes: list[Any], with_pss: bool) -> tuple[int, int, int]:
    """(RSS of the first process, RSS summed over all, PSS summed over all or 0)."""
    import psutil

    server = total = pss = 0
    for i, process in enumerate(processes):
        try:
            if with_pss:
                info = process.memory_full_info()
                rss, pss = info.rss, pss + info.pss
            else:
                rss = process.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += rss
        if i == 0:
            server = rss
    return server, total, pss


def measure(args: argparse.Namespace, engine: str, strategy: str, size: int, index: int) -> dict[str, Any]:
    """Run one size in a subprocess, sampling the memory of its process tree."""
    out = Path(args.runs) / f"{engine}-{strategy}-{size}-{index}"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--engine", engine, "--strategy", strategy,
               "--size", str(size), "--rounds", str(args.rounds), "--per-client", str(args.per_client),
               "--global-test", str(args.global_test), "--config", args.config, "--out-dir", str(out)]
    if args.trace_engine:
        command.append("--trace-engine")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log = out.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    peak = {"server_rss": 0, "all_rss": 0, "all_pss": 0, "processes": 0}
    with_pss = True
    started = time.perf_counter()
    with open(log, "w") as handle:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            processes = _tree(proc.pid)
            try:
                server, total, pss = _memory(processes, with_pss)
            except Exception:  # noqa: BLE001 - no PSS on this kernel: RSS only
                with_pss = False
                server, total, pss = _memory(processes, with_pss)
            peak = {"server_rss": max(peak["server_rss"], server), "all_rss": max(peak["all_rss"], total),
                    "all_pss": max(peak["all_pss"], pss), "processes": max(peak["processes"], len(processes))}
            time.sleep(args.interval)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"scale: {engine} {strategy} N={size} failed ({proc.returncode}), see {log}:\n"
                         + log.read_text()[-3000:])
    facts = json.loads((out / "scale_worker.json").read_text())
    mb = 1e6
    return {"engine": engine, "strategy": strategy, "clients": size, "index": index, "wall_s": wall,
            "server_peak_rss_mb": peak["server_rss"] / mb, "all_peak_rss_mb": peak["all_rss"] / mb,
            "all_peak_pss_mb": peak["all_pss"] / mb if with_pss else None, "processes": peak["processes"], **facts}


# ---------------------------------------------------------------------------------- reporting
def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarise(runs: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """Medians per (engine, strategy, size), with ratios against the smallest size."""
    rows = []
    for engine in dict.fromkeys(r["engine"] for r in runs):
        for strategy in dict.fromkeys(r["strategy"] for r in runs):
            base: dict[str, Any] | None = None
            for size in sizes:
                group = [r for r in runs if (r["engine"], r["strategy"], r["clients"]) == (engine, strategy, size)]
                if not group:
                    continue
                row: dict[str, Any] = {"engine": engine, "strategy": strategy, "clients": size, "runs": len(group)}
                for key in ("server_peak_rss_mb", "all_peak_rss_mb", "all_peak_pss_mb", "seconds_per_round",
                            "round1_s", "wall_s", "clients_with_state", "state_bytes_per_client",
                            "state_bytes_on_disk", "clients_with_state_in_memory", "state_bytes_in_memory",
                            "server_checkpoint_bytes", "engine_poll_cpu_s", "engine_poll_calls", "run_seconds"):
                    row[key] = _median(group, key)
                base = base or row
                row["rss_ratio"] = row["server_peak_rss_mb"] / base["server_peak_rss_mb"]
                row["all_rss_ratio"] = row["all_peak_rss_mb"] / base["all_peak_rss_mb"]
                row["seconds_ratio"] = row["seconds_per_round"] / base["seconds_per_round"]
                row["ratio"] = max(row["rss_ratio"], row["seconds_ratio"])
                rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    lines = [("| engine | strategy | clients | server peak RSS MB | all-process peak RSS MB (PSS) | s/round "
              "| round 1 s | state/client KB (clients; in memory) | ratio vs 10: server RSS / all RSS / s/round |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        memory = "-" if r["clients_with_state_in_memory"] is None else f"{r['clients_with_state_in_memory']:.0f}"
        lines.append(
            f"| {r['engine']} | {r['strategy']} | {r['clients']} | {r['server_peak_rss_mb']:.0f} "
            f"| {r['all_peak_rss_mb']:.0f} ({num(r['all_peak_pss_mb'], '.0f')}) | {r['seconds_per_round']:.2f} "
            f"| {r['round1_s']:.1f} | {r['state_bytes_per_client'] / 1e3:.1f} ({r['clients_with_state']:.0f}; {memory}) "
            f"| {r['rss_ratio']:.2f} / {r['all_rss_ratio']:.2f} / {r['seconds_ratio']:.2f} |")
    return "\n".join(lines)


def environment(note: str) -> dict[str, Any]:
    """The harness's record of the machine (CPU model, count and bf16 flags, load average as
    ``uptime`` gives it, versions, commit, command, time), with the versions this benchmark adds."""
    env = harness.environment(note)
    for name in VERSIONED:
        try:
            env["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env["versions"][name] = None
    return env


def check_matched(runs: list[dict[str, Any]]) -> None:
    """Within each engine and strategy, every run (every size, every repeat) ran at the same
    settings but its number of clients; refused in one line otherwise."""
    for engine, strategy in dict.fromkeys((r["engine"], r["strategy"]) for r in runs):
        group = {f"{engine} {strategy} N={r['clients']} run {r['index']}": r["settings"] for r in runs
                 if (r["engine"], r["strategy"]) == (engine, strategy)}
        try:
            harness.require_matched(group, varies=("clients",), what="runs")
        except harness.Unmatched as error:
            raise SystemExit(f"scale: {error}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="numbers of clients (default 10,100,1000; --quick 10,100)")
    parser.add_argument("--strategies", default="fedsa_lora,fedit",
                        help="the first one gives the last line (default: personalised fedsa_lora, then fedit)")
    parser.add_argument("--engines", default=None, help="ray and/or inprocess (default ray,inprocess; --quick inprocess)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default 4; --quick 2)")
    parser.add_argument("--repeat", type=int, default=None, help="runs per size, interleaved (default 2; --quick 1)")
    parser.add_argument("--per-client", type=int, default=50, help="examples per client at every size")
    parser.add_argument("--global-test", type=int, default=100)
    parser.add_argument("--interval", type=float, default=0.25, help="memory sampling period, seconds")
    parser.add_argument("--config", default=str(ROOT / "configs/smoke.toml"))
    parser.add_argument("--quick", action="store_true", help="a smoke test of this script (minutes)")
    parser.add_argument("--out", type=Path, default=None, help="JSON record (default benchmarks/results/scale.json)")
    parser.add_argument("--runs", default=str(ROOT / "runs" / "scale"),
                        help="where the runs' folders go (a subfolder per invocation, named by its start time)")
    parser.add_argument("--note", default="", help="free text stored in the record (e.g. 'machine busy')")
    parser.add_argument("--trace-engine", action="store_true",
                        help="diagnostic: CPU time of the Ray engine's per-node polling (Flower's link state)")
    # one run (the parent starts these)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="inprocess", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="fedsa_lora", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    quick = args.quick
    sizes = [int(s) for s in (args.sizes or ("10,100" if quick else "10,100,1000")).split(",")]
    engines = (args.engines or ("inprocess" if quick else "ray,inprocess")).split(",")
    strategies = args.strategies.split(",")
    args.rounds = args.rounds or (2 if quick else 4)
    repeat = args.repeat or (1 if quick else 2)
    out = args.out or (QUICK_RESULTS / "scale-quick.json" if quick else RESULTS / "scale.json")
    if any(size < SAMPLED for size in sizes):
        raise SystemExit(f"scale: every size must be >= {SAMPLED} (clients sampled per round)")
    # a folder of this invocation's runs: an earlier invocation's run folders are kept, never reused
    args.runs = str(Path(args.runs) / time.strftime("%Y%m%d-%H%M%S"))
    print(f"scale: sizes {sizes}, {SAMPLED} clients per round, {args.rounds} rounds, {args.per_client} examples "
          f"per client, engines {engines}, strategies {strategies}, {repeat} run(s) per size, interleaved", flush=True)

    runs = []
    for index in range(repeat):
        for engine in engines:
            for strategy in strategies:
                for size in sizes:
                    run = measure(args, engine, strategy, size, index)
                    runs.append(run)
                    print(f"  {engine:9} {strategy:10} N={size:<5} server {run['server_peak_rss_mb']:7.0f} MB  "
                          f"all {run['all_peak_rss_mb']:7.0f} MB  {run['seconds_per_round']:6.2f} s/round  "
                          f"round 1 {run['round1_s']:6.1f} s  wall {run['wall_s']:6.1f} s  "
                          f"state {run['state_bytes_per_client'] / 1e3:.1f} KB x {run['clients_with_state']:.0f}"
                          + (f"  engine polling {run['engine_poll_cpu_s']:.1f} s CPU in {run['engine_poll_calls']:.0f} calls"
                             if "engine_poll_cpu_s" in run else ""), flush=True)
    check_matched(runs)
    rows = summarise(runs, sizes)
    print(table(rows))
    record = {"benchmark": "scale", "environment": environment(args.note), "sizes": sizes, "engines": engines,
              "strategies": strategies, "rounds": args.rounds, "repeat": repeat, "per_client": args.per_client,
              "sampled_per_round": SAMPLED, "overrides": overrides(sizes[-1], strategies[0], args.rounds,
                                                                    args.per_client, args.global_test),
              "summary": rows, "runs": runs, "settings": {f"{r['engine']} {r['strategy']} N={r['clients']}": r["settings"]
                                                            for r in runs if r["index"] == 0},
              "varies": ["clients", "engine", "strategy"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {out}")
    head = next(r for r in reversed(rows) if (r["engine"], r["strategy"]) == (engines[0], strategies[0]))
    goal = "yes" if head["ratio"] <= 1.3 else "no"
    print(f"clients={head['clients']} peak_rss_mb={head['server_peak_rss_mb']:.1f} "
          f"seconds_per_round={head['seconds_per_round']:.3f} ratio_vs_10={head['ratio']:.3f} "
          f"rss_ratio_vs_10={head['rss_ratio']:.3f} seconds_ratio_vs_10={head['seconds_ratio']:.3f} "
          f"all_rss_mb={head['all_peak_rss_mb']:.1f} all_rss_ratio_vs_10={head['all_rss_ratio']:.3f} "
          f"engine={head['engine']} strategy={head['strategy']} goal_1.3x={goal}")


if __name__ == "__main__":
    main()
