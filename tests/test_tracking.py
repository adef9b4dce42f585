"""Experiment tracking: the TensorBoard event files, the MLflow run and the offline W&B run of a real
run, read back (TensorBoard's, MLflow's and W&B's own readers) and checked against its results.json;
resume purges the events after the resumed round and continues the W&B run; compare writes
mean-over-seeds curves beside the per-seed ones and one HParams view over its runs."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedlora.app.runner import run
from fedlora.app.tracking import ROUND_METRICS, Tracker, round_metrics, write_hparams, write_mean_curves
from fedlora.config import ConfigError, load_config
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


def wandb_env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """No network, and W&B's user-level folders (artifact staging, cache, settings) in ``home``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))


def wandb_records(path: Path) -> list[dict]:
    """Every record of the W&B run log(s) under ``path``, as W&B's own reader prints them
    (``wandb leet inspect --json``: one JSON object per record)."""
    records = []
    for log in sorted(path.rglob("run-*.wandb")):
        shown = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                               capture_output=True, text=True, timeout=120, check=True)
        records += [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]
    return records


def wandb_summary(run_folder: Path) -> dict:
    """The run's state, config and summary as W&B's reader sums them up (``--summary --json``)."""
    shown = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_folder)],
                           capture_output=True, text=True, timeout=120, check=True)
    return json.loads(shown.stdout)


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """One 2-round smoke run (FedSA-LoRA: global and personalised metrics) with MLflow on a sqlite file
    and W&B offline."""
    tmp = tmp_path_factory.mktemp("tracked")
    uri = f"sqlite:///{tmp / 'store' / 'mlflow.db'}"
    (tmp / "store").mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        wandb_env(monkeypatch, tmp / "home")
        results = run(
            SMOKE,
            overrides=["strategy.name=fedsa_lora", f'output.mlflow_uri="{uri}"', 'output.mlflow_experiment="tests"',
                       "output.wandb=true", 'output.wandb_project="tests"'],
            out_dir=tmp / "run",
            engine="inprocess",
        )
    return tmp / "run", tmp / "store", results


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_the_offline_wandb_run_holds_every_round_config_summary_files_and_adapters(tracked_run) -> None:
    # Prepare
    out, _store, results = tracked_run
    saved = json.loads((out / "wandb_run.json").read_text())
    (folder,) = sorted((out / "wandb").glob("offline-run-*"))  # offline: written here, nothing sent
    # Execute: W&B's own reader of its run log
    records = wandb_records(folder)
    summary = wandb_summary(folder)
    # Assert: the run (its id kept for a resume), finished, under the project and run name given
    assert folder.name.endswith(saved["run_id"]) and saved["mode"] == "offline"
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["project"] == "tests" and summary["name"] == "fedsa_lora seed0"
    # the resolved config and its hash
    assert summary["config"]["config_hash"] == results["config_hash"]
    assert summary["config"]["train"]["lr"] == results["config"]["train"]["lr"]
    assert summary["config"]["strategy"]["name"] == "fedsa_lora"
    # every round: the metrics TensorBoard gets, from results.json, step = the round
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2]
    for row in results["rounds"]:
        record = RoundRecord(**{k: (math.nan if v is None else v) for k, v in row.items()})
        expected = dict(round_metrics(record))
        assert expected and {k: history[row["round"]][k] for k in expected} == pytest.approx(expected), row["round"]
    # the final metrics as the summary; results.json and the plot as files; the adapter as a model artifact
    for key in ("global_accuracy", "personalized_accuracy", "bytes_total"):
        assert summary["summary"][f"final/{key}"] == pytest.approx(results["final"][key]), key
    files = {f["path"] for r in records if r["type"] == "files" for f in r["files"]["files"]}
    assert {"results.json", "accuracy_vs_round.png"} <= files
    assert json.loads((folder / "files" / "results.json").read_text())["final"] == results["final"]
    artifacts = {r["artifact"]["name"]: r["artifact"] for r in records if r["type"] == "artifact"}
    adapters = sorted((out / "adapters").iterdir())  # FedSA-LoRA: each client's own adapter
    assert len(adapters) == 3 and len(artifacts) == 3
    for adapter in adapters:
        artifact = artifacts[f"adapter-{adapter.name}-{saved['run_id']}"]
        shipped = {entry["path"] for entry in artifact["manifest"]["contents"]}
        assert artifact["type"] == "model" and shipped == {p.name for p in adapter.iterdir() if p.is_file()}


@pytest.mark.e2e
def test_a_resumed_run_continues_its_wandb_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: rounds 1..2 of a run that fails, then a resume after round 1 writes round 2 again
    wandb_env(monkeypatch, tmp_path / "home")
    config = load_config(SMOKE, [f'output.dir="{tmp_path}"', "output.tensorboard=false", "output.wandb=true"])
    first = Tracker(config, tmp_path)
    for r in (1, 2):
        first.round(RoundRecord(round=r, global_accuracy=0.1 * r))
    first.finish(ok=False)
    # Execute
    resumed = Tracker(config, tmp_path, first_round=2)
    resumed.round(RoundRecord(round=2, global_accuracy=0.7))
    resumed.finish()
    # Assert: two offline folders of one run id (wandb sync merges them), the failed part ended non-zero
    run_id = json.loads((tmp_path / "wandb_run.json").read_text())["run_id"]
    folders = sorted((tmp_path / "wandb").glob("offline-run-*"))
    # (W&B names a second folder of the same id opened in the same second <name>-1)
    assert len(folders) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", f.name) for f in folders)
    exits = [[r["exit"]["exit_code"] for r in wandb_records(f) if r["type"] == "exit"] for f in folders]
    assert exits == [[1], [0]]
    steps = [[(r["history"]["step"]["num"], r["history"]["item"]["accuracy/global"])
              for r in wandb_records(f) if r["type"] == "history"] for f in folders]
    assert steps == [[(1, pytest.approx(0.1)), (2, pytest.approx(0.2))], [(2, pytest.approx(0.7))]]


def test_a_backend_switched_on_without_its_package_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    # Prepare: wandb not importable
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    config = load_config(SMOKE, [f'output.dir="{tmp_path}"', "output.wandb=true"])
    # Execute / Assert
    with pytest.raises(ConfigError, match=r"output.wandb is on but wandb is not installed: pip install 'fedlora\[wandb\]'"):
        Tracker(config, tmp_path)


@pytest.mark.parametrize(("settings", "flag"), [
    (["output.tensorboard=true", 'output.tensorboard_dir="{file}"'], "output.tensorboard_dir"),
    (["output.tensorboard=false", "output.wandb=true", 'output.wandb_dir="{file}"'], "output.wandb_dir"),
])
def test_a_tracking_folder_that_cannot_be_written_is_one_line_before_the_run(tmp_path: Path, settings: list[str],
                                                                           flag: str) -> None:
    from fedlora.app.tracking import check_tracking

    # Prepare: the backend's folder is a file
    (tmp_path / "taken").write_text("x")
    config = load_config(SMOKE, [s.format(file=tmp_path / "taken") for s in settings])
    # Execute / Assert: refused before anything is written; the same config with a folder passes
    with pytest.raises(ConfigError, match=rf"^{flag} {tmp_path / 'taken'} is a file"):
        check_tracking(config, tmp_path)
    check_tracking(load_config(SMOKE, [s.format(file=tmp_path / "free") for s in settings]), tmp_path)


def test_every_backend_has_the_same_switch_and_an_mlflow_uri_alone_still_switches_mlflow_on() -> None:
    # Execute
    output = load_config(SMOKE).output
    old_style = load_config(SMOKE, ['output.mlflow_uri="sqlite:///x.db"']).output
    off = load_config(SMOKE, ['output.mlflow_uri="sqlite:///x.db"', "output.mlflow=false"]).output
    # Assert
    assert (output.tensorboard, output.mlflow, output.wandb) == (True, False, False)
    assert old_style.mlflow and not off.mlflow


def read_hparams(folder: Path) -> dict:
    """The HParams plugin's records in ``folder`` (TensorBoard's reader): tag -> HParamsPluginData."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    parse = {metadata.EXPERIMENT_TAG: metadata.parse_experiment_plugin_data,
             metadata.SESSION_START_INFO_TAG: metadata.parse_session_start_info_plugin_data,
             metadata.SESSION_END_INFO_TAG: metadata.parse_session_end_info_plugin_data}
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {tag: parse[tag](content) for tag, content in accumulator.PluginTagToContent(metadata.PLUGIN_NAME).items()}


def test_hparams_view_has_a_session_per_run_with_what_differs_and_its_final_scores(tmp_path: Path) -> None:
    # Prepare: two labels x two seeds; the learning rate differs between the labels, the rank nowhere
    def results(name: str, seed: int, lr: float, accuracy: float) -> dict:
        config = {"strategy": {"name": name}, "train": {"seed": seed, "lr": lr}, "model": {"lora_rank": 4},
                  "output": {"dir": f"x/{name}/seed{seed}"}}
        rounds = [{"round": 1, "global_accuracy": 0.1}, {"round": 2, "global_accuracy": accuracy}]
        return {"config": config, "rounds": rounds, "_seed_dir": f"seed{seed}",
                "final": {"global_accuracy": accuracy, "personalized_accuracy": None, "bytes_total": 1000}}

    runs = {"fedit": [results("fedit", 0, 1e-3, 0.5), results("fedit", 1, 1e-3, 0.7)],
            "flexlora": [results("flexlora", 0, 2e-3, 0.6), results("flexlora", 1, 2e-3, 0.8)]}
    # Execute: written twice (a resumed comparison): the second replaces the first
    write_hparams(tmp_path, runs)
    sessions = write_hparams(tmp_path, runs)
    # Assert: one experiment at the top, its hyperparameters and the metrics some run measured
    experiment = read_hparams(tmp_path)["_hparams_/experiment"]
    assert [h.name for h in experiment.hparam_infos] == ["label", "seed", "strategy.name", "train.lr"]
    assert [m.name.tag for m in experiment.metric_infos] == ["final/global_accuracy", "final/bytes_total"]
    assert [v.string_value for v in experiment.hparam_infos[0].domain_discrete.values] == ["fedit", "flexlora"]
    # ... and a session per run, in its curves' folder, with its values and final scores at its last round
    assert sessions == [tmp_path / label / f"seed{k}" for label in runs for k in (0, 1)]
    for label, lr, finals in (("fedit", 1e-3, (0.5, 0.7)), ("flexlora", 2e-3, (0.6, 0.8))):
        for seed, accuracy in enumerate(finals):
            folder = tmp_path / label / f"seed{seed}"
            assert len(list(folder.glob("events.out.tfevents.*"))) == 1
            records = read_hparams(folder)
            start = records["_hparams_/session_start_info"]
            assert start.hparams["label"].string_value == label and start.hparams["seed"].number_value == seed
            assert start.hparams["train.lr"].number_value == pytest.approx(lr)
            assert "model.lora_rank" not in start.hparams and "output.dir" not in start.hparams
            assert records["_hparams_/session_end_info"].status == 1  # STATUS_SUCCESS
            scalars = read_scalars(folder)
            assert scalars["final/global_accuracy"] == [(2, pytest.approx(accuracy))]
            assert "final/personalized_accuracy" not in scalars
