"""Fair evaluation protocol: references through compare, validation-based selection, tuning."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fedlora.app.compare import compare
from fedlora.app.runner import run_inprocess
from fedlora.app.tune import tune
from fedlora.config import load_config
from fedlora.data import build_federated_data
from fedlora.results import machine

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


@pytest.mark.slow
def test_references_run_through_compare_with_both_averages(tmp_path: Path) -> None:
    # Execute: the centralised and local references beside a federated method
    table = compare(SMOKE, ["centralized", "local", "fedit"], seeds=(0,), out_dir=tmp_path, engine="inprocess", plots=False)
    # Assert: every run carries weighted and unweighted personalised means, best-on-validation and the config hash
    assert set(table.strategies) == {"centralized", "local", "fedit"}
    for name in table.strategies:
        results = json.loads((tmp_path / name / "seed0" / "results.json").read_text())
        final = results["final"]
        assert {"personalized_accuracy", "personalized_accuracy_unweighted", "best_round"} <= set(final)
        assert len(results["config_hash"]) == 12 and results["versions"]["flwr"] == "1.39.0"
        # ... and the machine that ran it (the CPU as /proc/cpuinfo names it, its cores; no GPU here)
        assert results["machine"]["cpu"] == machine()["cpu"] != "" and results["machine"]["cores"] == os.cpu_count()
        assert "gpu" not in results["machine"]
    assert (tmp_path / "summary.md").is_file()


def test_selection_never_reads_test_labels(tmp_path: Path) -> None:
    # Prepare: the same run twice, the second with every test label permuted
    overrides = ["train.rounds=4", "data.max_examples=900", "train.max_steps=8"]
    plain = run_inprocess(load_config(SMOKE, overrides), tmp_path / "plain")
    shuffled = run_inprocess(load_config(SMOKE, [*overrides, "data.shuffle_test_labels=true"]), tmp_path / "shuffled")
    # Assert: the test labels really were permuted, yet the validation curve and the chosen round are identical
    data = {flag: build_federated_data(load_config(SMOKE, [*overrides, f"data.shuffle_test_labels={flag}"]).data) for flag in ("false", "true")}
    assert data["false"].global_test["label"][:] != data["true"].global_test["label"][:]
    assert data["false"].client(0).test["label"][:] != data["true"].client(0).test["label"][:]
    assert data["false"].client(0).val["label"][:] == data["true"].client(0).val["label"][:]
    assert [r.validation_accuracy for r in plain.rounds] == [r.validation_accuracy for r in shuffled.rounds]
    assert plain.best_on_validation().round == shuffled.best_on_validation().round


@pytest.mark.slow
def test_tune_picks_a_setting_per_strategy_on_validation(tmp_path: Path) -> None:
    # Execute: a two-value grid for two strategies
    table = tune(SMOKE, ["fedit", "flexlora"], {"train.lr": [1e-4, 1e-2]}, out_dir=tmp_path, engine="inprocess")
    # Assert
    record = json.loads((tmp_path / "tuning.json").read_text())
    assert set(record["strategies"]) == {"fedit", "flexlora"}
    for strategy, info in record["strategies"].items():
        assert info["chosen"] in info["validation_scores"]
        assert info["chosen"].startswith(f"{strategy}[train.lr=")
        best = max(info["validation_scores"].values())
        assert info["validation_scores"][info["chosen"]] == best
    summary = (tmp_path / "summary.md").read_text()
    assert "chosen on validation" in summary
    assert len(table.strategies) == 2
