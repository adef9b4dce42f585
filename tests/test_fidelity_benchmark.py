"""benchmarks/fidelity.py: the issue's rules, without training.

Every scenario's jobs build valid configs at the regime the comparison needs; every job gets the
same tuning budget (a method's knob inside it) and the learning-rate grid widens at its edge; the
chosen configuration is reused for every seed; every seed is a fresh partition shared by the jobs
of that seed; core jobs run >= 5 seeds by default, the others >= 3; the primary comparison is
declared and names jobs. A fake ``run_jobs`` (it writes results.json files with chosen validation
scores instead of training) drives the tuning stage and the whole scenario to its page.
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_benchmark_harness import load

from fedlora.app.jobs import Job, job_config, resolve_base
from fedlora.app.paired import METRIC_NAMES
from fedlora.app.tune import Budget, Knob, plan, point_label, point_value
from fedlora.errors import ConfigError
from fedlora.methods import method

fidelity = load("fidelity")
SCENARIOS = list(fidelity.scenarios())


def default_seeds(scenario) -> list[int]:
    """The seeds a scenario runs without ``--seeds``."""
    return list(scenario.seeds.core)


def interior_chosen(scenario) -> dict[str, tuple[str, ...]]:
    """Each job's plan under scores that peak at the grid's second learning rate (3e-3 for the
    classifier scenarios; interior: no widening)."""
    chosen = {}
    peak = scenario.budget.lr_grid[1]
    for label, spec in scenario.jobs.items():
        result = plan(scenario.budget, spec.knob, lambda p: -abs(math.log(float(point_value(p, "train.lr")) / peak)))
        chosen[label] = result.chosen
    return chosen


# --------------------------------------------------------------------------- configs and jobs
@pytest.mark.parametrize("name", SCENARIOS)
def test_every_job_of_every_scenario_is_a_valid_config_at_the_comparison_regime(name: str, tmp_path: Path) -> None:
    scenario = fidelity.scenarios()[name]
    base = resolve_base(str(fidelity.ROOT / scenario.config))
    # the minimum regime; an LLM scenario's config is CPU-sized, its full version (--gpu) meets it
    full = resolve_base(str(fidelity.ROOT / scenario.config), list(scenario.gpu))
    assert full.train.rounds >= 20 and full.data.num_clients >= 10
    assert scenario.gpu == () or (base.model.kind == "causal_lm" and scenario.causal)
    seeds = default_seeds(scenario)
    jobs = fidelity.final_jobs(scenario, seeds, interior_chosen(scenario))
    for label, spec in scenario.jobs.items():
        jobs += [fidelity.tuning_job(scenario, label, p, seeds[0])
                 for p in plan(scenario.budget, spec.knob, lambda p: None).points]
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs]
    assert {c.strategy.name for c in configs} == {spec.strategy for spec in scenario.jobs.values()}
    assert {"fedit", "centralized"} <= set(scenario.jobs)  # the two ends of the regime line
    # equal training: every job of the scenario runs the same rounds, steps and batch
    assert len({(c.train.rounds, c.train.max_steps, c.train.batch_size) for c in configs}) == 1


@pytest.mark.e2e
@pytest.mark.parametrize("name", [name for name in SCENARIOS if not fidelity.scenarios()[name].causal])
def test_the_weight_share_bound_never_acts_in_a_classifier_scenario(name: str, tmp_path: Path) -> None:
    """The weight-share rule (fedlora/shares.py: faults.max_size_ratio, faults.max_client_share) must
    leave every classifier scenario's aggregation at the plain example weights: on every seed's
    partition, no client is cut to its entitlement and no round's sample reaches the share bound
    (its partition against the smallest others a round can hold)."""
    from fedlora.data.federated import build_federated_data
    from fedlora.schema import sample_size
    from fedlora.shares import client_weights, entitled_sizes

    scenario = fidelity.scenarios()[name]
    base = resolve_base(str(fidelity.ROOT / scenario.config))
    jobs = fidelity.final_jobs(scenario, default_seeds(scenario), interior_chosen(scenario))
    configs = [job_config(base, job, job.run_dir(tmp_path)) for job in jobs if job.strategy != "centralized"]
    partitions = {c.data.model_dump_json(): c for c in configs}.values()
    assert len(partitions) >= len(default_seeds(scenario))  # a fresh partition per seed, each checked
    for config in partitions:
        sizes = sorted(len(client.train) for client in build_federated_data(config.data).clients)
        k = sample_size(len(sizes), config.federation.fraction_train, config.federation.min_clients)
        entitled = entitled_sizes(sizes, config.faults.max_size_ratio).tolist()
        worst_round = [*range(k - 1), len(sizes) - 1]  # the largest client beside the smallest others
        counts = [sizes[i] for i in worst_round]
        weights = client_weights(counts, [entitled[i] for i in worst_round], config.faults.max_client_share)
        assert entitled == sizes and weights.tolist() == counts  # the server's own rule leaves them as they are


def test_every_override_and_knob_is_an_option_of_its_method() -> None:
    for scenario in fidelity.scenarios().values():
        for spec in scenario.jobs.values():
            knob = [f"{spec.knob.key}={v}" for v in spec.knob.values] if spec.knob else []
            for override in (*spec.overrides, *knob):
                key, sep, value = override.partition("=")
                assert sep and value and key.count(".") == 1, override
                if key.startswith("strategy."):
                    assert key.removeprefix("strategy.") in method(spec.strategy).options.model_fields, override


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_ablates_its_method_and_declares_a_primary_comparison(name: str) -> None:
    scenario = fidelity.scenarios()[name]
    method_label, lead = scenario.primary
    assert scenario.jobs[method_label].role == "method" and scenario.jobs[lead].role == "baseline"
    assert any(spec.role == "ablation" for spec in scenario.jobs.values())
    assert scenario.metric in METRIC_NAMES and scenario.primary_why
    core = {label for label, spec in scenario.jobs.items() if spec.core}
    ablations = {label for label, spec in scenario.jobs.items() if spec.role == "ablation"}
    assert {method_label, lead} | ablations <= core
    pairs = fidelity.comparisons(scenario, default_seeds(scenario))
    assert (method_label, lead) in {(p.label, p.baseline) for p in pairs}
    assert all(p.baseline in scenario.jobs and p.label in scenario.jobs for p in pairs)
    assert "centralized" not in {p.baseline for p in pairs}  # the reference is the regime line, not a rival


def test_the_declared_primary_comparisons() -> None:
    primaries = {name: (s.primary, s.metric) for name, s in fidelity.scenarios().items()}
    assert primaries == {
        "fedpissa": (("fedpissa", "feddpa"), "personalized_accuracy"),
        "fedhera": (("fedhera", "flexlora"), "received_accuracy"),
        "feddr_lora": (("feddr_lora", "fedit"), "personalized_accuracy"),
        "fedtreelora": (("fedtreelora", "fedsa_lora"), "personalized_accuracy"),
        "fedtreelora_conflict": (("fedtreelora", "fedsa_lora"), "personalized_accuracy"),
        "fedhera_llm": (("fedhera", "flexlora"), "received_token_accuracy"),
        "fedtreelora_llm": (("fedtreelora", "fedsa_lora"), "personalized_rouge_l"),
    }


# --------------------------------------------------------------------------- the scenarios' data
def test_every_scenario_config_carries_its_plan() -> None:
    configs = sorted(path.stem for path in (fidelity.ROOT / fidelity.SCENARIO_CONFIGS).glob("*.toml"))
    assert sorted(SCENARIOS) == configs and len(configs) == 7
    for name, scenario in fidelity.scenarios().items():
        assert scenario.config == f"{fidelity.SCENARIO_CONFIGS}/{name}.toml"
        base = resolve_base(str(fidelity.ROOT / scenario.config))  # fedlora's loader ignores the table
        assert (base.model.kind == "causal_lm") == scenario.causal, name


def _broken(tmp_path: Path, old: str, new: str) -> Path:
    """configs/scenarios/fedhera.toml with one line of its [fidelity] table changed."""
    text = (fidelity.ROOT / fidelity.SCENARIO_CONFIGS / "fedhera.toml").read_text()
    assert text.count(old) == 1, old
    path = tmp_path / "broken.toml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('note = "r_tot = r_main"', 'notes = "r_tot = r_main"', "jobs.fedhera_coupled.notes: Extra inputs are not permitted"),
        ('role = "reference"', 'role = "referee"', "jobs.centralized.role: Input should be"),
        ('tuned_as = "flexlora"', 'tuned_as = "flexlor"', "jobs.flexlora_bytes_matched.tuned_as: no job 'flexlor'"),
        ('primary = ["fedhera", "flexlora"]', 'primary = ["flexlora", "fedhera"]', "primary: 'flexlora' must be"),
        ('values = ["false", "true"]', 'values = ["a", "b", "c", "d", "e"]', "jobs.fedhera.knob: budget 4 leaves 0 learning rates"),
        ('overrides = ["strategy.coupled=true"]', 'overrides = ["strategy.coupled"]', "expects section.key=value"),
        ("other = 3", "other = 1", "seeds.other: Input should be greater than or equal to 2"),
        ('metric = "received_accuracy"', 'metric = "accuracy"', "metric: unknown metric 'accuracy'"),
        ("[fidelity.jobs.fedit]", "[fidelity.jobs.fedit_]", "jobs must include 'fedit' and 'centralized'"),
    ],
)
def test_a_bad_fidelity_table_is_one_line_naming_the_file_and_the_key(tmp_path: Path, old: str, new: str,
                                                                      message: str) -> None:
    # Prepare
    path = _broken(tmp_path, old, new)
    # Execute
    with pytest.raises(ConfigError) as error:
        fidelity.load_scenario(path)
    # Assert
    assert str(error.value).startswith(f"{path}: [fidelity] ") and message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_command_refuses_a_bad_fidelity_table_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: a scenario folder holding one broken scenario
    _broken(tmp_path, "other = 3", "other = 1")
    monkeypatch.setattr(fidelity, "SCENARIO_CONFIGS", tmp_path)
    fidelity.scenarios.cache_clear()
    try:
        # Execute
        code = fidelity.main(["--scenario", "all", "--status"])
    finally:
        fidelity.scenarios.cache_clear()
    # Assert
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "broken.toml: [fidelity] seeds.other" in err


# --------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("name", SCENARIOS)
def test_core_jobs_run_five_seeds_by_default_and_the_others_three(name: str) -> None:
    scenario = fidelity.scenarios()[name]
    seeds = default_seeds(scenario)
    for label, spec in scenario.jobs.items():
        count = len(fidelity.job_seeds(scenario, label, seeds))
        assert count >= 5 if spec.core else count >= 3, label
    # the paired comparisons use the seeds both sides ran: all five between two core jobs
    for pair in fidelity.comparisons(scenario, seeds):
        both_core = scenario.jobs[pair.label].core and scenario.jobs[pair.baseline].core
        assert pair.seeds == (tuple(seeds) if both_core else tuple(seeds[:3])), pair


@pytest.mark.parametrize("name", ["fedpissa", "fedhera"])
def test_every_seed_is_a_fresh_partition_shared_by_the_jobs_of_that_seed(name: str, tmp_path: Path) -> None:
    scenario = fidelity.scenarios()[name]
    base = resolve_base(str(fidelity.ROOT / scenario.config))
    seeds = default_seeds(scenario)
    jobs = fidelity.final_jobs(scenario, seeds, interior_chosen(scenario))
    by_seed: dict[int, set[int]] = {}
    for job in jobs:
        config = job_config(base, job, job.run_dir(tmp_path))
        assert config.train.seed == job.seed
        by_seed.setdefault(job.seed, set()).add(config.data.seed)
    assert by_seed == {seed: {base.data.seed + seed} for seed in seeds}


# --------------------------------------------------------------------------- tuned alike
@pytest.mark.parametrize("name", SCENARIOS)
def test_every_job_of_a_scenario_gets_the_same_number_of_configurations(name: str) -> None:
    scenario = fidelity.scenarios()[name]
    peak = scenario.budget.lr_grid[1]  # 3e-3 for the classifier scenarios
    for label, spec in scenario.jobs.items():
        result = plan(scenario.budget, spec.knob, lambda p: -abs(math.log(float(point_value(p, "train.lr")) / peak)))
        assert result.chosen is not None and result.widened == 0 and not result.pending, label
        assert len(result.budget_points) == len(result.points) == scenario.budget.size, label
        assert len(set(result.points)) == len(result.points), label
        if spec.knob:  # the knob's other values count inside the budget
            tried = {point_value(p, spec.knob.key) for p in result.points}
            assert tried == set(spec.knob.values), label


def test_a_knob_is_tried_at_the_learning_rate_the_sweep_chose() -> None:
    budget = Budget(size=4, lr_grid=(1.5e-3, 3e-3, 6e-3, 1.2e-2))
    knob = Knob("strategy.beta", ("1.0", "2.0"))
    scores = {("train.lr=0.0015", "strategy.beta=1.0"): 0.70, ("train.lr=0.003", "strategy.beta=1.0"): 0.80,
              ("train.lr=0.006", "strategy.beta=1.0"): 0.75}
    # Execute: the sweep done, the knob's other value is next, at lr 3e-3
    first = plan(budget, knob, scores.get)
    assert first.pending == [("train.lr=0.003", "strategy.beta=2.0")]
    scores[("train.lr=0.003", "strategy.beta=2.0")] = 0.85
    done = plan(budget, knob, scores.get)
    # Assert: four configurations, the knob's value chosen, no widening (3e-3 is interior)
    assert done.chosen == ("train.lr=0.003", "strategy.beta=2.0") and done.widened == 0 and len(done.points) == 4


def test_a_choice_at_the_grid_edge_widens_the_grid_in_that_direction() -> None:
    budget = Budget(size=4, lr_grid=(1.5e-3, 3e-3, 6e-3, 1.2e-2), max_widen=2)
    # scores rising with lr up to 2.4e-2, then falling: the first sweep chooses its top edge
    def score_of(lr: float) -> float:
        return -abs(math.log(lr / 2.4e-2))
    scores: dict = {}
    result = plan(budget, None, scores.get)
    assert result.pending == [(f"train.lr={lr:g}",) for lr in budget.lr_grid]
    runs = 0
    while result.pending:
        for p in result.pending:
            scores[p] = score_of(float(point_value(p, "train.lr")))
            runs += 1
        result = plan(budget, None, scores.get)
    # 1.2e-2 at the edge -> 2.4e-2; at the edge again -> 4.8e-2, which is worse: 2.4e-2 interior
    assert [point_value(p, "train.lr") for p in result.points[4:]] == ["0.024", "0.048"]
    assert result.chosen == ("train.lr=0.024",) and result.widened == 2 and not result.at_edge and runs == 6
    assert len(result.budget_points) == budget.size  # the equal budget, widening reported apart
    # falling scores: widened downward; max_widen bounds it and the choice is reported as still at the edge
    falling = {}
    result = plan(budget, None, falling.get)
    while result.pending:
        falling.update({p: -float(point_value(p, "train.lr")) for p in result.pending})
        result = plan(budget, None, falling.get)
    assert [point_value(p, "train.lr") for p in result.points[4:]] == ["0.00075", "0.000375"]
    assert result.chosen == ("train.lr=0.000375",) and result.at_edge


def _validated(correct: list[int], examples: list[int]) -> dict:
    """A results.json whose one round the clients validated: each client's accuracy as it crosses the
    wire (float32) and the example-weighted mean the server records (strategies/evaluation.py)."""
    import numpy as np

    accuracies = [float(np.float32(c / n)) for c, n in zip(correct, examples)]
    per_client = {str(i): {"val-accuracy": a, "val-examples": float(n)} for i, (a, n) in enumerate(zip(accuracies,
                                                                                                       examples))}
    return {"rounds": [{"round": 1, "validation_accuracy": float(np.average(accuracies, weights=examples)),
                        "per_client": per_client}]}


def test_two_configurations_with_as_many_correct_validation_examples_tie_and_the_earlier_is_chosen() -> None:
    # Prepare: 250 of 288 correct in both, split differently over three clients; the recorded means
    # differ in the 8th digit (float32 client accuracies), the later one higher
    from fedlora.app.tune import choose, validation_score

    earlier, later = _validated([85, 85, 80], [97, 103, 88]), _validated([80, 82, 88], [97, 103, 88])
    assert earlier["rounds"][0]["validation_accuracy"] < later["rounds"][0]["validation_accuracy"]
    # Execute
    scores = {("train.lr=0.006",): validation_score(earlier), ("train.lr=0.012",): validation_score(later)}
    chosen = plan(Budget(size=2, lr_grid=(6e-3, 1.2e-2), max_widen=0), None, scores.get).chosen
    label, _ = choose({"a": [earlier], "b": [later]}, ["a", "b"])
    # Assert: exact counts, a tie, the earlier configuration of the protocol's order
    assert scores[("train.lr=0.006",)] == scores[("train.lr=0.012",)] == 250 / 288
    assert chosen == ("train.lr=0.006",) and label == "a"
    # one more correct example is a difference, not a tie
    assert validation_score(_validated([80, 83, 88], [97, 103, 88])) > validation_score(earlier)


def test_a_causal_lm_validation_loss_within_the_stated_tolerance_is_a_tie() -> None:
    from fedlora.app.tune import LOSS_TIE_TOLERANCE, validation_score

    def run(loss: float) -> dict:
        return {"rounds": [{"round": 1, "validation_loss": loss}]}

    assert validation_score(run(1.7500001)) == validation_score(run(1.7500003)) == -1.75
    assert validation_score(run(1.75)) > validation_score(run(1.75 + 2 * LOSS_TIE_TOLERANCE))


def test_a_diverged_configuration_counts_as_the_worst() -> None:
    budget = Budget(size=2, lr_grid=(1e-3, 2e-3), max_widen=0)
    result = plan(budget, None, {("train.lr=0.001",): 0.5, ("train.lr=0.002",): math.nan}.get)
    assert result.chosen == ("train.lr=0.001",) and result.at_edge


def test_the_chosen_configuration_is_reused_for_every_seed_and_its_tuning_run_is_the_first() -> None:
    scenario = fidelity.scenarios()["feddr_lora"]
    seeds = [3, 4, 5, 6, 7]
    chosen = interior_chosen(scenario)
    finals = fidelity.final_jobs(scenario, seeds, chosen)
    for label in scenario.jobs:
        mine = [job for job in finals if job.name == point_label(label, chosen[label])]
        assert [job.seed for job in mine] == fidelity.job_seeds(scenario, label, seeds)
        assert {job.overrides for job in mine} == {scenario.jobs[label].overrides + chosen[label]}
        assert mine[0] == fidelity.tuning_job(scenario, label, chosen[label], seeds[0])  # same folder, same config


# --------------------------------------------------------------------------- the whole scenario, runs faked
def fake_results(config, label: str, lr: float, seed: int) -> dict:
    """A complete results.json of ``config``: validation peaks at lr 3e-3 (the method's knob adds
    0.01 at its second value), test scores from the label and seed, a mechanism key for the method;
    CPU time (5 minutes) and the machine from seed 1 on, as if the first seed's records predated both."""
    rounds = config.train.rounds
    validation = 0.8 - abs(math.log(lr / 3e-3)) / 10 + (0.01 if "literal" in json.dumps(config.strategy.options()) else 0)
    personal = 0.80 + 0.01 * seed + {"fedpissa": 0.03, "feddpa": 0.01}.get(label, 0.0)
    records = [{"round": r, "validation_accuracy": validation if r % 10 == 0 else None, "bytes_up": 100,
                "bytes_down": 100, "extra": {"relative_correction": 0.01 * r} if label == "fedpissa" else {}}
               for r in range(1, rounds + 1)]
    final = {"personalized_accuracy": personal, "personalized_accuracy_worst": personal - 0.1,
             "global_accuracy": 0.85 if label != "centralized" else 0.86, "received_accuracy": personal - 0.01}
    cpu = {"cpu_seconds": 300.0, "machine": {"cpu": "Test CPU", "cores": 2}} if seed >= 1 else {}
    return {"config": config.model_dump(mode="json"), "rounds": records, "final": final, "wall_seconds": 600.0, **cpu}


@pytest.fixture
def fake_training(monkeypatch: pytest.MonkeyPatch) -> list[Job]:
    """fidelity.run_jobs without training: it writes each job's results.json (and records the job)."""
    ran: list[Job] = []

    def run_jobs(config, jobs, out, engine="inprocess", overrides=(), workers=1, on_done=None):
        base = resolve_base(config, overrides)
        for job in jobs:
            run_dir = job.run_dir(out)
            cfg = job_config(base, job, run_dir)
            from fedlora.app.jobs import is_complete

            if is_complete(run_dir, cfg):
                continue
            ran.append(job)
            run_dir.mkdir(parents=True, exist_ok=True)
            label = fidelity.label_of(job)
            (run_dir / "results.json").write_text(json.dumps(fake_results(cfg, label, cfg.train.lr, job.seed)))
            if on_done is not None:
                on_done(job, run_dir)
        return [job.run_dir(out) for job in jobs]

    monkeypatch.setattr(fidelity, "run_jobs", run_jobs)
    return ran


def test_tuning_stage_runs_the_budget_then_resumes_without_rerunning(fake_training: list[Job], tmp_path: Path) -> None:
    scenario = fidelity.scenarios()["fedpissa"]
    config = str(fidelity.ROOT / scenario.config)
    # Execute
    plans = fidelity.tune_scenario(scenario, config, 0, tmp_path, 1, [])
    first = len(fake_training)
    again = fidelity.tune_scenario(scenario, config, 0, tmp_path, 1, [])
    # Assert: budget 4 for each of the 6 tuned jobs (the ablation reuses the method's choice), peak at 3e-3 (interior), knob's 'literal' better by 0.01
    tuned = [label for label, spec in scenario.jobs.items() if spec.tuned_as is None]
    assert first == 4 * len(tuned) and len(fake_training) == first  # the rerun ran nothing
    assert set(plans) == set(tuned) and "fedpissa_lam0" not in tuned  # the ablation is not tuned
    assert plans["fedpissa"].chosen == ("train.lr=0.003", "strategy.correction=literal")
    assert plans["fedit"].chosen == ("train.lr=0.003",) and again["fedit"].chosen == ("train.lr=0.003",)
    assert {job.seed for job in fake_training} == {0} and all(job.fresh_partition for job in fake_training)


def test_the_final_runs_of_jobs_that_have_chosen_fill_the_last_tuning_round_and_do_not_run_twice(
    fake_training: list[Job], tmp_path: Path
) -> None:
    scenario = fidelity.scenarios()["fedpissa"]
    config = str(fidelity.ROOT / scenario.config)
    seeds = [0, 1, 2, 3, 4]
    # Execute: the tuning stage with its early finals, how far --status says it is, then the final stage
    plans = fidelity.tune_scenario(scenario, config, 0, tmp_path, 2, [],
                                   finals=lambda p: fidelity.early_finals(scenario, p, seeds))
    tuning_stage = list(fake_training)
    status = fidelity.progress("fedpissa", seeds, tmp_path, [])
    finals = fidelity.final_jobs(scenario, seeds, fidelity.choices(scenario, plans))
    fidelity.run_jobs(config, finals, tmp_path)
    final_stage = fake_training[len(tuning_stage):]
    # Assert: the first round is every tuned job's grid (the method's 3 rates at its knob's first value);
    # the second is the method's knob run, then the other tuned jobs' final runs (not their first-seed
    # tuning runs, not the method's or its ablation's, whose choice was not known yet)
    others = [label for label, spec in scenario.jobs.items() if spec.tuned_as is None and label != "fedpissa"]
    first_round = 3 + 4 * len(others)
    assert all(job.seed == 0 for job in tuning_stage[: first_round + 1])
    assert tuning_stage[first_round].overrides == ("train.lr=0.003", "strategy.correction=literal")
    filled = tuning_stage[first_round + 1:]
    expected = [job for job in finals if fidelity.label_of(job) in others and job.seed != 0]
    assert filled == expected and len(filled) == sum(len(fidelity.job_seeds(scenario, label, seeds)) - 1
                                                      for label in others)
    assert status["final_done"] == len(filled) and status["tuning_complete"] == 1
    assert {fidelity.label_of(job) for job in final_stage} == {"fedpissa", "fedpissa_lam0", "fedpissa_lam2"}
    # the method's seeds 1-4, the ablation's 0-4, the strength variant's 0-2 (not a core row)
    assert len(final_stage) == len(seeds) - 1 + len(seeds) + 3


@pytest.mark.e2e
def test_a_scenario_writes_its_page_with_ablation_paired_primary_worst_bytes_times_and_mechanisms(
    fake_training: list[Job], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: the command, 5 seeds, runs faked
    assert fidelity.main(["--scenario", "fedpissa", "--seeds", "0,1,2,3,4", "--out", str(tmp_path), "--no-records"]) == 0
    # Assert
    page = (tmp_path / "fidelity.md").read_text()
    facts = json.loads((tmp_path / "fidelity.json").read_text())
    assert "| fedpissa_lam0 (lambda = 0: B averaged, A local, no correction) | ablation | 5 |" in page
    assert "**fedpissa − feddpa** (primary)" in page and "p (Holm)" in page
    assert "worst client" in page and "MB total" in page and "min / run" in page and "minutes per seed" in page
    # CPU minutes: the mean over the runs that recorded them (seeds 1-4), and how many did
    method_row = next(line for line in page.splitlines() if line.startswith("| fedpissa ("))
    assert method_row.endswith("| 10.0 | 5.0 |")
    cpu_line = re.search(r"recorded by (\d+) of the (\d+) final runs and 0 of the (\d+) tuning runs; older records "
                         r"lack it\): final runs (\d+) CPU-minutes, tuning runs 0\.", page)
    assert cpu_line is not None
    recorded, runs = int(cpu_line[1]), int(cpu_line[2])
    assert 0 < recorded < runs  # the first seed's runs did not record it
    assert int(cpu_line[4]) == 5 * recorded
    # the machines the records name: every run from seed 1 on, the first seed's not
    seed0 = sum(1 for job in fake_training if job.seed == 0)  # its tuning runs and its finals of reused choices
    assert facts["machines"] == {"Test CPU": recorded, "not recorded": seed0}
    assert f"not recorded {seed0}, Test CPU {recorded} runs." in page
    assert "![mechanism](mechanism.png)" in page and (tmp_path / "mechanism.png").stat().st_size > 0
    assert "relative_correction" in page and (tmp_path / "paired.csv").is_file()
    assert facts["primary"] == {"label": "fedpissa", "baseline": "feddpa", "metric": "personalized_accuracy"}
    assert facts["tuning"]["fedit"]["budget"] == 4 and facts["tuning"]["fedit"]["widened"] == 0
    # the paired primary: fedpissa 3 points over feddpa's 1 on every seed (by construction)
    paired = (tmp_path / "paired.csv").read_text().splitlines()
    primary = next(line for line in paired if line.startswith("fedpissa,feddpa,personalized_accuracy,True,5,"))
    assert ",0.02" in primary  # mean difference 0.02 (floating point prints 0.0199... or 0.0200...)
    out = capsys.readouterr().out
    assert f"results: {tmp_path}/fidelity.md" in out and out.strip().splitlines()[-1].startswith("scenario=fedpissa")
    runs_per_seed = {seed: sum(1 for job in fake_training if job.seed == seed) for seed in range(5)}
    assert runs_per_seed[3] == runs_per_seed[4] == 3  # core only: fedpissa, its ablation, feddpa


# --------------------------------------------------------------------------- records
@pytest.mark.e2e
def test_every_finished_run_is_kept_as_a_record_and_a_fresh_folder_continues_from_them(
    fake_training: list[Job], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    records, first, second = tmp_path / "records", tmp_path / "first", tmp_path / "second"
    args = ["--scenario", "fedpissa", "--seeds", "0,1,2", "--records", str(records)]
    # Execute: --status before anything ran, the protocol once, again into an empty output folder, --status
    assert fidelity.main([*args, "--status"]) == 0
    before = capsys.readouterr().out
    assert fidelity.main([*args, "--out", str(first)]) == 0
    ran = len(fake_training)
    assert fidelity.main([*args, "--out", str(second)]) == 0
    capsys.readouterr()
    assert fidelity.main([*args, "--status"]) == 0
    after = capsys.readouterr().out
    # Assert: one record per run, byte for byte the run's results.json; the second command ran nothing
    kept = sorted(p.relative_to(records) for p in records.glob("*/seed*/results.json"))
    made = sorted(p.relative_to(first) for p in first.glob("*/seed*/results.json"))
    assert len(kept) == ran > 0 and kept == made
    assert all((records / k).read_bytes() == (first / k).read_bytes() for k in kept)
    assert len(fake_training) == ran
    assert (second / "summary.csv").read_text() == (first / "summary.csv").read_text()
    # the status counts what the records hold: nothing, then every run (tuning and final)
    tuned = sum(1 for spec in fidelity.scenarios()["fedpissa"].jobs.values() if spec.tuned_as is None)
    row_before = next(line for line in before.splitlines() if line.startswith("| fedpissa |"))
    row_after = next(line for line in after.splitlines() if line.startswith("| fedpissa |"))
    assert row_before.startswith("| fedpissa | 0 | ") and "| 0 / " in row_before and "(complete)" not in row_before
    final = ran - 4 * tuned
    # and their CPU time: the fake runs of seeds 1 and 2 recorded 300 s each, those of seed 0 nothing
    timed = sum(1 for k in kept if k.parent.name != "seed0")
    assert 0 < timed < ran
    assert row_after.startswith(f"| fedpissa | {4 * tuned} | 0 | {final} / {final} (complete) "
                                f"| {timed * 300 / 3600:.1f} ({timed} of {ran} runs recorded it) | ")
    # and the regime from the records: the untrained model was measured on the reference's seeds and kept
    assert sorted(p.parent.name for p in records.glob("untrained/seed*/untrained.json")) == ["seed0", "seed1", "seed2"]
    assert re.search(r"\| (counts|does not count)[^|]*\|$", row_after), row_after


@pytest.mark.e2e
def test_a_precision_check_runs_every_seed_at_the_choices_of_another_folder_s_tuning(
    fake_training: list[Job], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the fp32 protocol complete in its records; in bf16, FedPISSA's runs lose 2 points
    fp32, bf16 = tmp_path / "fp32", tmp_path / "bf16"
    seeds = ["--scenario", "fedpissa", "--seeds", "0,1,2"]
    assert fidelity.main([*seeds, "--records", str(fp32), "--out", str(tmp_path / "out32")]) == 0
    fake_training.clear()

    def in_bf16(config, label, lr, seed, fp32_results=fake_results):
        results = fp32_results(config, label, lr, seed)
        if label == "fedpissa" and config.train.precision == "bf16":
            results["final"]["personalized_accuracy"] -= 0.02
        return results

    monkeypatch.setattr(sys.modules[__name__], "fake_results", in_bf16)
    check = [*seeds, "--set", "train.precision=bf16", "--tuning-from", str(fp32), "--records", str(bf16)]
    # Execute: the same scenario in bf16 at fp32's choices; its status before and after
    assert fidelity.main([*check, "--status"]) == 0
    before = capsys.readouterr().out
    assert fidelity.main([*check, "--out", str(tmp_path / "out16")]) == 0
    capsys.readouterr()
    assert fidelity.main([*check, "--status"]) == 0
    after = capsys.readouterr().out
    # Assert: no tuning ran; every job ran at fp32's choice on every one of its seeds, in bf16
    scenario = fidelity.scenarios()["fedpissa"]
    chosen = fidelity.choices(scenario, fidelity.tuning_in(scenario, str(fidelity.ROOT / scenario.config), 0, fp32))
    planned = fidelity.final_jobs(scenario, [0, 1, 2], chosen)
    assert sorted((j.name, j.seed) for j in fake_training) == sorted((j.name, j.seed) for j in planned)
    assert chosen["fedpissa"] == ("train.lr=0.003", "strategy.correction=literal")
    kept = list(bf16.glob("*/seed*/results.json"))
    assert len(kept) == len(planned)
    assert {json.loads(k.read_text())["config"]["train"]["precision"] for k in kept} == {"bf16"}
    assert "| fedpissa | 0 | 0 | 0 / " in before and f"| fedpissa | 0 | 0 | {len(planned)} / {len(planned)} (complete) |" in after
    page = (tmp_path / "out16" / "fidelity.md").read_text()
    assert f"--tuning-from {fp32}" in page and "Not run by this command" in page
    # the section against fp32: the primary's +2 points vanish in bf16, so neither inside nor the same
    # conclusion; over FedIT +3 become +1: not inside, yet the same conclusion (above 0 both);
    # run against run, FedPISSA -2.00, FeddPA 0
    section = page.split("## Against")[1].split("## Mechanisms")[0]
    assert "| fedpissa − feddpa | 3 | +0.00 [+0.00, +0.00] | +2.00 [+2.00, +2.00] | +2.00 [+2.00, +2.00] (3) | no | no |" \
        in section
    assert "| fedpissa | 3 | -2.00 | 2.00 |" in section and "| feddpa | 3 | +0.00 | 0.00 |" in section
    assert "| fedpissa − fedit | 3 | +1.00 [+1.00, +1.00] | +3.00 [+3.00, +3.00] | +3.00 [+3.00, +3.00] (3) | no | yes |" \
        in section
    # and a folder without that complete tuning is one line, exit 2
    assert fidelity.main([*check[:-2], "--tuning-from", str(tmp_path), "--status"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_record_of_another_config_is_never_overwritten(tmp_path: Path) -> None:
    # Prepare: an fp32 record, and a finished bf16 run of the same job and seed
    from fedlora.config import load_config

    config = load_config(fidelity.ROOT / "configs/smoke.toml", ["train.rounds=1"]).model_dump(mode="json")
    record, run = tmp_path / "records/fedit/seed0", tmp_path / "out/fedit/seed0"
    for folder, precision in ((record, "fp32"), (run, "bf16")):
        folder.mkdir(parents=True)
        config["train"]["precision"] = precision
        (folder / "results.json").write_text(json.dumps({"config": config, "rounds": [{"round": 1}]}))
    before = (record / "results.json").read_bytes()
    # Execute
    fidelity.keep_record(tmp_path / "records", tmp_path / "out", run)
    # Assert: the record is untouched
    assert (record / "results.json").read_bytes() == before
    # ... while a run of the same config (here: a later rerun of it) replaces it
    config["train"]["precision"] = "fp32"
    (run / "results.json").write_text(json.dumps({"config": config, "rounds": [{"round": 1}], "wall_seconds": 5}))
    fidelity.keep_record(tmp_path / "records", tmp_path / "out", run)
    assert (record / "results.json").read_bytes() == (run / "results.json").read_bytes() != before


def fedhera_now():
    """The config each fedhera run folder's job runs today (:func:`fidelity.config_now`)."""
    scenario = fidelity.scenarios()["fedhera"]
    return functools.partial(fidelity.config_now, scenario, resolve_base(str(fidelity.ROOT / scenario.config)))


def write_complete_run(current, root: Path, run: str, **train: object) -> None:
    """A results.json with every round, of the config ``current`` gives the folder ``run``
    (``train``: keys of an earlier setting)."""
    config = {**current(Path(run)), "output": {"dir": str(root / run)}}
    config["train"] = {**config["train"], **train}
    (root / run).mkdir(parents=True)
    rounds = [{"round": r} for r in range(1, config["train"]["rounds"] + 1)]
    (root / run / "results.json").write_text(json.dumps({"config": config, "rounds": rounds}))


def test_after_a_setting_changes_only_runs_of_the_new_one_are_kept_or_restored(tmp_path: Path) -> None:
    # Prepare: fedhera's jobs as declared now (100 rounds, the rate halved from round 61), and an
    # output folder that also holds complete runs of its earlier setting (60 rounds, constant rate),
    # whose checkpoints are what lets the runs continue to 100 rounds
    current = fedhera_now()
    records, out = tmp_path / "records", tmp_path / "out"
    write = functools.partial(write_complete_run, current)
    write(out, "fedit[train.lr=0.006]/seed1")                                       # the new setting
    write(out, "fedit[train.lr=0.003]/seed0", rounds=60, lr_decay_rounds=[])       # the earlier one
    write(records, "flexlora[train.lr=0.003]/seed0")                                # the new setting
    write(records, "flexlora[train.lr=0.006]/seed0", rounds=60, lr_decay_rounds=[])  # the earlier one
    # Execute
    restored, kept = fidelity.sync_records(records, out, current)
    # Assert: the earlier setting's run stays out of the records (a record there would block its
    # 100-round run's: keep_record never overwrites another config's), and its record stays out of
    # the output folder; the new setting's move both ways
    assert (restored, kept) == (1, 1)
    assert (records / "fedit[train.lr=0.006]/seed1/results.json").is_file()
    assert not (records / "fedit[train.lr=0.003]").exists()
    assert (out / "flexlora[train.lr=0.003]/seed0/results.json").is_file()
    assert not (out / "flexlora[train.lr=0.006]").exists()
    # ... and without the check (as before 2026-12-07) the earlier setting's run was kept
    assert fidelity.sync_records(records, out) == (1, 1)
    assert (records / "fedit[train.lr=0.003]/seed0/results.json").is_file()
    # a folder that names no job of the scenario is no run of it
    assert current(Path("nojob[train.lr=0.1]/seed0")) is None and current(Path("fedit[train.lr=0.1]/x")) is None


def test_the_status_counts_runs_ahead_of_their_jobs_tuning_as_waiting_not_as_done(tmp_path: Path) -> None:
    # Prepare: fedhera records with FedIT's and the reference's tuning not complete: a tuning run of
    # the grid, final runs at a rate not chosen yet, a widened grid's point, and runs that are no
    # run of the plan (an earlier setting, a seed it does not have)
    write = functools.partial(write_complete_run, fedhera_now(), tmp_path)
    write("fedit[train.lr=0.006]/seed0")                     # a tuning run (the grid's 6e-3)
    write("fedit[train.lr=0.006]/seed1")                     # waiting: a final run before the choice
    write("fedit[train.lr=0.006]/seed2")                     # waiting
    write("centralized[train.lr=0.00075]/seed0")             # waiting: a widening point
    write("fedit[train.lr=0.003]/seed1", rounds=60, lr_decay_rounds=[])  # an earlier setting
    write("fedit[train.lr=0.006]/seed7")                     # fedit runs seeds 0-2
    # Execute
    status = fidelity.progress("fedhera", None, tmp_path, [])
    table = fidelity.progress_table({"fedhera": tmp_path}, None, [])
    # Assert
    assert (status["tuning_done"], status["final_done"], status["waiting"]) == (1, 0, 3)
    assert "| fedhera | 1 |" in table and "0 / 29 (+3 waiting for their job's tuning)" in table


def test_a_run_of_an_earlier_setting_is_reported_once_by_the_stage_that_continues_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: a fedhera tuning run of the 60-round setting in the output folder
    from fedlora.app.jobs import is_complete

    scenario = fidelity.scenarios()["fedhera"]
    base = resolve_base(str(fidelity.ROOT / scenario.config))
    write_complete_run(fedhera_now(), tmp_path, "fedit[train.lr=0.006]/seed0", rounds=60, lr_decay_rounds=[])
    job = fidelity.tuning_job(scenario, "fedit", ("train.lr=0.006",), 0)
    # Execute: what reads the folder to plan or count (the tuning plan, --status), then the check
    # the job runner makes before it continues the run
    with caplog.at_level("WARNING"):
        plans = fidelity.plans_in(scenario, base, 0, tmp_path)
        fidelity.progress("fedhera", None, tmp_path, [])
        quiet = [r.getMessage() for r in caplog.records]
        complete = is_complete(job.run_dir(tmp_path), job_config(base, job, job.run_dir(tmp_path)), report=True)
    # Assert: not a run of the plan, said once, by the runner's check only
    assert ("train.lr=0.006",) in plans["fedit"].pending and not complete
    assert quiet == [] and ["different config" in r.getMessage() for r in caplog.records] == [True]


def committed_records() -> list[tuple[str, str, Path]]:
    """(scenario, job folder, seed folder) of every committed record: a scenario's own folder and
    its folders of overrides (``<scenario>+<overrides>``, :func:`fidelity.records_dir`)."""
    root = fidelity.ROOT / fidelity.RECORDS
    folders = [(name, folder) for name in fidelity.scenarios() for folder in sorted(root.glob(f"{name}*"))
               if folder.is_dir() and folder.name.partition("+")[0] == name]
    return [(name, seed.parent.name, seed) for name, folder in folders
            for seed in sorted(folder.glob("*/seed*")) if (seed / "results.json").is_file()]


def folder_overrides(seed_dir: Path) -> list[str]:
    """The ``--set`` overrides a records folder ``<scenario>+<overrides>`` was named after."""
    tag = seed_dir.parent.parent.name.partition("+")[2]
    return re.split(r"_(?=[a-z]+\.[a-z_]+=)", tag) if tag else []


def test_folder_overrides_read_back_what_records_dir_wrote() -> None:
    overrides = ["train.precision=bf16", "train.device=cuda", "strategy.robust_loss=all"]
    folder = fidelity.records_dir(None, "feddr_lora", False, overrides)
    assert sorted(folder_overrides(folder / "job" / "seed0")) == sorted(overrides)
    # a list keeps its brackets and commas (a record of another learning-rate schedule)
    overrides = ["train.rounds=60", "train.lr_decay_rounds=[]", "train.lr_decay_rounds=[20,40]"]
    folder = fidelity.records_dir(None, "fedhera", False, overrides)
    assert folder.name == "fedhera+train.lr_decay_rounds=[20,40]_train.lr_decay_rounds=[]_train.rounds=60"
    assert sorted(folder_overrides(folder / "job" / "seed0")) == sorted(overrides)


@pytest.mark.parametrize(("name", "folder", "seed_dir"), committed_records(),
                         ids=[f"{s.parent.parent.name}/{f}/{s.name}" for n, f, s in committed_records()])
def test_every_committed_record_is_still_a_complete_run_of_its_job(name: str, folder: str, seed_dir: Path) -> None:
    # Prepare: the job the record's folder names, built as the command builds it today
    scenario = fidelity.scenarios()[name]
    job = fidelity.folder_job(scenario, Path(folder) / seed_dir.name)
    assert job is not None, f"{seed_dir} names no job of the scenario"
    config = job_config(resolve_base(str(fidelity.ROOT / scenario.config), folder_overrides(seed_dir)), job, seed_dir)
    # Assert: an option added since (RECORD_DEFAULTS) must not silently turn a record into a rerun
    from fedlora.app.jobs import is_complete

    assert is_complete(seed_dir, config), f"{seed_dir} no longer matches its job's config: declare the new option's " \
                                          "earlier value in fedlora.schema.RECORD_DEFAULTS"


@pytest.mark.e2e
def test_the_status_counts_every_committed_record_as_a_complete_planned_run(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the committed records of each scenario's own folder
    root = fidelity.ROOT / fidelity.RECORDS
    recorded = {name: len(list((root / name).glob("*/seed*/results.json")))
                for name in fidelity.scenarios() if (root / name).is_dir()}
    assert recorded, "the repository holds committed records"
    # Execute: the command's --status (it reads the records and runs nothing)
    assert fidelity.main(["--scenario", "all", "--status"]) == 0
    rows = {cells[0]: cells for line in capsys.readouterr().out.splitlines() if line.startswith("| ")
            if (cells := [cell.strip() for cell in line.strip("|").split("|")])}
    # Assert: every record is a run the plan counts as done, in the tuning stage or among the final
    # runs, or a complete run of today's config at a configuration the plan no longer chooses (a record
    # of a job, seed or config the plan no longer has counts nowhere)
    for name, count in recorded.items():
        tuning_done, final_done = int(rows[name][1]), int(rows[name][3].split("/")[0])
        waiting, outside = (re.search(rf"\+(\d+) {word}", rows[name][3]) for word in ("waiting", "outside"))
        extra = sum(int(found[1]) for found in (waiting, outside) if found)
        assert tuning_done + final_done + extra == count, (name, rows[name], count)
    # the tie rule's correction (2026-12-07) left FedIT's runs at 0.012 and 0.024 outside feddr_lora's plan
    assert "(+5 outside the plan" in rows["feddr_lora"][3]


def test_overrides_keep_their_records_apart() -> None:
    assert fidelity.records_dir(None, "fedpissa", False) == fidelity.ROOT / "docs/results/records/fedpissa"
    assert fidelity.records_dir(None, "fedpissa", False, ["train.precision=bf16", "train.device=cuda"]) == (
        fidelity.ROOT / "docs/results/records/fedpissa+train.device=cuda_train.precision=bf16")
    assert fidelity.records_dir(None, "x", False, ["model.path='/m'"]).name == "x+model.path=--m-"
    # the default output folder is named the same way (tagged), so a bf16 run never meets an fp32 run's folder
    assert fidelity.tagged("fedpissa") == "fedpissa"
    assert fidelity.tagged("fedpissa", ["train.precision=bf16"]) == "fedpissa+train.precision=bf16"


def test_the_page_reads_the_trees_agreement_with_the_task_groups_from_the_recorded_clusters(tmp_path: Path) -> None:
    # Prepare: a FedTreeLoRA record on 6 clients in 2 groups ({0,1,2}, {3,4,5}), written before the
    # ARI was recorded: block 0 one cluster, block 1 the groups; rounds 2 and 3 have the tree
    run = tmp_path / "fedtreelora[train.lr=0.003]" / "seed1"
    run.mkdir(parents=True)
    config = {"data": {"partition": "grouped", "num_clients": 6, "num_groups": 2}, "train": {"seed": 1}}
    clusters = {"0": dict.fromkeys(map(str, range(6)), 0), "1": {str(k): int(k >= 3) for k in range(6)}}
    rounds = [{"round": 1, "extra": {"phase": "warmup"}}] + [
        {"round": r, "extra": {"phase": "tree", "cuts": [1, 2], "clusters": clusters}} for r in (2, 3)]
    (run / "results.json").write_text(json.dumps({"strategy": "fedtreelora", "config": config, "rounds": rounds}))
    # Execute
    rows = fidelity.tree_agreement_rows(tmp_path)
    # Assert
    assert rows == [{"run": "fedtreelora[train.lr=0.003]", "seed": 1, "cuts": [1, 2], "ari": [0.0, 1.0],
                     "rounds": "2 of 2"}]


# --------------------------------------------------------------------------- the regime rule
@pytest.mark.parametrize(
    ("fedit", "reference", "counts"),
    [(0.840, 0.889, True), (0.838, 0.889, False), (0.95, 0.80, True)],
)
def test_regime_counts_only_when_fedit_is_within_five_points_of_the_reference(
    fedit: float, reference: float, counts: bool
) -> None:
    # Prepare: the reference learned far more than the floor, so the gap alone decides
    scenario = fidelity.scenarios()["fedhera"]
    # Execute
    facts = fidelity.regime_facts(scenario, {0: fedit}, {0: reference}, {0: 0.125})
    # Assert
    assert facts["counts"] is counts
    assert facts["regime_metric"] == "global_accuracy"
    assert facts["gap_points"] == pytest.approx(100 * (reference - fedit))
    assert ("points above FedIT" in facts["why"]) is not counts


def test_a_scenario_whose_reference_learns_less_than_the_floor_does_not_count() -> None:
    # Prepare: fedhera_llm's first reading (10 rounds of 2 steps of 4): FedIT 0.1924 and the reference
    # 0.1912 global ROUGE-L, the zero-shot model 0.1502: the 5-point rule passes, little was learned
    scenario = fidelity.scenarios()["fedhera_llm"]
    assert scenario.regime.floor_points == 2 * scenario.regime.max_gap_points == 10.0
    # Execute
    facts = fidelity.regime_facts(scenario, {0: 0.1924}, {0: 0.1912}, {0: 0.1502})
    # Assert
    assert facts["gap_points"] == pytest.approx(-0.12) and facts["learned_points"] == pytest.approx(4.10)
    assert facts["counts"] is False
    assert facts["why"] == ("the reference learned +4.1 points over the untrained model (at least 10: too little is "
                            "learned to compare)")
    line = fidelity.regime_line(facts, f"does NOT count: {facts['why']}")
    assert "learned +4.1 points (at least 10)" in line and "does NOT count" in line
    # just above the floor it counts; without the untrained model it is not known
    assert fidelity.regime_facts(scenario, {0: 0.26}, {0: 0.2503}, {0: 0.1502})["counts"] is True
    unknown = fidelity.regime_facts(scenario, {0: 0.26}, {0: 0.2502}, {})
    assert unknown["counts"] is False and "not measured" in unknown["why"]


def test_the_regime_compares_fedit_and_the_reference_on_the_seeds_both_ran() -> None:
    # Prepare: FedIT is a core job (5 seeds), the reference ran 3; seed 3 and 4 favour FedIT
    scenario = fidelity.scenarios()["feddr_lora"]
    fedit = {0: 0.80, 1: 0.82, 2: 0.84, 3: 0.99, 4: 0.99}
    reference = {0: 0.86, 1: 0.88, 2: 0.90}
    # Execute
    facts = fidelity.regime_facts(scenario, fedit, reference, {0: 0.1, 1: 0.1, 2: 0.1})
    # Assert: the 5-seed mean (0.888) would pass; on the shared seeds FedIT is 6 points under
    assert facts["regime_seeds"] == [0, 1, 2] and facts["fedit"] == pytest.approx(0.82)
    assert facts["gap_points"] == pytest.approx(6.0) and facts["counts"] is False


def test_regime_reads_the_scenarios_metric() -> None:
    tree = fidelity.scenarios()["fedtreelora"]
    runs = [{"strategy": "fedit", "seed": 0, "personalized_accuracy": 0.9, "global_accuracy": 0.3},
            {"strategy": "centralized", "seed": 0, "personalized_accuracy": 0.92, "global_accuracy": 0.9}]
    table = type("Table", (), {"runs": runs})()
    facts = fidelity.regime(table, tree, {0: 0.2})  # per-task heads: personalised accuracy
    assert facts["counts"] is True and facts["fedit"] == 0.9 and facts["untrained"] == 0.2


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--scenario", "fedavg"], "unknown scenario 'fedavg'"), (["--scenario", "fedhera", "--seeds", "0,0"], "--seeds"),
     (["--scenario", "fedhera", "--other-seeds", "1"], "--other-seeds")],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert fidelity.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


@pytest.mark.parametrize("name", SCENARIOS)
def test_ablations_run_at_their_methods_choice_with_their_own_keys_winning(name: str) -> None:
    # Prepare: every tuned label chose an interior point; the method also chose its knob's second value
    scenario = fidelity.scenarios()[name]
    plans = {}
    for label, spec in scenario.jobs.items():
        if spec.tuned_as is None:
            point = ("train.lr=0.003",) + ((f"{spec.knob.key}={spec.knob.values[-1]}",) if spec.knob else ())
            plans[label] = fidelity.TunePlan(points=[point], chosen=point)
    # Execute
    chosen = fidelity.choices(scenario, plans)
    # Assert: every ablation is tuned as its method; it takes the method's lr (and knob unless it fixes
    # that key itself), and its final overrides never set one key twice
    for label, spec in scenario.jobs.items():
        if spec.role == "ablation":
            assert spec.tuned_as == scenario.method, label
        if spec.tuned_as is None:
            assert chosen[label] == plans[label].chosen
            continue
        base = plans[spec.tuned_as].chosen
        fixed = {o.partition("=")[0] for o in spec.overrides}
        assert chosen[label] == tuple(o for o in base if o.partition("=")[0] not in fixed), label
        keys = [o.partition("=")[0] for o in spec.overrides + chosen[label]]
        assert len(keys) == len(set(keys)) and "train.lr=0.003" in chosen[label], label
    if name == "fedtreelora":  # the fixed-lambda ablation keeps mixing_lr = 0, not the method's 0.5 / 0.1
        assert chosen["fedtreelora_fixed_lam"] == ("train.lr=0.003",)


def test_the_console_is_quiet_like_fedlora_s_and_timestamped() -> None:
    import io
    import logging

    # Prepare
    stream = io.StringIO()
    handler = fidelity.console_handler(stream)
    # Execute: a classifier's load report (listed noise), a fedlora line, another library's warning
    for name, level, message in (("transformers.modeling_utils", logging.WARNING, "BertModel LOAD REPORT from: x"),
                                 ("fedlora", logging.INFO, "fidelity: tuning, 3 configuration(s)"),
                                 ("torch", logging.WARNING, "a warning nobody listed")):
        handler.handle(logging.LogRecord(name, level, "/elsewhere/lib.py", 1, message, None, None))
    # Assert
    lines = stream.getvalue().splitlines()
    assert [line.split(" ", 2)[2] for line in lines] == ["fidelity: tuning, 3 configuration(s)", "a warning nobody listed"]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", line) for line in lines)
