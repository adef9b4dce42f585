"""The fidelity benchmark's LLM scenarios (fedhera_llm, fedtreelora_llm): FedHera's budget tiers come
from SmolLM2's layer shapes, and every job of each scenario runs one round on the tiny random Llama
through ``benchmarks/fidelity.py`` (tuning skipped: the first configuration of each job's budget is
taken as chosen), down to the page, the paired table and the regime line on the causal-LM metrics.
"""

from __future__ import annotations

import json
import math
import sys
import tomllib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_benchmark_harness import load

from fedlora.app.jobs import resolve_base
from fedlora.app.tune import TunePlan, plan

fidelity = load("fidelity")
LLM_SCENARIOS = ("fedhera_llm", "fedtreelora_llm")
# Cost cuts for the tiny model: one round, evaluated; few examples and clients; two generated tokens
# (train.max_length stays the scenario's: the chat template's prompt alone is about 41 tokens).
TINY = ("model.path=tiny-llama", "train.rounds=1", "federation.evaluate_every=1", "data.max_examples=300",
        "data.global_test_size=6", "data.num_clients=10", "federation.fraction_evaluate=0.2",
        "train.max_new_tokens=2", "train.rouge_examples=2", "train.eval_batch_size=32")
# FedTreeLoRA needs a warm-up round before its tree: two rounds, evaluated at the second (the jobs
# without the option drop it)
OWN = {"fedtreelora_llm": ("train.rounds=2", "federation.evaluate_every=2", "strategy.warmup_rounds=1")}


def test_fedhera_llm_budget_tiers_are_1_1_times_the_targets_on_smollm2s_layer_shapes() -> None:
    from fedlora.backbones import smollm2_tokenizer_path

    config = tomllib.loads((fidelity.ROOT / "configs/scenarios/fedhera_llm.toml").read_text())
    assert config["model"]["path"] == "smollm2" and "target_modules" not in config["model"]  # q_proj, v_proj
    llama = json.loads((smollm2_tokenizer_path() / "config.json").read_text())  # SmolLM2's own config, no weights
    hidden, head = llama["hidden_size"], llama["head_dim"]
    q_proj = hidden + llama["num_attention_heads"] * head  # d_in + d_out of one layer's q_proj
    v_proj = hidden + llama["num_key_value_heads"] * head  # grouped-query attention: fewer value heads
    unit = llama["num_hidden_layers"] * (q_proj + v_proj)  # official "unit_params", every adapted module
    assert unit == 30 * ((576 + 576) + (576 + 192)) == 57_600
    # the classifier scenario's scaling of the official (r_main, r_tot) targets, tiers low / medium / high
    tiers = {"low": (2, 8), "medium": (4, 12), "high": (8, 16)}
    declared = {t["name"]: t for t in config["clients"]["budget_tiers"]}
    for name, (r_main, r_tot) in tiers.items():
        assert declared[name]["download"] == round(1.1 * r_tot * unit * 4)  # float32 bytes
        assert declared[name]["time"] == round(1.1 * r_main * unit)  # trained parameters (time_unit 1)
    assert [t["share"] for t in config["clients"]["budget_tiers"]] == [0.3, 0.5, 0.2]  # official setting_B
    assert config["clients"]["rank_tiers"] == {"2": 0.3, "4": 0.5, "8": 0.2}  # baselines at each tier's r_main


@pytest.mark.e2e
@pytest.mark.parametrize("name", LLM_SCENARIOS)
def test_every_job_of_an_llm_scenario_runs_one_round_on_the_tiny_llama_and_writes_its_tables(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    scenario = fidelity.scenarios()[name]

    def first_points(scenario, config, seed, out, workers, overrides, on_done=None, finals=None) -> dict[str, TunePlan]:
        plans = {}
        for label, spec in scenario.jobs.items():
            if spec.tuned_as is None:
                p = plan(scenario.budget, spec.knob, lambda point: None)
                plans[label] = TunePlan(points=p.points[:1], chosen=p.points[0])
        return plans

    monkeypatch.setattr(fidelity, "tune_scenario", first_points)
    args = ["--scenario", name, "--seeds", "0", "--workers", "1", "--out", str(tmp_path), "--records", str(tmp_path / "kept")]
    # Execute
    assert fidelity.main([*args, *(a for o in (*TINY, *OWN.get(name, ())) for a in ("--set", o))]) == 0
    # Assert: every job ran its round
    facts = json.loads((tmp_path / "fidelity.json").read_text())
    page = (tmp_path / "fidelity.md").read_text()
    finals = {}
    for label in scenario.jobs:
        chosen = facts["tuning"][label]["chosen"]
        folder = tmp_path / f"{label}[{chosen}]" / "seed0"
        results = json.loads((folder / "results.json").read_text())
        rounds = results["config"]["train"]["rounds"]
        assert [r["round"] for r in results["rounds"] if r["round"] > 0] == list(range(1, rounds + 1)), label
        assert all(r["train_loss"] > 0 for r in results["rounds"] if r["round"] > 0), label  # response tokens trained
        assert results["config"]["model"]["kind"] == "causal_lm" and results["config"]["data"]["seed"] == 0
        finals[label] = results["final"]
        results_table = page.split("## Results")[1].splitlines()
        line = next(line for line in results_table if line.startswith((f"| {label} (", f"| {label} |")))
        # the page's last causal column is this run's own final personalised loss (per response token)
        assert f"| {results['final']['personalized_loss']:.3f} |" in line, label
        rouge = results["final"]["personalized_rouge_l"]
        assert rouge is not None and 0.0 <= rouge <= 1.0, label
    # the page's metrics are the causal LM's: received token accuracy (teacher-forced) and ROUGE-L
    assert "received token acc." in page and "personalised ROUGE-L" in page and "validation loss" in page
    method, lead = scenario.primary
    if name == "fedhera_llm":  # the official received metric, on every sampled client of the round
        federated = [job for job, spec in scenario.jobs.items() if spec.role != "reference"]  # not centralized
        for label in federated:
            assert 0.0 <= finals[label]["received_token_accuracy"] <= 1.0 and finals[label]["received_loss"] > 0
    # the paired primary is the two runs' difference, read back from their results.json
    paired = (tmp_path / "paired.csv").read_text().splitlines()
    row = next(line.split(",") for line in paired if line.startswith(f"{method},{lead},{scenario.metric},True,1,"))
    expected = finals[method][scenario.metric] - finals[lead][scenario.metric]
    assert float(row[7]) == pytest.approx(expected, abs=1e-12)
    # the regime line: FedIT against the centralised reference on the scenario's ROUGE-L
    key = scenario.regime_metric
    assert facts["regime_metric"] == key and "rouge_l" in key
    assert facts["gap_points"] == pytest.approx(100 * (finals["centralized"][key] - finals["fedit"][key]))
    # the learning floor's untrained model, measured on the reference's seed and kept beside the records
    kept = json.loads((tmp_path / "kept" / "untrained" / "seed0" / "untrained.json").read_text())
    assert kept["metric"] == key and facts["untrained"] == kept["value"] and facts["floor_seeds"] == [0]
    if key == "global_rouge_l":  # the zero-shot round 0 every causal run records: the same model, the same score
        reference = json.loads(next(tmp_path.glob("centralized[[]*/seed0/results.json")).read_text())
        assert reference["rounds"][0]["round"] == 0 and kept["value"] == reference["rounds"][0][key]
    assert facts["learned_points"] == pytest.approx(100 * (finals["centralized"][key] - kept["value"]))
    assert facts["device"].startswith("CPU") and math.isfinite(facts["stage_seconds"]["final"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"scenario={name} ")


def test_gpu_is_the_full_version_in_one_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import torch

    calls = []

    def run_scenario(*args):  # records the command's plan, writes an empty page
        calls.append(args)
        args[2].mkdir(parents=True)
        (args[2] / "fidelity.md").write_text("")
        return {"counts": True, "fedit": 0.5, "centralized": 0.5, "gap_points": 0.0}

    scenario = fidelity.scenarios()["fedhera_llm"]  # read from the repository before ROOT moves
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fidelity, "run_scenario", run_scenario)
    monkeypatch.setattr(fidelity, "ROOT", tmp_path)
    # Execute
    assert fidelity.main(["--scenario", "fedhera_llm", "--gpu", "--set", "train.rounds=60"]) == 0
    # Assert: seeds 0..4, every job of a seed at once, the full-size overrides then CUDA then the user's
    name, seeds, out, workers, overrides, _, records, tuning_from = calls[0]
    assert name == "fedhera_llm" and seeds == [0, 1, 2, 3, 4] and workers == len(scenario.jobs) == 7
    assert overrides == [*scenario.gpu, "train.device=cuda", "train.rounds=60"] and "data.num_clients=100" in overrides
    assert out == tmp_path / "runs/fidelity/fedhera_llm-gpu+train.rounds=60"  # apart from the CPU-sized runs
    assert records == tmp_path / "docs/results/records/fedhera_llm-gpu+train.rounds=60"  # and so are its records
    assert tuning_from is None  # the GPU version tunes on its own
    # the final runs go seed by seed, so the 7 workers run one seed's jobs together
    chosen = {label: ("train.lr=0.002",) for label in scenario.jobs}
    order = [job.seed for job in fidelity.final_jobs(scenario, seeds, chosen)]
    assert order == sorted(order) and order[:7] == [0] * 7


def test_gpu_without_cuda_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fidelity.main(["--scenario", "fedtreelora_llm", "--gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--gpu needs a CUDA device" in err


def test_a_causal_lm_run_is_tuned_on_minus_its_lowest_validation_loss() -> None:
    from fedlora.app.tune import validation_score

    causal = {"rounds": [{"round": 0, "validation_loss": None}, {"round": 5, "validation_loss": 2.25},
                         {"round": 10, "validation_loss": 1.75}]}
    assert validation_score(causal) == -1.75  # higher is better, as for accuracy
    assert validation_score({"rounds": [{"validation_accuracy": 0.5, "validation_loss": 0.1}]}) == 0.5
    assert math.isnan(validation_score({"rounds": [{"round": 1}]}))


def test_final_causal_metrics_join_their_runs_rows_and_the_mean_and_std_over_seeds() -> None:
    from types import SimpleNamespace

    def results(seed: int, rouge: float | None) -> dict:
        return {"config": {"train": {"seed": seed}}, "final": {"personalized_rouge_l": rouge}}

    runs = {"fedit": [results(0, 0.25), results(1, 0.75)], "local": [results(0, None)]}
    table = SimpleNamespace(runs=[{"strategy": "fedit", "seed": 1}, {"strategy": "fedit", "seed": 0},
                                  {"strategy": "local", "seed": 0}],
                            rows=[{"strategy": "fedit"}, {"strategy": "local"}])
    # Execute
    fidelity.add_final_metrics(table, runs, ("personalized_rouge_l",))
    # Assert: matched by label and seed, not by position; mean 0.5, sample std sqrt(0.125); a missing value is NaN
    assert [run["personalized_rouge_l"] for run in table.runs[:2]] == [0.75, 0.25]
    assert math.isnan(table.runs[2]["personalized_rouge_l"])
    assert table.rows[0]["personalized_rouge_l_mean"] == 0.5
    assert table.rows[0]["personalized_rouge_l_std"] == pytest.approx(math.sqrt(0.125))
    assert math.isnan(table.rows[1]["personalized_rouge_l_mean"])


def test_the_untrained_model_is_measured_once_per_seed_and_config(tmp_path: Path) -> None:
    # Prepare
    scenario = fidelity.scenarios()["fedtreelora_llm"]  # personalised ROUGE-L: every client's local test
    tiny = [*TINY, *OWN["fedtreelora_llm"]]
    base = resolve_base(str(fidelity.ROOT / scenario.config), [*tiny, "data.num_clients=4"])
    # Execute
    first = fidelity.measure_untrained(scenario, base, [tmp_path], [1])
    kept = json.loads((tmp_path / "untrained" / "seed1" / "untrained.json").read_text())
    # Assert: seed 1's partition and init, kept, read back without measuring, another config measured again
    assert kept["config"]["train"]["seed"] == 1 and kept["config"]["data"]["seed"] == base.data.seed + 1
    assert 0.0 <= first[1] <= 1.0 and kept["value"] == first[1] and kept["metric"] == "personalized_rouge_l"
    assert fidelity.recorded_untrained(scenario, base, tmp_path, [1, 2]) == first
    other = resolve_base(str(fidelity.ROOT / scenario.config), [*tiny, "data.num_clients=6"])
    assert fidelity.recorded_untrained(scenario, other, tmp_path, [1]) == {}
