"""Cold-start cost of the ClientApp: in a deployment every message starts a fresh process.

    python benchmarks/clientapp_startup.py [--repeats 3] [--results DIR/results.json]

Measures, each in a fresh Python process: importing ``clients.app`` (what a ClientApp process
pays before it can take a message; torch / peft / transformers are imported lazily), importing
the heavy libraries the handler then needs, and the setup ``_job`` does for a smoke message (imports, config, data).
With ``--results`` (a ``fedlora deploy local`` run) it also prints the per-round, per-client
``import-seconds`` / ``setup-seconds`` / ``start-seconds`` the ClientApps reported.
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
    "python + flwr + clients.app (module import)": "import clients.app",
    "  torch, transformers, peft (imported by the handler)": "import torch, transformers, peft",
    "  clients.app + a smoke message's setup (what _job does)": (
        "import clients.app; from clients.trainers.base import ClientJob;"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path, default=None, help="results.json of a deployment")
    args = parser.parse_args()
    print(f"| fresh process ({args.repeats} runs) | median s | min s |\n|---|---|---|")
    for label, code in PROBES.items():
        times = [wall(code) for _ in range(args.repeats)]
        print(f"| {label} | {statistics.median(times):.2f} | {min(times):.2f} |")
    print(f"| bare python (`python -c pass`) | {statistics.median(wall('pass') for _ in range(args.repeats)):.2f} | |")
    if args.results:
        results = json.loads(args.results.read_text())
        print("\n| round | client | import-seconds | setup-seconds | start-seconds |\n|---|---|---|---|---|")
        for record in results["rounds"]:
            for client, metrics in sorted(record["per_client"].items()):
                cells = [f"{metrics.get(key, float('nan')):.2f}" for key in ("import-seconds", "setup-seconds", "start-seconds")]
                print(f"| {record['round']} | {client} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
