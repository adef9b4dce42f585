"""What people read: plot ticks, the version, "did you mean", errors that name their strategy.

(The 100-column compare table is tests/test_compare.py, class names in results.json
tests/test_run.py, quiet output tests/test_quiet.py.)
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedlora.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


def fake_results(rounds: int) -> dict:
    per_round = [{"round": r, "global_accuracy": 0.1 * r, "personalized_accuracy": 0.05 * r} for r in range(1, rounds + 1)]
    return {"strategy": "fedit", "config": {"model": {}}, "rounds": per_round}


@pytest.mark.parametrize("rounds", [2, 3, 7])
def test_a_runs_plot_has_whole_rounds_on_its_x_axis(tmp_path: Path, rounds: int) -> None:
    from fedlora.app.plotting import plot_accuracy

    # Execute
    fig = plot_accuracy(fake_results(rounds), tmp_path / "plot.png")
    # Assert: every tick inside the data range is a whole round (matplotlib's default puts 1.25, 1.5 ...)
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= rounds]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_a_runs_plot_draws_received_accuracy_and_the_loss_beside_the_accuracies(tmp_path: Path) -> None:
    from fedlora.app.plotting import plot_accuracy

    # Prepare: round 2 not evaluated (no accuracies), its loss measured
    results = fake_results(3)
    for record, received, loss in zip(results["rounds"], (0.2, None, 0.4), (2.0, 1.5, 1.0), strict=True):
        record |= {"received_accuracy": received, "train_loss": loss}
    results["rounds"][1] |= {"global_accuracy": None, "personalized_accuracy": None}
    # Execute
    fig = plot_accuracy(results, tmp_path / "plot.png")
    # Assert: the accuracies (received among them) on the left, the loss on the right, each from results
    accuracy, loss = fig.axes[:2]
    drawn = {line.get_label(): list(zip(*line.get_data())) for line in accuracy.get_lines()}
    assert drawn == {"global (held-out test)": [(1, 0.1), (3, pytest.approx(0.3))],
                     "personalised (local tests)": [(1, 0.05), (3, pytest.approx(0.15))],
                     "received (before local training)": [(1, 0.2), (3, 0.4)]}
    assert {line.get_label(): list(zip(*line.get_data())) for line in loss.get_lines()} == {
        "training": [(1, 2.0), (2, 1.5), (3, 1.0)]}
    assert (tmp_path / "plot.png").stat().st_size > 0


def comparison_runs(labels: int = 7, seeds: int = 2, rounds: int = 4) -> dict:
    """Hand-made runs of ``labels`` strategies (long names, as the notebook's), with mechanisms."""
    def results(label: int, seed: int) -> dict:
        per_round = [{"round": r, "global_accuracy": 0.1 * r, "personalized_accuracy": 0.05 * r + 0.01 * seed,
                      "bytes_up": 1000, "bytes_down": 2000, "extra": {"relative_correction": 0.1 * r, "lam": r},
                      "per_client": {str(c): {"accuracy": 0.1 * c} for c in range(4)}} for r in range(1, rounds + 1)]
        return {"strategy": f"strategy_{label}", "config": {"model": {}, "train": {"seed": seed}}, "rounds": per_round}
    return {f"strategy_long_name_{label}": [results(label, seed) for seed in range(seeds)] for label in range(labels)}


@pytest.mark.e2e
def test_every_figure_is_readable_at_the_readmes_width(tmp_path: Path) -> None:
    from fedlora.app import plotting
    from fedlora.data import build_federated_data

    # Prepare: seven strategies, as in the notebook
    runs = comparison_runs()
    federated = build_federated_data(load_config(SMOKE).data)
    # Execute
    figures = {
        "per run": plotting.plot_accuracy(next(iter(runs.values()))[0], tmp_path / "run.png"),
        "vs round": plotting.plot_accuracy_vs_round(runs, tmp_path / "round.png"),
        "vs bytes": plotting.plot_accuracy_vs_bytes(runs, tmp_path / "bytes.png"),
        "distribution": plotting.plot_personalized_distribution(runs, tmp_path / "distribution.png"),
        "labels": plotting.plot_label_distribution(federated, tmp_path / "labels.png"),
        "mechanisms": plotting.plot_mechanisms(runs=runs, path=tmp_path / "mechanisms.png"),
    }
    # Assert: at most the README's figure width, and no text under 11 px shown 830 px wide
    for name, fig in figures.items():
        assert fig.get_figwidth() <= plotting.FIGURE_WIDTH, name
        assert plotting.smallest_text_px(fig) >= plotting.MIN_TEXT_PX, (name, plotting.smallest_text_px(fig))
    assert plotting.smallest_text_px(figures["vs round"], 830) == pytest.approx(9 * 830 / (8 * 72))  # the legend: 9 pt


@pytest.mark.e2e
def test_fedlora_version_is_the_projects() -> None:
    # Execute
    proc = subprocess.run([sys.executable, "-m", "fedlora.app.cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    # Assert: the version pyproject.toml declares
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert proc.returncode == 0 and proc.stdout.strip() == f"fedlora {declared}"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.name=fedpisa"], "unknown strategy 'fedpisa' (did you mean 'fedpissa'?)"),
        (["strategy.name=FedIT"], "unknown strategy 'FedIT' (did you mean 'fedit'?)"),
        (["data.max_exampels=3"], "unknown config key 'data.max_exampels' (did you mean 'data.max_examples'?)"),
        (["trian.rounds=3"], "unknown config key 'trian' (did you mean 'train'?)"),
        (["strategy.name=fedtreelora", "strategy.warmup_round=1"],
         "unknown option 'strategy.warmup_round' for strategy 'fedtreelora' (did you mean 'strategy.warmup_rounds'?)"),
    ],
)
def test_a_mistyped_name_gets_the_closest_known_one(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(SMOKE, overrides)
    assert message in str(error.value)


def test_nothing_close_suggests_nothing() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(SMOKE, ["data.bogus=1"])
    assert str(error.value) == "unknown config key 'data.bogus'"


def test_an_error_from_a_strategys_own_default_names_the_strategy_and_the_default() -> None:
    # Execute: fedtreelora's warm-up (3 rounds by default) against the 2-round smoke run
    with pytest.raises(ConfigError) as error:
        load_config(SMOKE, ["strategy.name=fedtreelora"])
    # Assert
    message = str(error.value)
    assert message.startswith("strategy 'fedtreelora': strategy.warmup_rounds must be < train.rounds (2)")
    assert message.endswith("(strategy.warmup_rounds = 3: fedtreelora's default)")
    # ... and a value the user chose is not called a default
    with pytest.raises(ConfigError) as chosen:
        load_config(SMOKE, ["strategy.name=fedtreelora", "strategy.warmup_rounds=2"])
    assert str(chosen.value).startswith("strategy 'fedtreelora': ") and "default" not in str(chosen.value)


@pytest.mark.e2e
def test_the_cli_says_it_in_one_line(tmp_path: Path) -> None:
    # Execute: the same mistake through the command line
    proc = subprocess.run([sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--out", str(tmp_path / "x"),
                           "--set", "strategy.name=fedtreelora"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "fedtreelora's default" in lines[0], proc.stderr
