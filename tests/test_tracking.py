"""Experiment tracking: the TensorBoard event files and the MLflow run of a real run, read back and
checked against its results.json; resume purges the events after the resumed round; compare
writes mean-over-seeds curves beside the per-seed ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedlora.app.runner import run
from fedlora.app.tracking import ROUND_METRICS, Tracker, write_mean_curves
from fedlora.config import load_config
from fedlora.results import RoundRecord

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


def read_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``folder``: tag -> [(step, value)] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: sorted((event.step, event.value) for event in accumulator.Scalars(tag))
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """One 2-round smoke run (FedSA-LoRA: global and personalised metrics) with MLflow on a sqlite file."""
    tmp = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{tmp / 'store' / 'mlflow.db'}"
    (tmp / "store").mkdir()
    results = run(
        SMOKE,
        overrides=["strategy.name=fedsa_lora", f'output.mlflow_uri="{uri}"', 'output.mlflow_experiment="tests"'],
        out_dir=tmp / "run",
        engine="inprocess",
    )
    return tmp / "run", tmp / "store", results


def test_tensorboard_event_files_hold_every_round_of_results_json(tracked_run) -> None:
    # Prepare
    out, _store, results = tracked_run

    # Execute
    scalars = read_scalars(out / "tensorboard")

    # Assert: every measured metric of every round, with the values of results.json
    rounds = results["rounds"]
    assert len(rounds) == 2
    for field, tag in ROUND_METRICS.items():
        expected = [(r["round"], float(r[field])) for r in rounds if r[field] is not None and math.isfinite(r[field])]
        assert [step for step, _ in scalars.get(tag, [])] == [step for step, _ in expected], tag
        for (_, got), (_, want) in zip(scalars.get(tag, []), expected, strict=True):
            assert got == pytest.approx(want, rel=1e-6), tag
    assert len(scalars["accuracy/global"]) == 2 and len(scalars["accuracy/personalised"]) == 2
    for record in rounds:  # per client: its local accuracy
        assert record["per_client"], record["round"]
        for partition, metrics in record["per_client"].items():
            values = dict(scalars[f"client/{partition}/accuracy"])
            assert values[record["round"]] == pytest.approx(metrics["accuracy"], rel=1e-6)


def test_mlflow_run_has_config_params_round_metrics_and_artifacts(tracked_run) -> None:
    from mlflow.tracking import MlflowClient

    # Prepare
    out, store, results = tracked_run
    run_id = json.loads((out / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{store / 'mlflow.db'}")

    # Execute
    mlrun = client.get_run(run_id)
    history = client.get_metric_history(run_id, "accuracy/personalised")
    artifacts, folders = set(), [None]
    while folders:  # every artifact file, recursively
        for info in client.list_artifacts(run_id, folders.pop()):
            (folders.append(info.path) if info.is_dir else artifacts.add(info.path))

    # Assert
    assert mlrun.info.status == "FINISHED"
    assert client.get_experiment(mlrun.info.experiment_id).name == "tests"
    assert mlrun.data.params["config_hash"] == results["config_hash"]
    assert mlrun.data.params["strategy.name"] == "fedsa_lora"
    assert float(mlrun.data.params["train.lr"]) == results["config"]["train"]["lr"]
    assert mlrun.data.tags["strategy"] == "fedsa_lora"
    assert sorted(m.step for m in history) == [r["round"] for r in results["rounds"]]
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == pytest.approx(
        [r["personalized_accuracy"] for r in results["rounds"]]
    )
    saved = {str(p.relative_to(out)) for p in (out / "adapters").rglob("*") if p.is_file()}
    assert saved and {"results.json", "accuracy_vs_round.png", *saved} <= artifacts
    assert (store / "mlartifacts").is_dir()  # beside the database, not in the working directory


def test_a_resumed_run_replaces_the_events_after_the_resumed_round(tmp_path: Path) -> None:
    # Prepare: rounds 1..3 written, then a resume after round 1 writes rounds 2..3 again
    config = load_config(SMOKE, [f'output.dir="{tmp_path}"'])
    first = Tracker(config, tmp_path)
    for r in (1, 2, 3):
        first.round(RoundRecord(round=r, global_accuracy=0.1 * r))
    first.finish()

    # Execute
    resumed = Tracker(config, tmp_path, first_round=2)
    for r in (2, 3):
        resumed.round(RoundRecord(round=r, global_accuracy=0.5 + 0.1 * r))
    resumed.finish()

    # Assert: one value per round, the resumed run's for rounds 2 and 3
    events = read_scalars(tmp_path / "tensorboard")["accuracy/global"]
    assert [step for step, _ in events] == [1, 2, 3]
    assert [value for _, value in events] == pytest.approx([0.1, 0.7, 0.8])


def test_compare_mean_curves_average_the_seeds(tmp_path: Path) -> None:
    # Prepare: two seeds of one label; seed 1 has no global accuracy in round 2
    runs = {
        "fedit": [
            {"rounds": [{"round": 1, "global_accuracy": 0.2, "train_loss": 2.0}, {"round": 2, "global_accuracy": 0.4, "train_loss": 1.0}]},
            {"rounds": [{"round": 1, "global_accuracy": 0.4, "train_loss": 3.0}, {"round": 2, "global_accuracy": None, "train_loss": 2.0}]},
        ]
    }

    # Execute
    (folder,) = write_mean_curves(tmp_path, runs)

    # Assert: means where every seed measured the round
    scalars = read_scalars(folder)
    assert folder == tmp_path / "fedit" / "mean"
    assert [step for step, _ in scalars["accuracy/global"]] == [1]
    assert scalars["accuracy/global"][0][1] == pytest.approx(0.3)
    assert [step for step, _ in scalars["loss/train"]] == [1, 2]
    assert [value for _, value in scalars["loss/train"]] == pytest.approx([2.5, 1.5])


def test_numeric_extra_entries_go_to_tensorboard_and_to_the_mean_curves(tmp_path: Path) -> None:
    # Prepare: a method's mechanism in the rounds' extra, next to entries that are not numbers
    config = load_config(SMOKE, [f'output.dir="{tmp_path}"'])
    tracker = Tracker(config, tmp_path)
    extras = [{"relative_correction": 0.5, "phase": "warmup", "flag": True, "ranks": {"0": 4}},
              {"relative_correction": 0.25, "lam_min_block3": 0.1, "diverged": float("nan")}]
    # Execute
    for r, extra in enumerate(extras, start=1):
        tracker.round(RoundRecord(round=r, global_accuracy=0.1 * r, extra=extra))
    tracker.finish()
    (folder,) = write_mean_curves(tmp_path / "mean", {"fedpissa": [
        {"rounds": [{"round": 1, "extra": {"relative_correction": 0.5}}, {"round": 2, "extra": {"relative_correction": 0.25}}]},
        {"rounds": [{"round": 1, "extra": {"relative_correction": 0.7}}, {"round": 2, "extra": {}}]},
    ]})
    # Assert: extra/<key> for the finite numbers only, step = the round
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["extra/relative_correction"] == [(1, pytest.approx(0.5)), (2, pytest.approx(0.25))]
    assert scalars["extra/lam_min_block3"] == [(2, pytest.approx(0.1))]
    assert not {"extra/phase", "extra/flag", "extra/ranks", "extra/diverged"} & set(scalars)
    means = read_scalars(folder)["extra/relative_correction"]
    assert means == [(1, pytest.approx(0.6))]  # round 2: one seed only, not a mean over seeds
