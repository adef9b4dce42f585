"""FedTreeLoRA against fedit, fedsa_lora, feddpa, local and its fixed-c ablations.

Superseded by ``benchmarks/fidelity.py --scenario fedtreelora`` (the method in the scenario it was
written for, against its paper's baselines and the centralised reference). Kept because the
vintage tables of docs/results/fedtreelora.md were measured with it and name this command.

    python benchmarks/compare_fedtree.py --seeds 0,1,2

Runs every job of :data:`JOBS` x seeds on ``configs/fedtreelora.toml`` (client groups with
disjoint label sets, Dirichlet skew inside a group) with :func:`fedlora.app.jobs.run_jobs`
(in-process engine by default: the real ServerApp / ClientApp without Ray), so every run trains on
identical partitions; complete runs are skipped when rerun. Writes ``OUT/summary.md`` /
``summary.csv`` (mean +- std over seeds) and ``OUT/cuts.md``: the cuts FedTreeLoRA chose per
block and whether its deepest cut recovered the true client groups.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedlora.app.jobs import Job, run_jobs
from fedlora.app.summary import summarize
from fedlora.config import load_config

# label -> (strategy, overrides)
JOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fedit": ("fedit", ()),
    "fedsa_lora": ("fedsa_lora", ()),
    "feddpa": ("feddpa", ()),
    "local": ("local", ()),
    "fedtreelora": ("fedtreelora", ()),
    "fedtreelora_c1": ("fedtreelora", ("strategy.fixed_c=1",)),
    "fedtreelora_c2": ("fedtreelora", ("strategy.fixed_c=2",)),
}


def true_groups(num_clients: int, num_groups: int) -> list[int]:
    """Group of every client under data.partition = 'grouped' (contiguous client groups)."""
    return [g for g, part in enumerate(np.array_split(np.arange(num_clients), num_groups)) for _ in part]


def same_partition(a: list[int], b: list[int]) -> bool:
    """True when two labelings define the same clusters (label names ignored)."""
    return len(set(zip(a, b))) == len(set(a)) == len(set(b))


def cuts_report(out: Path, labels: list[str], num_clients: int, num_groups: int) -> str:
    """One line per FedTreeLoRA run: cuts per block and whether the deepest block's clusters
    are the true groups."""
    truth = true_groups(num_clients, num_groups)
    lines = ["| run | seed | cuts per block (shallow -> deep) | deepest clusters | = true groups |", "|---|---|---|---|---|"]
    for label in labels:
        for results_path in sorted((out / label).glob("seed*/results.json")):
            info = json.loads(results_path.read_text())["strategy_info"].get("fedtreelora")
            if not info:
                continue
            deepest = info["clusters"][max(info["clusters"], key=int)]
            found = [deepest[str(k)] for k in range(num_clients)]
            lines.append(
                f"| {label} | {results_path.parent.name} | {info['cuts']} | {found} | {same_partition(found, truth)} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/fedtreelora.toml"))
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    parser.add_argument("--labels", default=",".join(JOBS), help=f"subset of {','.join(JOBS)}")
    parser.add_argument("--out", default=str(ROOT / "runs/fedtreelora/compare"))
    parser.add_argument("--engine", default="inprocess", choices=("inprocess", "ray"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    labels = args.labels.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    # seed-major: an interrupted comparison still has every label for the first seeds
    jobs = [Job(JOBS[label][0], seed, JOBS[label][1], label) for seed in seeds for label in labels]
    out = Path(args.out)
    run_jobs(args.config, jobs, out, engine=args.engine, overrides=args.set)
    table = summarize(out, labels=labels)
    base = load_config(args.config, args.set)
    cuts = cuts_report(out, labels, base.data.num_clients, base.data.num_groups)
    (out / "cuts.md").write_text(cuts)
    print(table.to_markdown())
    print(cuts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
