"""FedHera against flexlora, hetlora, flora and fedit under three resource tiers.

Superseded by ``benchmarks/fidelity.py --scenario fedhera`` (the method in the scenario it was
written for, against its paper's baselines and the centralised reference). Kept because the
vintage tables of docs/results/fedhera.md were measured with it and name this command.

    python benchmarks/compare_fedhera.py --seeds 0,1,2

Runs every job of :data:`JOBS` x seeds on ``configs/fedhera.toml`` (6 MiniLM clients in three
budget tiers, Dirichlet label skew) with :func:`fedlora.app.jobs.run_jobs` (in-process engine by
default: the real ServerApp / ClientApp without Ray), so every run trains on identical
partitions; complete runs are skipped when rerun. The mixed-rank baselines train each client at
its tier's r_main (2 / 4 / 8), FedIT every client at the smallest rank, 2. Writes
``OUT/summary.md`` / ``summary.csv`` (mean +- std over seeds) and ``OUT/budgets.md``: FedHera's
largest per-client download against that client's budget and the count of violations, read back
from every results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlora.app.jobs import Job, run_jobs
from fedlora.app.summary import summarize

# label -> (strategy, overrides)
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fedhera": ("fedhera", ()),
    "flexlora": ("flexlora", ()),
    "hetlora": ("hetlora", ()),
    "flora": ("flora", ()),
    "fedit_r2": ("fedit", ("clients.rank_tiers={}", "model.lora_rank=2")),
    "fedhera_coupled": ("fedhera", ("strategy.coupled=true",)),
}
DEFAULT_LABELS = "fedhera,flexlora,hetlora,flora,fedit_r2"


def budget_report(out: Path, labels: list[str]) -> str:
    """Per FedHera run: downloads checked, violations, and the tightest client (bytes / budget)."""
    lines = [
        "| run | seed | client downloads checked | budget violations | max download / budget |",
        "|---|---|---|---|---|",
    ]
    for label in labels:
        for path in sorted((out / label).glob("seed*/results.json")):
            results = json.loads(path.read_text())
            checked, violations, tightest = 0, 0, 0.0
            for record in results["rounds"]:
                fedhera = (record.get("extra") or {}).get("fedhera")
                if not fedhera:
                    break
                violations += fedhera["budget_violations"]
                for row in fedhera["clients"].values():
                    checked += 1
                    violations += int(row["download_bytes"] > row["download_budget"])
                    tightest = max(tightest, row["download_bytes"] / row["download_budget"])
            if checked:
                lines.append(f"| {label} | {path.parent.name} | {checked} | {violations} | {tightest:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/fedhera.toml"))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--labels", default=DEFAULT_LABELS, help=f"subset of {','.join(JOBS)}")
    parser.add_argument("--out", default=str(ROOT / "runs/fedhera/compare"))
    parser.add_argument("--engine", default="inprocess", choices=("inprocess", "ray"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    labels = args.labels.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs = [Job(JOBS[label][0], seed, JOBS[label][1], label) for label in labels for seed in seeds]
    out = Path(args.out)
    run_jobs(args.config, jobs, out, engine=args.engine, overrides=args.set)
    table = summarize(out, labels=labels)
    budgets = budget_report(out, labels)
    (out / "budgets.md").write_text(budgets)
    print(table.to_markdown())
    print(budgets)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
