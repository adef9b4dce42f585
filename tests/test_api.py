"""The Python API as a notebook uses it: typed signatures (IDEs and ``help`` see the real
parameters), a config object or mapping and mapping overrides beside ``key=value`` strings, and the
results object (the results.json dict, with its per-round and per-client tables as pandas frames),
for one run and for a comparison. The notebook itself runs in tests/test_compare.py."""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fedlora
from fedlora.config import ConfigError, load_config
from fedlora.schema import overrides_from

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, fedlora.RunResults]:
    """A 2-round smoke run started from a mapping of sections with mapping overrides."""
    import tomllib

    out = tmp_path_factory.mktemp("api") / "run"
    sections = tomllib.loads(SMOKE.read_text())
    results = fedlora.run(sections, {"strategy": {"name": "fedsa_lora"}, "output.tensorboard": False}, out_dir=out,
                          engine="inprocess")
    return out, results


@pytest.mark.e2e
def test_the_facade_has_typed_signatures_and_loads_nothing_of_the_application() -> None:
    # Execute: a fresh interpreter that imports fedlora and asks for the signatures
    code = ("import sys, fedlora; before = 'fedlora.app' in sys.modules; import inspect; "
            "print(before, 'config' in inspect.signature(fedlora.compare).parameters)")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # Assert: importing fedlora loads no application module; asking for compare does
    assert shown.stdout.split() == ["False", "True"]
    lazy = {name: getattr(fedlora, name) for name in ("ExperimentConfig", "RunResults", "Settings")}
    for function in (fedlora.run, fedlora.compare, fedlora.load_config, fedlora.load_results):
        parameters = inspect.signature(function).parameters.values()
        assert all(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters), function
        hints = typing.get_type_hints(function, localns=lazy)  # every annotation resolves (the facade's lazily)
        assert "return" in hints and all(p.name in hints for p in parameters), function
    assert typing.get_type_hints(fedlora.run)["return"] is fedlora.RunResults
    assert typing.get_type_hints(fedlora.compare)["return"] is fedlora.ComparisonTable
    assert "engine" in inspect.signature(fedlora.compare).parameters


@pytest.mark.parametrize("settings", [
    {"train.lr": 0.003, "strategy.name": "fedpissa", "clients.ranks": [4, 4, 4], "output.tensorboard": False},
    {"train": {"lr": 0.003}, "strategy": {"name": "fedpissa"}, "clients": {"ranks": [4, 4, 4]},
     "output": {"tensorboard": False}},
])
def test_mapping_overrides_give_the_config_the_strings_give(settings: dict) -> None:
    # Prepare
    strings = ["train.lr=0.003", "strategy.name=fedpissa", "clients.ranks=[4, 4, 4]", "output.tensorboard=false"]
    # Execute
    from_mapping = fedlora.load_config(SMOKE, settings)
    # Assert
    assert from_mapping == load_config(SMOKE, strings) and from_mapping.train.lr == 0.003


def test_every_kind_of_value_survives_the_mapping_and_bad_ones_are_one_line() -> None:
    from fedlora.schema import parse_override

    # Prepare: every value type an option takes, quotes and non-ASCII text included
    values = {"a.b": True, "a.c": 3, "a.d": 1e-5, "a.e": 'say "hi" \u00e9\U0001f600', "a.f": [1, 2.5],
              "a.g": {"2": 0.3, "4": 0.7}, "a.h": []}
    # Execute
    parsed = {".".join(path): value for path, value in map(parse_override, overrides_from(values))}
    # Assert: read back as the same values
    assert parsed == values
    with pytest.raises(ConfigError, match="must be a bool, number, string, list or table"):
        overrides_from({"train.lr": object()})
    with pytest.raises(ConfigError, match="overrides must be a list"):
        overrides_from("train.lr=1")


def test_a_config_object_or_mapping_is_never_changed_by_a_run_s_overrides(tmp_path: Path) -> None:
    from fedlora.app.runner import resolve

    # Prepare
    raw = {"model": {"path": "tiny-bert"}, "train": {"rounds": 1}}
    config = load_config(SMOKE)
    # Execute
    resolved = resolve(raw, {"train.rounds": 3})
    again = resolve(config, ["train.rounds=4"])
    # Assert
    assert resolved.train.rounds == 3 and raw == {"model": {"path": "tiny-bert"}, "train": {"rounds": 1}}
    assert again.train.rounds == 4 and config.train.rounds == 2
    with pytest.raises(ConfigError, match="config must be an ExperimentConfig, a TOML file's path or a mapping"):
        resolve(42)  # type: ignore[arg-type]


@pytest.mark.e2e
def test_run_returns_the_results_json_dict_with_its_tables_as_frames(smoke_results) -> None:
    # Prepare
    out, results = smoke_results
    written = json.loads((out / "results.json").read_text())
    # Execute
    per_round, per_client = results.per_round, results.per_client
    # Assert: the dict is results.json (the contract), the typed config and the final values beside it
    assert isinstance(results, dict) and json.loads(json.dumps(results)) == written
    assert results.config.strategy.name == "fedsa_lora" and results.final == written["final"]
    assert fedlora.load_results(out) == results
    # ... a row per round with its one-number fields (NaN where not measured)
    assert list(per_round.index) == [1, 2]
    for record in written["rounds"]:
        for key in ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up"):
            assert per_round.loc[record["round"], key] == pytest.approx(record[key]), key
        assert math.isnan(per_round.loc[record["round"], "global_rouge_l"])
    assert "per_client" not in per_round.columns and "rejections" not in per_round.columns
    # ... a row per round and client: its evaluation, and its training reply as train.<key>
    expected = sorted((r["round"], int(k)) for r in written["rounds"] for k in r["per_client"])
    assert sorted(zip(per_client["round"], per_client["client"], strict=True)) == expected
    for row in per_client.to_dict("records"):
        record = written["rounds"][row["round"] - 1]
        assert row["accuracy"] == pytest.approx(record["per_client"][str(row["client"])]["accuracy"])
        assert row["num_examples"] == record["per_client"][str(row["client"])]["num-examples"]
        assert row["train.loss"] == pytest.approx(record["per_client_train"][str(row["client"])]["train_loss"])
    assert "final round 2" in results._repr_html_()


@pytest.mark.e2e
def test_a_comparison_gives_every_runs_rounds_and_clients_as_frames(tmp_path: Path) -> None:
    # Execute: two strategies, mapping overrides for one strategy's runs only
    table = fedlora.compare(SMOKE, ["fedit", "flexlora"], out_dir=tmp_path, engine="inprocess", plots=False,
                            overrides={"output.tensorboard": False},
                            strategy_overrides={"flexlora": {"train.lr": 0.002}})
    # Assert: one frame of every run's rounds, per strategy and seed, read from its results.json
    per_round, per_client = table.per_round, table.per_client
    assert sorted({(s, int(k)) for s, k in zip(per_round["strategy"], per_round["seed"], strict=True)}) == [
        ("fedit", 0), ("flexlora", 0)]
    for strategy in ("fedit", "flexlora"):
        written = json.loads((tmp_path / strategy / "seed0" / "results.json").read_text())
        rows = per_round[per_round["strategy"] == strategy].set_index("round")
        assert list(rows.index) == [1, 2]
        assert list(rows["global_accuracy"]) == pytest.approx([r["global_accuracy"] for r in written["rounds"]])
        assert len(per_client[per_client["strategy"] == strategy]) == sum(len(r["per_client"]) for r in written["rounds"])
    assert json.loads((tmp_path / "flexlora/seed0/results.json").read_text())["config"]["train"]["lr"] == 0.002
    assert json.loads((tmp_path / "fedit/seed0/results.json").read_text())["config"]["train"]["lr"] == 0.001
