"""Cold-start cost of the ClientApp: in a deployment every message starts a fresh process.

    python benchmarks/clientapp_startup.py [--repeats 3] [--results DIR/results.json ...] [--skip-probes]

Measures, each in a fresh Python process: importing ``fedlora.clients.app`` (what a ClientApp process
pays before it can take a message; torch / peft / transformers are imported lazily), importing
the heavy libraries the handler then needs, and the setup ``_job`` does for a smoke message (imports, config, data).
With ``--results`` (a ``fedlora deploy local`` or in-process run) it also prints, per round, message
and client, the setup phases the ClientApps reported (``import-seconds``, ``setup-<phase>-seconds``,
``start-seconds``, ``first-step-seconds``) and each round's wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBES = {
    "python + flwr + fedlora.clients.app (module import)": "import fedlora.clients.app",
    "  torch, transformers, peft (imported by the handler)": "import torch, transformers, peft",
    "  fedlora.clients.app + a smoke message's setup (what _job does)": (
        "import fedlora.clients.app; from fedlora.clients.trainers.base import ClientJob;"
        "from fedlora.config import load_config; from fedlora.data import build_federated_data;"
        "from fedlora.profile import resolve_profile; c=load_config('configs/smoke.toml');"
        "resolve_profile(c, {'partition-id': 0}); build_federated_data(c.data).client(0)"
    ),
}


def wall(code: str) -> float:
    """Seconds a fresh ``python -c code`` takes, start to exit."""
    import time

    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


PHASES = ("import-seconds", "setup-libraries-seconds", "setup-data-seconds", "setup-model-seconds",
          "setup-adapter-seconds", "start-seconds", "first-step-seconds")


def message_rows(results: dict) -> list[tuple[int, str, str, dict[str, float]]]:
    """(round, phase, client, metrics) of every train and evaluate reply in a results.json."""
    rows = []
    for record in results["rounds"]:
        for phase, key in (("train", "per_client_train"), ("evaluate", "per_client")):
            for client, metrics in sorted((record.get(key) or {}).items(), key=lambda kv: int(kv[0])):
                rows.append((record["round"], phase, client, metrics))
    return rows


def print_results(label: str, results: dict) -> None:
    """Per message: the setup phases the ClientApp reported; per round: its wall seconds."""
    def cell(value) -> str:
        return "" if value is None else f"{float(value):.2f}"

    print(f"\n{label}\n\n| round | message | client | {' | '.join(PHASES)} |\n|{'---|' * (3 + len(PHASES))}")
    for round_, phase, client, metrics in message_rows(results):
        print(f"| {round_} | {phase} | {client} | {' | '.join(cell(metrics.get(key)) for key in PHASES)} |")
    print("\n| round | seconds |\n|---|---|")
    for record in results["rounds"]:
        print(f"| {record['round']} | {record.get('seconds', 0.0):.1f} |")


def summary(results_by_label: dict[str, dict]) -> None:
    """Per run: the median and range of every phase over its train / evaluate messages, and each
    round's seconds divided by the first run's (e.g. deployment / in process)."""
    first = next(iter(results_by_label.values()), None)
    print(f"\n| run | message | n | {' | '.join(PHASES)} |\n|{'---|' * (3 + len(PHASES))}")
    for label, results in results_by_label.items():
        for phase in ("train", "evaluate"):
            rows = [m for _, p, _, m in message_rows(results) if p == phase]
            cells = []
            for key in PHASES:
                values = sorted(float(m[key]) for m in rows if m.get(key) is not None)
                cells.append(f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})" if values else "")
            print(f"| {label} | {phase} | {len(rows)} | {' | '.join(cells)} |")
    if first is None:
        return
    print("\n| run | round | seconds | / first run |\n|---|---|---|---|")
    base = {r["round"]: r.get("seconds") for r in first["rounds"]}
    for label, results in results_by_label.items():
        for record in results["rounds"]:
            seconds, reference = record.get("seconds"), base.get(record["round"])
            ratio = f"{seconds / reference:.2f}" if seconds and reference else ""
            print(f"| {label} | {record['round']} | {seconds or 0:.1f} | {ratio} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, action="append", default=[],
                        help="results.json of a run (repeatable): its per-message setup phases and round seconds")
    parser.add_argument("--skip-probes", action="store_true", help="only print the --results tables")
    args = parser.parse_args()
    if not args.skip_probes:
        print(f"| fresh process ({args.repeats} runs) | median s | min s |\n|---|---|---|")
        for label, code in PROBES.items():
            times = [wall(code) for _ in range(args.repeats)]
            print(f"| {label} | {statistics.median(times):.2f} | {min(times):.2f} |")
        print(f"| bare python (`python -c pass`) | {statistics.median(wall('pass') for _ in range(args.repeats)):.2f} | |")
    loaded = {str(path): json.loads(path.read_text()) for path in args.results}
    for label, results in loaded.items():
        print_results(label, results)
    if loaded:
        summary(loaded)


if __name__ == "__main__":
    main()
