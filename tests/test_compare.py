"""Strategy comparison: `fedlora compare`, its summary and plots, resume, the paired statistics
(checked on hand-made folders of runs against hand-computed numbers), and the notebook."""

from __future__ import annotations

import itertools
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import QUICK_CUT
from strategy_helpers import SHORT_RUN_OPTIONS

from fedlora.app.compare import compare as compare_strategies
from fedlora.app.jobs import Job, is_complete, job_config
from fedlora.app.paired import (
    Pair,
    PairingError,
    bootstrap_ci,
    holm,
    paired_comparisons,
    paired_t_pvalue,
    paired_test,
)
from fedlora.app.plotting import COMPARISON_PLOTS, MECHANISMS_PLOT, plot_mechanisms
from fedlora.app.summary import ComparisonTable, run_row, summarize
from fedlora.config import ConfigError, load_config

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
NOTEBOOK = ROOT / "notebooks/compare_strategies.ipynb"
STRATEGIES = ("fedit", "flexlora")


def results_mtimes(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.glob("*/seed*/results.json"))}


def fake_results(seed: int, weighted: float, unweighted: float, rounds: int = 2) -> dict:
    """A minimal results.json dict (the fields the summary reads)."""
    per_round = [
        {"round": r, "bytes_up": 100, "bytes_down": 200, "client_train_seconds": 1.5, "aggregation_seconds": 0.25}
        for r in range(1, rounds + 1)
    ]
    final = {
        "global_accuracy": 0.5, "personalized_accuracy": weighted, "personalized_accuracy_unweighted": unweighted,
        "personalized_accuracy_worst": 0.1, "personalized_accuracy_p10": 0.2, "best_round": 1,
        "best_global_accuracy": 0.4, "best_personalized_accuracy": 0.3,
    }
    return {"config": {"train": {"seed": seed}}, "rounds": per_round, "final": final, "wall_seconds": 10.0}


# --------------------------------------------------------------------------- summary semantics
def test_a_summary_of_many_mechanism_columns_warns_nothing() -> None:
    import warnings

    # Prepare: two strategies, two seeds, 150 recorded mechanism figures each
    runs = [{"strategy": name, "seed": seed, **{f"extra.m{i}": float(i + seed) for i in range(150)}}
            for name in ("a", "b") for seed in (0, 1)]
    # Execute: every warning an error (pandas' PerformanceWarning of a fragmented frame included)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        table = ComparisonTable(runs)
    # Assert
    assert table["a"]["seeds"] == 2 and table["b"]["extra.m149_mean"] == pytest.approx(149.5)


def test_run_row_sums_costs_and_keeps_both_averages() -> None:
    # Execute
    row = run_row(fake_results(0, weighted=0.8, unweighted=0.6, rounds=2))
    # Assert: per-round bytes are means, totals and seconds are sums over rounds
    assert row["bytes_up_per_round"] == 100 and row["bytes_down_per_round"] == 200
    assert row["bytes_total"] == 600
    assert row["client_train_seconds"] == 3.0 and row["aggregation_seconds"] == 0.5
    assert (row["personalized_accuracy"], row["personalized_accuracy_unweighted"]) == (0.8, 0.6)
    assert row["best_round"] == 1 and row["best_personalized_accuracy"] == 0.3


def test_table_mean_std_over_seeds_and_legend_names_each_average() -> None:
    # Prepare: two seeds of one strategy, one seed of another
    runs = [
        {"strategy": "a", "seed": s, "path": f"seed{s}", **run_row(fake_results(s, w, 0.5))}
        for s, w in ((0, 0.6), (1, 0.8))
    ] + [{"strategy": "b", "seed": 0, "path": "seed0", **run_row(fake_results(0, 0.7, 0.4))}]
    # Execute
    table = ComparisonTable(runs, scale="test scale")
    markdown, csv_text, html = table.to_markdown(), table.to_csv(), table._repr_html_()
    # Assert
    assert table.strategies == ["a", "b"]
    assert math.isclose(table["a"]["personalized_accuracy_mean"], 0.7)
    assert math.isclose(table["a"]["personalized_accuracy_std"], math.sqrt(0.02))  # sample std of 0.6, 0.8
    compact = re.sub(r" +\|", " |", re.sub(r"\| +", "| ", markdown))  # pipe-table cells without padding
    assert "0.7000 ± 0.1414" in markdown and "| b | 1 | 0.5000 |" in compact  # one seed: no ± shown
    assert "pers. acc (weighted)" in markdown and "pers. acc (unweighted)" in markdown
    assert "weighted by the clients' test examples" in markdown and "plain mean over clients" in markdown
    assert "held-out global test set" in markdown and "never used for selection" in markdown
    assert csv_text.splitlines()[0].startswith("strategy,seeds,global_accuracy_mean,global_accuracy_std")
    assert "<table" in html and "</table>" in html and table._repr_markdown_() == markdown


def test_the_terminal_table_fits_100_columns_and_the_files_keep_every_column() -> None:
    # Prepare: the acceptance comparison's five strategies, three seeds each
    names = ("fedpissa", "fedhera", "feddr_lora", "fedtreelora", "fedit")
    runs = [{"strategy": name, "seed": seed, "path": f"seed{seed}",
             **run_row(fake_results(seed, 0.61 + 0.1 * seed + 0.01 * i, 0.5))}
            for i, name in enumerate(names) for seed in range(3)]
    table = ComparisonTable(runs, scale="model minilm, data wordnet/noun8 (max_examples 2000, dirichlet alpha 0.5, "
                                        "data.seed 0), 4 clients, 5 rounds, 1 local epoch(s) capped at 8 steps")
    # Execute
    text, markdown = table.to_text(), table.to_markdown()
    # Assert: within 100 columns, with the accuracies (mean ± std) and their legend; the wide form is wider
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "| global " in text and "| pers. (weighted) " in text and "0.7300 ± 0.1000" in text
    assert "pers. (weighted): final round: each client's own model" in text.replace("\n  ", " ")
    assert max(len(line) for line in markdown.splitlines()) > 100 and "wall s" in markdown
    assert "mean ± std over 3 seed(s); the partitions are identical." in text
    # ... a fresh partition per seed says so (each run's data.seed differs)
    fresh = ComparisonTable([run | {"data_seed": run["seed"]} for run in runs])
    assert "mean ± std over 3 seed(s); a fresh partition per seed." in fresh.to_text()
    # ... and a narrower terminal drops the lowest-priority columns first, never the accuracies
    narrow = table.to_text(width=70)
    assert max(len(line) for line in narrow.splitlines() if line.startswith("|")) <= 70
    assert "| global " in narrow and "wall s" not in narrow


# --------------------------------------------------------------------------- jobs
def test_jobs_share_partitions_and_differ_only_in_train_seed(tmp_path: Path) -> None:
    # Prepare
    base = load_config(SMOKE)
    jobs = [Job(strategy, seed) for strategy in STRATEGIES for seed in (0, 1)]
    # Execute
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs]
    # Assert
    assert all(c.data == base.data for c in configs)
    assert [c.train.seed for c in configs] == [0, 1, 0, 1]
    assert [c.strategy.name for c in configs] == ["fedit", "fedit", "flexlora", "flexlora"]
    assert configs[3].output.dir == str(tmp_path / "flexlora" / "seed1")


def test_fresh_partitions_vary_data_seed_with_the_seed_and_share_it_across_labels(tmp_path: Path) -> None:
    # Prepare: a base data.seed of 7
    base = load_config(SMOKE, ["data.seed=7"])
    jobs = [Job(strategy, seed, fresh_partition=True) for strategy in STRATEGIES for seed in (0, 1, 2)]
    # Execute
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs]
    # Assert: data.seed = 7 + seed, train.seed = seed, the rest of the data section unchanged
    assert [(c.data.seed, c.train.seed) for c in configs] == [(7, 0), (8, 1), (9, 2)] * 2
    assert all(c.data.model_copy(update={"seed": 7}) == base.data for c in configs)


@pytest.mark.parametrize(
    "job, message",
    [
        (Job("nope", 0), "unknown strategy 'nope'"),
        (Job("fedit", 0, ("train.rounds=0",)), "train.rounds"),
        (Job("fedit", 0, ("strategy.bogus=1",)), "strategy.bogus"),
    ],
)
def test_bad_job_is_a_config_error(tmp_path: Path, job: Job, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        job_config(load_config(SMOKE), job, tmp_path)


def test_partial_results_are_not_complete(tmp_path: Path) -> None:
    # Prepare: a run that stopped after round 1 of 2, and a finished one of another config
    config = job_config(load_config(SMOKE), Job("fedit", 0), tmp_path)
    partial = fake_results(0, 0.5, 0.5, rounds=1) | {"config": config.model_dump(mode="json")}
    (tmp_path / "results.json").write_text(json.dumps(partial))
    # Execute / Assert
    assert not is_complete(tmp_path, config)
    other = job_config(load_config(SMOKE, ["train.lr=0.5"]), Job("fedit", 0), tmp_path)
    (tmp_path / "results.json").write_text(json.dumps(fake_results(0, 0.5, 0.5) | {"config": other.model_dump(mode="json")}))
    assert not is_complete(tmp_path, config)
    (tmp_path / "results.json").write_text(json.dumps(fake_results(0, 0.5, 0.5) | {"config": config.model_dump(mode="json")}))
    assert is_complete(tmp_path, config)


def test_summary_leaves_out_runs_still_in_progress(tmp_path: Path) -> None:
    # Prepare: seed 0 finished (2 of 2 rounds), seed 1 still running (1 of 2)
    for seed, rounds in ((0, 2), (1, 1)):
        folder = tmp_path / "fedit" / f"seed{seed}"
        folder.mkdir(parents=True)
        results = fake_results(seed, 0.5 + seed, 0.5, rounds=rounds)
        results["config"]["train"]["rounds"] = 2
        (folder / "results.json").write_text(json.dumps(results))
    # Execute
    table = summarize(tmp_path, write=False)
    # Assert: one seed, the finished one
    assert table["fedit"]["seeds"] == 1 and table["fedit"]["personalized_accuracy_mean"] == 0.5


# --------------------------------------------------------------------------- paired statistics
def t_pvalue_df2(differences: list[float]) -> float:
    """Two-sided paired t-test p-value for 3 seeds by hand: t = mean / (sd / sqrt 3), and with 2
    degrees of freedom the t distribution's tail has the closed form p = 1 - |t| / sqrt(2 + t^2)."""
    mean = sum(differences) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / 2)
    t = mean / (sd / math.sqrt(3))
    return 1 - abs(t) / math.sqrt(2 + t * t)


# personalised accuracy by label and seed; "fedit" is the baseline
HAND = {
    "fedit": {0: 0.80, 1: 0.70, 2: 0.90},
    "a": {0: 0.81, 1: 0.72, 2: 0.93},  # differences +1, +2, +3 points
    "b": {0: 0.79, 1: 0.71, 2: 0.93},  # -1, +1, +3
    "c": {0: 0.85, 1: 0.76, 2: 0.94},  # +5, +6, +4
}
HAND_DIFFERENCES = {"a": [0.01, 0.02, 0.03], "b": [-0.01, 0.01, 0.03], "c": [0.05, 0.06, 0.04]}


def write_run(out: Path, label: str, seed: int, personalised: float, data_seed: int | None = None,
              worst: float | None = None, received: float | None = 0.5, extra: list[dict] | None = None) -> None:
    """A hand-made OUT/<label>/seed<k>/results.json with chosen numbers (two rounds)."""
    folder = out / label / f"seed{seed}"
    folder.mkdir(parents=True)
    results = fake_results(seed, personalised, personalised)
    results["config"] = {"train": {"seed": seed, "rounds": 2}, "data": {"seed": seed if data_seed is None else data_seed}}
    results["final"]["personalized_accuracy_worst"] = personalised - 0.2 if worst is None else worst
    results["final"]["received_accuracy"] = received
    for record, entries in zip(results["rounds"], extra or [{}, {}], strict=True):
        record["extra"] = entries
    (folder / "results.json").write_text(json.dumps(results))


@pytest.fixture
def hand_folder(tmp_path: Path) -> Path:
    for label, by_seed in HAND.items():
        for seed, value in by_seed.items():
            write_run(tmp_path, label, seed, value)
    return tmp_path


def test_holm_adjusts_known_pvalues_step_down_and_keeps_nan_out_of_the_family() -> None:
    # Hand: sorted 0.01, 0.03, 0.04 (m = 3): 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 1 x 0.04) = 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    adjusted = holm([0.2, math.nan, 0.01, 0.9])  # m = 3: 0.03, max(0.03, 2 x 0.2) = 0.4, max(0.4, 0.9)
    assert adjusted[0] == pytest.approx(0.4) and math.isnan(adjusted[1])
    assert adjusted[2] == pytest.approx(0.03) and adjusted[3] == pytest.approx(0.9)
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1


def test_bootstrap_interval_matches_the_exact_bootstrap_of_five_seeds() -> None:
    # Prepare: the exact bootstrap distribution of the mean of 5 differences, all 5^5 resamples
    differences = [0.01, 0.02, 0.03, 0.04, 0.05]
    exact = [sum(differences[i] for i in picks) / 5 for picks in itertools.product(range(5), repeat=5)]
    exact_low, exact_high = np.percentile(exact, [2.5, 97.5])
    # Execute
    low, high = bootstrap_ci(differences)
    # Assert: the seeded Monte Carlo interval (10,000 resamples) is the exact one, and it contains
    # the mean and 2 / 4 points but neither 1.5 nor 4.5 points
    assert low == pytest.approx(exact_low, abs=0.0005) and high == pytest.approx(exact_high, abs=0.0005)
    assert low < 0.02 and 0.04 < high  # holds 2 and 4 points (and the mean, 3)
    assert 0.015 < low and high < 0.045
    assert bootstrap_ci(differences) == (low, high)  # seeded: reproducible


def test_one_seed_has_no_interval_and_its_table_says_so(hand_folder: Path) -> None:
    # a single difference resamples to itself: a zero-width interval would read as certainty
    assert all(math.isnan(v) for v in bootstrap_ci([0.03]))
    paired = summarize(hand_folder, write=False, seeds=[0]).paired("fedit")
    row = paired.row("a", "personalized_accuracy")
    assert row["n"] == 1 and row["mean_difference"] == pytest.approx(0.01, abs=1e-12)
    assert math.isnan(row["ci_low"]) and math.isnan(row["ci_high"]) and math.isnan(row["p_value"])
    line = next(line for line in paired.to_markdown().splitlines() if line.startswith("| a − fedit"))
    assert line.split("|")[5].strip() == "n/a"  # the CI column


def test_paired_t_pvalue_is_the_hand_computed_one() -> None:
    for differences in HAND_DIFFERENCES.values():
        assert paired_t_pvalue(differences) == pytest.approx(t_pvalue_df2(differences), rel=1e-9)
    assert paired_t_pvalue([0.0, 0.0]) == 1.0
    assert math.isnan(paired_t_pvalue([0.1]))


@pytest.mark.parametrize(("differences", "expected"), [
    ([0.02] * 5, 2 / 2**5),  # identical, one sign: the exact sign test, 2 * (1/2)^5
    ([-0.03] * 3, 2 / 2**3),
    ([0.02, 0.020000000000000018, 0.019999999999999997, 0.02, 0.02], 2 / 2**5),  # equal up to rounding
    ([0.0, 0.0, 0.0], 1.0),
    ([-1.0728836e-08, 0.0, 0.0], 1.0),  # runs equal but for float32 rounding in one seed (fedtreelora records)
    ([0.02, 0.02 + 4e-7, 0.02 - 3e-7], 2 / 2**3),  # equal differences up to float32 rounding
])
def test_differences_without_spread_get_the_sign_test_never_p_zero(differences, expected) -> None:
    # Execute
    p, test = paired_test(differences)
    # Assert: not 0, not a p of 1e-32 made by rounding
    assert test == "sign" and p == pytest.approx(expected, rel=1e-12)


def test_a_paired_table_of_identical_differences_reports_no_p_of_zero() -> None:
    # Prepare: runs whose differences to the baseline are identical on every seed
    runs = [{"strategy": label, "seed": seed, "personalized_accuracy": base + shift}
            for seed, base in enumerate((0.61, 0.7, 0.83, 0.52, 0.9))
            for label, shift in (("fedit", 0.0), ("same", 0.03), ("equal", 0.0))]
    # Execute
    table = paired_comparisons(runs, [Pair("same", "fedit"), Pair("equal", "fedit")],
                               metrics=("personalized_accuracy",))
    markdown = table.to_markdown()
    # Assert: every p and Holm p is positive, the sign test is named, each row says its number of seeds
    assert (table.frame["p_value"] > 0).all() and (table.frame["p_holm"] > 0).all()
    assert table.row("same", "personalized_accuracy")["p_value"] == pytest.approx(0.0625)
    assert table.row("equal", "personalized_accuracy")["p_value"] == 1.0
    assert "(sign test)" in markdown and "| 5 (0,1,2,3,4) |" in markdown


def test_paired_table_on_a_hand_made_folder_of_runs(hand_folder: Path) -> None:
    # Execute: every label minus fedit; "a" declared primary on personalised accuracy
    table = summarize(hand_folder, write=False)
    paired = table.paired("fedit", primary="a")
    # Assert: mean differences and p-values by hand
    expected_p = {label: t_pvalue_df2(d) for label, d in HAND_DIFFERENCES.items()}
    for label, differences in HAND_DIFFERENCES.items():
        row = paired.row(label, "personalized_accuracy")
        assert row["mean_difference"] == pytest.approx(sum(differences) / 3, abs=1e-12)
        assert row["p_value"] == pytest.approx(expected_p[label], rel=1e-9)
        assert row["n"] == 3 and row["seeds"] == "0,1,2"
    # Holm over b and c only (a is the primary): c 2 x p_c, b max(that, 1 x p_b); a uncorrected
    assert paired.row("c", "personalized_accuracy")["p_holm"] == pytest.approx(2 * expected_p["c"])
    assert paired.row("b", "personalized_accuracy")["p_holm"] == pytest.approx(expected_p["b"])
    assert paired.row("a", "personalized_accuracy")["p_holm"] == pytest.approx(expected_p["a"])
    assert paired.row("a", "personalized_accuracy")["primary"]
    # on another metric a is not primary: a three-comparison family (worst = personalised - 0.2)
    worst = {label: paired.row(label, "personalized_accuracy_worst")["p_holm"] for label in HAND_DIFFERENCES}
    assert worst["c"] == pytest.approx(3 * expected_p["c"]) and worst["a"] == pytest.approx(2 * expected_p["a"])
    assert worst["b"] == pytest.approx(expected_p["b"])
    # the bootstrap interval of c (+5, +6, +4 points) holds its mean and excludes 0
    c = paired.row("c", "personalized_accuracy")
    assert 0.04 - 1e-9 <= c["ci_low"] < 0.05 < c["ci_high"] <= 0.06 + 1e-9 and c["ci_low"] > 0
    b = paired.row("b", "personalized_accuracy")
    assert b["ci_low"] < 0 < b["ci_high"]  # -1, +1, +3: the interval holds 0
    # every metric of the issue is there, worst client included; CSV and markdown carry them
    assert set(paired.frame["metric"]) == {"personalized_accuracy", "personalized_accuracy_worst",
                                           "global_accuracy", "received_accuracy"}
    markdown = paired.to_markdown()
    assert "worst-client personalised accuracy" in markdown and "**a − fedit** (primary)" in markdown
    assert "+1.0, +2.0, +3.0" in markdown and "Holm" in markdown and "bootstrap" in markdown
    assert paired.to_csv().splitlines()[0] == ("label,baseline,metric,primary,n,seeds,differences,mean_difference,"
                                               "ci_low,ci_high,p_value,p_holm,test")


def test_pairing_is_by_seed_not_by_position() -> None:
    # Prepare: the label's runs listed in seed order 2, 0, 1; the baseline's in 0, 1, 2
    rows = [{"strategy": "fedit", "seed": s, "data_seed": s, "personalized_accuracy": HAND["fedit"][s]} for s in (0, 1, 2)]
    rows += [{"strategy": "c", "seed": s, "data_seed": s, "personalized_accuracy": HAND["c"][s]} for s in (2, 0, 1)]
    # Execute
    paired = paired_comparisons(rows, [Pair("c", "fedit")], metrics=["personalized_accuracy"])
    # Assert: +5, +6, +4 (by position it would be 0.94-0.80, 0.85-0.70, 0.76-0.90)
    assert paired.row("c", "personalized_accuracy")["differences"] == "0:+0.050000 1:+0.060000 2:+0.040000"
    assert paired.row("c", "personalized_accuracy")["mean_difference"] == pytest.approx(0.05)


def test_explicit_seeds_pair_the_same_seeds_of_both_sides(tmp_path: Path) -> None:
    # Prepare: "a" ran seeds 1 and 2 only (a non-core row), the baseline 0, 1 and 2: by position,
    # seed 1 of "a" would meet seed 0 of fedit
    for seed, value in HAND["fedit"].items():
        write_run(tmp_path, "fedit", seed, value)
    for seed in (1, 2):
        write_run(tmp_path, "a", seed, HAND["a"][seed])
    table = summarize(tmp_path, write=False)
    # Execute
    paired = paired_comparisons(table.runs, [Pair("a", "fedit", (1, 2))], metrics=["personalized_accuracy"])
    # Assert: +2 and +3 points (by position: -8 and +23)
    row = paired.row("a", "personalized_accuracy")
    assert row["seeds"] == "1,2" and row["mean_difference"] == pytest.approx(0.025)
    with pytest.raises(PairingError, match="needs seeds 0,1,2; a ran 1,2"):
        paired_comparisons(table.runs, [Pair("a", "fedit", (0, 1, 2))])


def test_paired_refuses_unknown_baselines_unmatched_seeds_and_other_partitions(hand_folder: Path) -> None:
    table = summarize(hand_folder, write=False)
    with pytest.raises(ConfigError, match="baseline 'nope' is not among"):
        table.paired("nope")
    with pytest.raises(ConfigError, match="--primary"):
        table.paired("fedit", primary="fedit")
    write_run(hand_folder, "short", 0, 0.5)
    write_run(hand_folder, "short", 1, 0.5)
    with pytest.raises(PairingError, match="seeds do not match: short ran 0,1, the baseline fedit ran 0,1,2"):
        summarize(hand_folder, write=False).paired("fedit")
    write_run(hand_folder, "short", 2, 0.5, data_seed=7)
    with pytest.raises(PairingError, match="seed 2: short ran on data.seed 7, fedit on data.seed 2"):
        summarize(hand_folder, write=False).paired("fedit")


def test_absent_metric_is_left_out_of_that_comparison_only(tmp_path: Path) -> None:
    for seed in (0, 1):
        write_run(tmp_path, "fedit", seed, 0.8 + seed / 100)
        write_run(tmp_path, "centralized", seed, 0.7, received=None)  # the reference has no received model
    paired = summarize(tmp_path, write=False).paired("fedit")
    assert set(paired.frame["metric"]) == {"personalized_accuracy", "personalized_accuracy_worst", "global_accuracy"}


# --------------------------------------------------------------------------- mechanisms in the summary
def test_numeric_extra_entries_get_their_last_value_as_summary_columns(tmp_path: Path) -> None:
    # Prepare: round 1 and 2 extras; a string, a bool and a nested dict are not numeric entries
    extras = [{"relative_correction": 0.5, "lam_mean_block0": 0.4, "phase": "warmup"},
              {"relative_correction": 0.25, "flag": True, "fedhera": {"clients": {"0": {"r_tot": 8}}}}]
    write_run(tmp_path, "fedpissa", 0, 0.8, extra=extras)
    write_run(tmp_path, "fedpissa", 1, 0.8, extra=[{}, {"relative_correction": 0.75}])
    write_run(tmp_path, "fedit", 0, 0.7)
    write_run(tmp_path, "fedit", 1, 0.7)
    # Execute
    table = summarize(tmp_path)
    # Assert: the last recorded value per run, mean over seeds; absent for a label that never records it
    assert table.extra_keys == ["extra.lam_mean_block0", "extra.relative_correction"]
    assert table["fedpissa"]["extra.relative_correction_mean"] == pytest.approx(0.5)  # (0.25 + 0.75) / 2
    assert table["fedpissa"]["extra.lam_mean_block0_mean"] == pytest.approx(0.4)  # one seed recorded it
    assert math.isnan(table["fedit"]["extra.relative_correction_mean"])
    header = (tmp_path / "summary.csv").read_text().splitlines()[0]
    assert "extra.relative_correction_mean" in header and "phase" not in header and "flag" not in header
    markdown = (tmp_path / "summary.md").read_text()
    assert "| relative_correction | | 0.5 |" in re.sub(r" +\|", " |", re.sub(r"\| +", "| ", markdown))


def test_plot_mechanisms_draws_every_numeric_extra_key_with_integer_round_ticks(tmp_path: Path) -> None:
    write_run(tmp_path, "fedpissa", 0, 0.8, extra=[{"relative_correction": 0.5, "overlap": 0.1},
                                                   {"relative_correction": 0.25, "overlap": 0.2}])
    write_run(tmp_path, "fedit", 0, 0.7)
    # Execute
    figure = plot_mechanisms(tmp_path)
    # Assert: one panel per key, the file written; rounds 1 and 2 ticked as whole numbers
    assert (tmp_path / MECHANISMS_PLOT).stat().st_size > 0
    panels = [ax for ax in figure.axes if ax.get_visible()]
    assert sorted(ax.get_title() for ax in panels) == ["overlap", "relative_correction"]
    line = next(ax for ax in panels if ax.get_title() == "relative_correction").lines[0]
    assert list(line.get_xdata()) == [1, 2] and list(line.get_ydata()) == pytest.approx([0.5, 0.25])
    for ax in panels:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    empty = tmp_path / "none"
    write_run(empty, "fedit", 0, 0.7)
    assert plot_mechanisms(empty) is None and not (empty / MECHANISMS_PLOT).exists()


# --------------------------------------------------------------------------- end to end
def test_inprocess_compare_writes_summary_plots_and_resumes(tmp_path: Path) -> None:
    # Execute: 2 strategies x 2 seeds without Ray, two runs at a time in worker processes, a fresh
    # partition per seed, paired against fedit
    options = {"seeds": (0, 1), "out_dir": tmp_path, "engine": "inprocess", "fresh_partitions": True, "paired": "fedit"}
    table = compare_strategies(SMOKE, STRATEGIES, workers=2, **options)
    first = results_mtimes(tmp_path)
    again = compare_strategies(SMOKE, STRATEGIES, resume=True, **options)
    # Assert
    assert len(first) == 4 and results_mtimes(tmp_path) == first  # the rerun ran nothing
    assert table.strategies == list(STRATEGIES) and [r["seeds"] for r in table.rows] == [2, 2]
    for name in ("summary.csv", "summary.md", *COMPARISON_PLOTS):
        assert (tmp_path / name).stat().st_size > 0, name
    # the summary, first and resumed (nothing rerun), is each label's mean over its two
    # results.json files, read here
    for summary in (table, again):
        assert [r["strategy"] for r in summary.rows] == list(STRATEGIES) and [r["seeds"] for r in summary.rows] == [2, 2]
        for name, row in zip(STRATEGIES, summary.rows):
            runs = [json.loads((tmp_path / f"{name}/seed{k}/results.json").read_text()) for k in (0, 1)]
            for key in ("personalized_accuracy", "personalized_accuracy_unweighted", "received_accuracy"):
                values = [run["final"][key] for run in runs]
                assert all(math.isfinite(v) for v in values), (name, key)
                assert row[f"{key}_mean"] == pytest.approx(np.mean(values)), (name, key)
            totals = [sum(r["bytes_up"] + r["bytes_down"] for r in run["rounds"]) for run in runs]
            assert min(totals) > 0 and row["bytes_total_mean"] == pytest.approx(np.mean(totals)), name
            assert row["client_train_seconds_mean"] > 0
    for s in STRATEGIES:  # each worker log holds its own run only (a worker runs several jobs)
        for k in (0, 1):
            assert (tmp_path / f"{s}/seed{k}/run.log").read_text().count("round   1/") == 1, (s, k)
            assert any((tmp_path / f"tensorboard/{s}/seed{k}").glob("events.out.tfevents.*")), (s, k)
            # one HParams session per run, beside its curves (tests/test_tracking.py reads them)
            assert len(list((tmp_path / f"tensorboard/{s}/seed{k}").glob("events.out.tfevents.*.hparams"))) == 1
        assert any((tmp_path / f"tensorboard/{s}/mean").glob("events.out.tfevents.*")), s
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*.hparams"))) == 1  # the experiment
    seeds = {json.loads((tmp_path / f"fedit/seed{s}/results.json").read_text())["config"]["train"]["seed"] for s in (0, 1)}
    assert seeds == {0, 1}
    data_seeds = {(s, k): json.loads((tmp_path / f"{s}/seed{k}/results.json").read_text())["config"]["data"]["seed"]
                  for s in STRATEGIES for k in (0, 1)}
    base_seed = load_config(SMOKE).data.seed
    assert data_seeds == {(s, k): base_seed + k for s in STRATEGIES for k in (0, 1)}
    # the paired table: flexlora - fedit on both seeds, in paired.csv and summary.md
    assert table.paired_table is not None
    row = table.paired_table.row("flexlora", "personalized_accuracy")
    fedit, flexlora = ([json.loads((tmp_path / f"{s}/seed{k}/results.json").read_text())["final"]["personalized_accuracy"]
                        for k in (0, 1)] for s in STRATEGIES)
    assert row["n"] == 2 and row["mean_difference"] == pytest.approx((flexlora[0] - fedit[0] + flexlora[1] - fedit[1]) / 2)
    assert "flexlora,fedit,personalized_accuracy" in (tmp_path / "paired.csv").read_text()
    assert "Paired differences" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategies", "fedit,nope"], "unknown strategy 'nope'"),
        (["--strategies", "fedit", "--seeds", "0,x"], "--seeds"),
        (["--strategies", "fedit", "--set", "data.bogus=1"], "unknown config key"),
        (["--strategies", ","], "--strategies is empty"),
        (["--strategies", "fedit,flexlora", "--paired", "nope"], "--paired: baseline 'nope' is not among the strategies"),
        (["--strategies", "fedit,flexlora", "--primary", "flexlora"], "--primary needs --paired"),
        (["--strategies", "fedit,flexlora", "--paired", "fedit", "--primary", "fedit"], "--primary: 'fedit' must be"),
        (["--strategies", "fedit,flexlora", "--paired", "fedit", "--primary-metric", "bogus"], "unknown metric 'bogus'"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_and_runs_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    # Execute
    proc = subprocess.run(
        [sys.executable, "-m", "fedlora.app.cli", "compare", str(SMOKE), "--out", str(tmp_path / "cmp"), *args],
        check=False, capture_output=True, text=True, timeout=120,
    )
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "cmp").exists()


@pytest.mark.slow
def test_cli_compare_on_ray_writes_summary_and_pngs_and_skips_finished_runs(tmp_path: Path) -> None:
    # Prepare: the acceptance command, on Flower's simulation engine
    command = [sys.executable, "-m", "fedlora.app.cli", "compare", str(SMOKE), "--strategies", ",".join(STRATEGIES),
               "--seeds", "0,1", "--out", str(tmp_path)]
    # Execute
    first = subprocess.run(command, check=False, capture_output=True, text=True, timeout=1500)  # 4 Ray starts, loaded CI
    assert first.returncode == 0, first.stderr[-3000:]  # else the resume below would run what failed
    mtimes = results_mtimes(tmp_path)
    second = subprocess.run([*command, "--resume"], check=False, capture_output=True, text=True, timeout=300)
    # Assert
    assert second.returncode == 0, second.stderr[-3000:]
    assert len(mtimes) == 4 and results_mtimes(tmp_path) == mtimes
    assert second.stdout.count("complete, skipped") == 4
    for name in ("summary.csv", "summary.md", *COMPARISON_PLOTS):
        assert (tmp_path / name).stat().st_size > 0, name
    assert "pers. (weighted)" in first.stdout and "every column:" in first.stdout
    table = [line for line in first.stdout.splitlines() if line.startswith(("|", "- ", "  ", "Scale: "))]
    assert len(table) >= 4 and max(len(line) for line in table) <= 100  # the table and its legend (paths are the user's)
    assert "pers. acc (unweighted)" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
def test_notebook_executes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a kernelspec for this interpreter (works in a fresh clone, no `jupyter kernelspec
    # install` needed); the parameters papermill-style (a cell after the one tagged `parameters`):
    # the notebook's own quick setting (QUICK = True, its default), output in tmp, the "open
    # finished runs" section pointed at tmp (it must find the comparison one level down)
    import nbformat
    from nbclient import NotebookClient

    kernel_dir = tmp_path / "jupyter" / "kernels" / "fedlora-test"
    kernel_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "fedlora (test)", "language": "python"}
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1
    parameters = f"OUT = {str(tmp_path / 'out')!r}\nFINISHED = {str(tmp_path)!r}"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters))
    # Execute
    NotebookClient(notebook, timeout=900, kernel_name="fedlora-test",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    # Assert: no error; the four methods and their baselines ran on the quick setting: the golden
    # tests' cut of the quick config (tests/test_golden.py: every strategy learns under it)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    runs = {p.parent.parent.name for p in (tmp_path / "out").glob("*/seed0/results.json")}
    assert {"fedpissa", "fedhera", "feddr_lora", "fedtreelora", "fedit"} <= runs
    config = json.loads((tmp_path / "out" / "fedit" / "seed0" / "results.json").read_text())["config"]
    golden = load_config(ROOT / "configs/quick.toml", list(QUICK_CUT)).model_dump(mode="json")
    assert config["model"]["path"] == "minilm"
    assert {k: config[k] for k in ("model", "data", "train")} == {k: golden[k] for k in ("model", "data", "train")}
    tree = json.loads((tmp_path / "out" / "fedtreelora" / "seed0" / "results.json").read_text())["config"]["strategy"]
    assert {key: tree[key] for key in SHORT_RUN_OPTIONS["fedtreelora"]} == SHORT_RUN_OPTIONS["fedtreelora"]
    # ... progress bars in the notebook, updated in place to the last round, one per run
    html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert sum('<progress value="2" max="2"' in h for h in html) == 7
    # ... one run's per-round and per-client tables as pandas frames
    assert any("received_accuracy" in h and "train_loss" in h for h in html)
    assert any("train.loss" in h and "num_examples" in h for h in html)
    # ... the table twice (after the runs, and reopened from the files), with its legend
    tables = [o["data"]["text/html"] for o in outputs if "pers. acc (unweighted)" in o.get("data", {}).get("text/html", "")]
    # (the first <table> of each: the summary; the mechanisms table's columns follow each table's label order)
    rows = [sorted(re.findall(r"<tr>.*?</tr>", table.split("</table>")[0], flags=re.DOTALL)) for table in tables]
    assert len(tables) == 2 and rows[0] == rows[1] and len(rows[0]) == 7  # 7 strategies, in any order
    # ... progress lines while it ran; figures inline (label distribution, 4 methods, bytes,
    # distribution, the reopened comparison), none read from a PNG file
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "round   2/2" in text
    figures = [o for o in outputs if o.get("output_type") == "display_data" and "image/png" in o.get("data", {})]
    assert len(figures) == 8
    assert not any("Image(" in cell.source for cell in notebook.cells)


def test_parallel_workers_end_with_the_command_that_started_them(tmp_path: Path) -> None:
    # Prepare: a command whose one worker is busy with a long job (a file marks that it started)
    import os
    import signal
    import time

    import psutil

    started = tmp_path / "started"
    script = ("import pathlib, time\n"
              "from fedlora.app.jobs import worker_pool\n"
              "pool = worker_pool(1)\n"
              f"pool.submit(pathlib.Path({str(started)!r}).touch)\n"
              "pool.submit(time.sleep, 300)\n"
              "time.sleep(300)\n")
    command = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline and command.poll() is None:
        time.sleep(0.1)
    assert started.exists(), "the worker never ran its first job"
    workers = [p for p in psutil.Process(command.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 1

    # Execute: the command is killed (as `kill -9`, or a session that ends, would)
    os.kill(command.pid, signal.SIGKILL)
    command.wait()

    # Assert: its worker does not run on with the queued job: it is gone within seconds
    _, alive = psutil.wait_procs(workers, timeout=15)
    for process in alive:
        process.kill()
    assert not alive, "a worker outlived the command that started it"
