"""benchmarks/fidelity.py: every scenario's jobs build valid configs at the regime the comparison
needs, the tuning stage feeds the final runs, and the regime rule (FedIT within 5 points of the
centralised reference) decides whether a scenario counts.

Nothing is trained here: configs are resolved and validated, and the regime rule is given tables
with known means.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_benchmark_harness import load

from fedlora.app.compare import job_config, resolve_base
from fedlora.app.tune import point_label

fidelity = load("fidelity")


@pytest.mark.parametrize("name", list(fidelity.SCENARIOS))
def test_every_job_of_every_scenario_is_a_valid_config_at_the_comparison_regime(name: str, tmp_path: Path) -> None:
    scenario = fidelity.SCENARIOS[name]
    base = resolve_base(str(fidelity.ROOT / scenario.config))
    assert base.train.rounds >= 20 and base.data.num_clients >= 10  # the minimum regime
    chosen = {label: (f"{key}={values[-1]}",) for label, (key, values) in scenario.tune.items()}
    jobs = fidelity.tuned_jobs(scenario, [0, 1, 2]) + fidelity.final_jobs(scenario, [0, 1, 2], chosen)
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs]
    assert {c.strategy.name for c in configs} == {strategy for strategy, _ in scenario.jobs.values()}
    assert {"fedit", "centralized"} <= set(scenario.jobs)  # the two ends of the regime line
    # equal budgets: every strategy of the scenario runs the same rounds, steps and batch
    assert len({(c.train.rounds, c.train.max_steps, c.train.batch_size) for c in configs}) == 1


def test_tuning_points_run_on_the_first_seed_and_the_chosen_point_is_reused_for_every_seed() -> None:
    scenario = fidelity.SCENARIOS["feddr_lora"]
    tuned = fidelity.tuned_jobs(scenario, [3, 4, 5])
    assert {job.seed for job in tuned} == {3}
    assert len(tuned) == sum(len(values) for _, values in scenario.tune.values())
    chosen = {"fedit": ("train.lr=6e-3",)}
    finals = fidelity.final_jobs(scenario, [3, 4, 5], chosen)
    fedit = [job for job in finals if job.strategy == "fedit"]
    # the chosen point's folder: its first-seed run is the tuning run, not a second copy of it
    assert {job.name for job in fedit} == {point_label("fedit", ("train.lr=6e-3",))}
    assert {job.name for job in tuned} >= {job.name for job in fedit}
    assert [job.seed for job in fedit] == [3, 4, 5]
    untuned = [job for job in finals if job.strategy == "fedsa_lora"]
    assert {job.name for job in untuned} == {"fedsa_lora"} and untuned[0].overrides == ()


@pytest.mark.parametrize(
    ("fedit", "reference", "counts"),
    [(0.840, 0.889, True), (0.838, 0.889, False), (0.95, 0.80, True), (math.nan, 0.80, False)],
)
def test_regime_counts_only_when_fedit_is_within_five_points_of_the_reference(
    fedit: float, reference: float, counts: bool
) -> None:
    scenario = fidelity.SCENARIOS["fedhera"]
    table = {"fedit": {"global_accuracy_mean": fedit}, "centralized": {"global_accuracy_mean": reference}}
    facts = fidelity.regime(table, scenario, {})
    assert facts["counts"] is counts
    assert facts["regime_metric"] == "global_accuracy"
    if not math.isnan(fedit):
        assert facts["gap_points"] == pytest.approx(100 * (reference - fedit))


def test_regime_reads_the_tuned_fedit_and_the_scenarios_metric() -> None:
    tree = fidelity.SCENARIOS["fedtreelora"]
    table = {"fedit": {"personalized_accuracy_mean": 0.9, "global_accuracy_mean": 0.3},
             "centralized": {"personalized_accuracy_mean": 0.92, "global_accuracy_mean": 0.9}}
    assert fidelity.regime(table, tree, {})["counts"] is True  # per-task heads: personalised accuracy
    feddr = fidelity.SCENARIOS["feddr_lora"]
    tuned = point_label("fedit", ("train.lr=6e-3",))
    table = {tuned: {"global_accuracy_mean": 0.88}, "fedit": {"global_accuracy_mean": 0.1},
             "centralized": {"global_accuracy_mean": 0.9}}
    facts = fidelity.regime(table, feddr, {"fedit": ("train.lr=6e-3",)})
    assert facts["fedit"] == 0.88 and facts["counts"] is True


def test_unknown_scenario_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main(["--scenario", "fedavg"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unknown scenario 'fedavg'" in err
