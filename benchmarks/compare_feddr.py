"""FedDR-LoRA vs fedit / ffa_lora / fedsa_lora under label noise (the vintage table of its results page).

Superseded by ``benchmarks/fidelity.py --scenario feddr_lora`` (the method in the scenario it was
written for, against its paper's baselines and the centralised reference). Kept because the
vintage tables of docs/results/feddr_lora.md were measured with it and name this command.

For every noise setting (symmetric / pair-flip at 20, 40, 60 %) this runs ``fedlora compare``
(:func:`fedlora.app.compare.compare`, in process) on ``configs/feddr_lora.toml`` into
``OUT/<setting>/`` and prints one markdown table: accuracy on the *clean* test data per setting
and strategy (mean over clients of each client's model on its clean local test split, and the
global model - or, without one, the clients' models - on the clean global test set), plus
FedDR-LoRA's clean / suspect split quality against the injected noise.

    python benchmarks/compare_feddr.py --seeds 0
    python benchmarks/compare_feddr.py --settings symmetric:0.4 --seeds 0,1,2

Finished runs are not run again (``fedlora compare`` resumes), so seeds and settings can be
added later; ``--table-only`` only re-reads what is there.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# 40 % first: a run cut short by the CPU budget still has one setting of each noise kind
SETTINGS = ("symmetric:0.4", "pairflip:0.4", "symmetric:0.2", "pairflip:0.2", "symmetric:0.6", "pairflip:0.6")
STRATEGIES = ("feddr_lora", "fedit", "ffa_lora", "fedsa_lora")


def setting_overrides(setting: str) -> list[str]:
    kind, rate = setting.split(":")
    return [f"data.label_noise={kind}", f"data.noise_rate={float(rate)}"]


def setting_dir(out: Path, setting: str) -> Path:
    kind, rate = setting.split(":")
    return out / f"{kind}{round(100 * float(rate))}"


def cell(row: dict[str, Any], key: str) -> str:
    mean, std = row.get(f"{key}_mean", math.nan), row.get(f"{key}_std", math.nan)
    if not math.isfinite(mean):
        return "n/a"
    return f"{mean:.3f}" + (f" ± {std:.3f}" if row["seeds"] > 1 else "")


def split_quality(folder: Path) -> str:
    """FedDR-LoRA's last-round split precision / recall, mean over its seeds."""
    values = []
    for path in sorted((folder / "feddr_lora").glob("seed*/results.json")):
        extra = json.loads(path.read_text())["rounds"][-1].get("extra", {})
        if isinstance(extra.get("feddr_noise_precision"), float) and isinstance(extra.get("feddr_noise_recall"), float):
            values.append((extra["feddr_noise_precision"], extra["feddr_noise_recall"]))
    if not values:
        return "n/a"
    precision = sum(v[0] for v in values) / len(values)
    recall = sum(v[1] for v in values) / len(values)
    return f"{precision:.2f} / {recall:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/feddr_lora.toml"))
    parser.add_argument("--settings", default=",".join(SETTINGS), help="kind:rate,... e.g. symmetric:0.4")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--seeds", default="0", help="comma-separated train.seed values")
    parser.add_argument("--out", default=str(ROOT / "runs/feddr_lora/compare"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override")
    parser.add_argument("--table-only", action="store_true", help="summarise existing runs, run nothing")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from fedlora.app.compare import compare
    from fedlora.app.summary import summarize

    settings = [s for s in args.settings.split(",") if s]
    strategies = [s for s in args.strategies.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    out = Path(args.out)
    tables = {}
    for setting in settings:
        folder = setting_dir(out, setting)
        if args.table_only:
            tables[setting] = summarize(folder, labels=strategies)
        else:
            overrides = setting_overrides(setting) + list(args.set)
            tables[setting] = compare(args.config, strategies, seeds, folder, overrides, engine="inprocess", plots=False,
                                      resume=True)  # a rerun continues: finished runs are kept
        print(f"done {setting}", flush=True)

    header = ["noise", *(f"`{s}` clients / global" for s in strategies), "FedDR split prec. / recall"]
    print("\nScale: " + next(iter(tables.values())).scale)
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for setting, table in tables.items():
        cells = []
        for strategy in strategies:
            row = table[strategy]
            cells.append(f"{cell(row, 'personalized_accuracy_unweighted')} / {cell(row, 'global_accuracy')} (n={row['seeds']})")
        print(f"| {setting.replace(':', ' ')} | " + " | ".join(cells) + f" | {split_quality(setting_dir(out, setting))} |")


if __name__ == "__main__":
    main()
