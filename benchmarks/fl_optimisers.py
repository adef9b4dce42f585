"""Generic FL optimisers on LoRA: FedAvg (fedit), FedProx, FedAvgM, FedAdam, FedYogi, side by side.

    python benchmarks/fl_optimisers.py                     # 5 arms x seeds 0,1,2 on configs/quick.toml
    python benchmarks/fl_optimisers.py --sweep --seeds 0   # FedAdam / FedYogi at other server rates
    python benchmarks/fl_optimisers.py --seeds 0 --rounds 2  # a smoke of the same table

Every arm is ``fedavg`` (FedIT: FedAvg on the LoRA factors and the head) on configs/quick.toml
(MiniLM, WordNet nouns, 4 clients with Dirichlet(0.5) label skew, 5 local AdamW steps a round), fresh
partitions per seed, in process; an arm changes one thing:

- ``fedprox``: ``train.proximal_mu`` (:data:`PROXIMAL_MU`) on every client;
- ``fedavgm`` / ``fedadam`` / ``fedyogi``: ``server_optimizer.name`` with the settings of :data:`ARMS`
  (FedAvgM: lr 1, momentum 0.9; FedAdam and FedYogi: Flower's betas and tau, server lr 0.01).

``--sweep`` runs FedAdam and FedYogi at the server rates of :data:`SWEEP` instead (into
runs/fl-optimisers-sweep): how much the table's choice of 0.01 decides their row.

The comparison folder (``--out``, default runs/fl-optimisers) gets fedlora's summary (``summary.md``,
the plots) and the paired differences of every arm minus ``fedavg``; ``--resume`` continues it. The
measured table is in docs/results/fl-optimisers.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this repository's fedlora, not an installed one

QUICK = ROOT / "configs" / "quick.toml"
PROXIMAL_MU = 0.1
ARMS: dict[str, tuple[str, ...]] = {
    "fedavg": (),
    "fedprox": (f"train.proximal_mu={PROXIMAL_MU}",),
    "fedavgm": ("server_optimizer.name=fedavgm", "server_optimizer.lr=1.0", "server_optimizer.momentum=0.9"),
    "fedadam": ("server_optimizer.name=fedadam", "server_optimizer.lr=0.01"),
    "fedyogi": ("server_optimizer.name=fedyogi", "server_optimizer.lr=0.01"),
}

SWEEP: dict[str, tuple[str, ...]] = {
    f"{name}-lr{lr:g}": (f"server_optimizer.name={name}", f"server_optimizer.lr={lr}")
    for name in ("fedadam", "fedyogi") for lr in (0.03, 0.1)
}


def compare(out: Path, seeds: list[int], rounds: int, workers: int, resume: bool,
            arms: dict[str, tuple[str, ...]] = ARMS) -> None:
    """Every arm x seed, then fedlora's table and the paired differences against fedavg."""
    from fedlora.app.jobs import Job, claim_output, resolve_base, run_jobs
    from fedlora.app.summary import summarize

    base = resolve_base(str(QUICK), [f"train.rounds={rounds}", "train.precision=fp32"])
    jobs = [Job("fedavg", seed, overrides, label=arm, fresh_partition=True)  # seed by seed: every arm of a seed first
            for seed in seeds for arm, overrides in arms.items()]
    folder = claim_output(out, "comparison", resume, overwrite=False)
    run_jobs(base, jobs, out, engine="inprocess", workers=workers, folder=folder)
    table = summarize(out, labels=list(arms), seeds=seeds)
    print(table.to_text())
    if len(seeds) > 1 and "fedavg" in arms:
        paired = table.paired("fedavg")
        paired.write(out)
        with (out / "summary.md").open("a") as summary:
            summary.write("\n" + paired.to_markdown())
        print(paired.to_markdown())
    print(f"results: {out}/ (summary.md)")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated train seeds (fresh partitions)")
    parser.add_argument("--rounds", type=int, default=4, help="train.rounds (configs/quick.toml: 4)")
    parser.add_argument("--workers", type=int, default=1, help="runs at a time")
    parser.add_argument("--out", default="", help="comparison folder (default runs/fl-optimisers[-sweep])")
    parser.add_argument("--resume", action="store_true", help="continue the comparison in --out")
    parser.add_argument("--sweep", action="store_true", help="FedAdam and FedYogi at the server rates of SWEEP")
    args = parser.parse_args()
    out = Path(args.out or ROOT / ("runs/fl-optimisers-sweep" if args.sweep else "runs/fl-optimisers"))
    compare(out, [int(s) for s in args.seeds.split(",")], args.rounds, args.workers, args.resume,
            SWEEP if args.sweep else ARMS)


if __name__ == "__main__":
    main()
