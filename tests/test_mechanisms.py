"""The per-method mechanism figures (fedlora.app.mechanisms): the quantities each draws, read from
hand-made round records, and one figure per method written from them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from fedlora.app import mechanisms

TIERS = [{"share": 0.5, "name": "low", "download": 1000.0, "time": 1.0, "memory": 1e12},
         {"share": 0.5, "name": "high", "download": 4000.0, "time": 2.0, "memory": 1e12}]


def fedhera_run(r_tot_high: float) -> dict:
    """Two rounds of a FedHera run: a low-tier client using 900 of its 1000 bytes, a high-tier one 4000 of 4000."""
    clients = {"0": {"download_bytes": 900, "download_budget": 1000.0, "r_tot": 3, "r_main": 1, "budget_applies": True},
               "1": {"download_bytes": 4000, "download_budget": 4000.0, "r_tot": 9, "r_main": 4, "budget_applies": True}}
    rounds = [{"round": r, "extra": {"fedhera": {"clients": clients}, "fedhera_r_tot_low": 3.0,
                                     "fedhera_r_main_low": 1.0, "fedhera_r_tot_high": r_tot_high,
                                     "fedhera_r_main_high": 4.0}} for r in (1, 2)]
    return {"config": {"clients": {"budget_tiers": TIERS}}, "rounds": rounds}


def test_fedhera_tiers_read_ranks_and_the_download_each_tier_used_of_its_budget(tmp_path: Path) -> None:
    # Execute
    means = mechanisms.tier_means(fedhera_run(9.0))
    # Assert: columns per module per tier, and 900 / 1000 and 4000 / 4000 of the budgets
    assert means["low"] == {"r_tot": 3.0, "r_main": 1.0, "download": 0.9}
    assert means["high"] == {"r_tot": 9.0, "r_main": 4.0, "download": 1.0}
    assert all(math.isnan(value) for value in means["medium"].values())  # no medium client: NaN
    figure = mechanisms.plot_method_mechanism("fedhera", {"fedhera": [fedhera_run(9.0)],
                                                          "fedhera_coupled": [fedhera_run(4.0)]},
                                              tmp_path / "m.png")
    assert figure is not None and (tmp_path / "m.png").stat().st_size > 0
    r_tot = figure.axes[0]
    assert [round(bar.get_height(), 6) for bar in r_tot.patches] == [3.0, 0.0, 9.0, 3.0, 0.0, 4.0]


def tree_run(clusters: dict[str, dict[str, int]], lam: list[float | None]) -> dict:
    data = {"partition": "grouped", "num_clients": 4, "num_groups": 2}
    warmup = {"round": 1, "extra": {"phase": "warmup"}}
    tree = {"round": 2, "extra": {"phase": "tree", "clusters": clusters, "lam_mean": lam, "lam_min": lam, "lam_max": lam}}
    return {"config": {"data": data}, "rounds": [warmup, tree]}


def test_fedtreelora_reads_the_last_trees_clusters_agreement_with_the_groups_and_lambda() -> None:
    # Prepare: clients 0-1 and 2-3 are the two task groups; block 0 one cluster, block 1 the groups
    clusters = {"0": {"0": 0, "1": 0, "2": 0, "3": 0}, "1": {"0": 0, "1": 0, "2": 1, "3": 1}}
    # Execute
    found = mechanisms.tree_per_block(tree_run(clusters, [None, 0.7]))
    # Assert
    assert found is not None
    assert found["clusters"] == [1.0, 2.0] and found["ari"] == [0.0, 1.0]
    assert math.isnan(found["lam_mean"][0]) and found["lam_mean"][1] == 0.7  # no external expert: NaN
    assert mechanisms.tree_per_block({"rounds": [{"round": 1, "extra": {"phase": "warmup"}}]}) is None


@pytest.mark.parametrize(("method", "keys"), [
    ("fedpissa", ("relative_correction", "projector_overlap")),
    ("feddr_lora", ("feddr_noise_precision", "feddr_noise_recall", "feddr_flagged_fraction", "feddr_noise_rate")),
])
def test_the_by_round_figures_draw_one_line_per_quantity_and_label(method: str, keys: tuple[str, ...],
                                                                   tmp_path: Path) -> None:
    run = {"rounds": [{"round": r, "extra": {key: 0.1 * r for key in keys}} for r in (1, 2, 3)]}
    figure = mechanisms.plot_method_mechanism(method, {method: [run], f"{method}_ablation": [run]}, tmp_path / "m.png")
    assert sum(len(ax.lines) for ax in figure.axes) == 2 * len(keys)
    assert list(figure.axes[0].lines[0].get_ydata()) == pytest.approx([0.1, 0.2, 0.3])


def test_a_method_without_a_figure_or_without_runs_draws_nothing(tmp_path: Path) -> None:
    assert mechanisms.plot_method_mechanism("fedit", {"fedit": [{"rounds": []}]}, tmp_path / "m.png") is None
    assert mechanisms.plot_method_mechanism("fedhera", {"fedhera": []}, tmp_path / "m.png") is None
    assert not (tmp_path / "m.png").exists()
