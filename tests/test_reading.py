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


def test_the_cli_says_it_in_one_line(tmp_path: Path) -> None:
    # Execute: the same mistake through the command line
    proc = subprocess.run([sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--out", str(tmp_path / "x"),
                           "--set", "strategy.name=fedtreelora"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, check=False)
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "fedtreelora's default" in lines[0], proc.stderr
