"""Config validation, overrides and profile resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedlora.config import ConfigError, ExperimentConfig, build_config, load_config, parse_override
from fedlora.profile import resolve_profile, tier_ranks

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.toml")))
def test_every_shipped_config_validates(name: str) -> None:
    config = load_config(CONFIGS / name)
    assert isinstance(config, ExperimentConfig)


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.name=nope", "unknown strategy 'nope'"),
        ("model.lora_rank=0", "model.lora_rank"),
        ("data.noise_rate=1.0", "data.noise_rate"),
        ("data.noise_rate=-0.1", "data.noise_rate"),
        ("data.unknown_key=3", "unknown config key 'data.unknown_key'"),
        ("nosection.key=1", "unknown config key 'nosection'"),
        ("data.partition=random", "data.partition"),
        ("clients.ranks=[2, 0, 4]", "clients.ranks"),
        ("strategy.not_an_option=1", "strategy.not_an_option"),
    ],
)
def test_bad_values_are_one_clear_error(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "smoke.toml", [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


BIG = 10 * 2**20  # a 10 MB value


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.rounds=" + "x" * BIG, "invalid config 'train.rounds': must be a number, not text"),
        ("train.rounds=" + "9" * 5000, "invalid config 'train.rounds'"),  # more digits than Python parses
        ("data." + "k" * BIG + "=1", "unknown config key 'data.kkk"),
        ("strategy.name=" + "n" * BIG, "unknown strategy"),
        ("x" * BIG, "--set expects section.key=value"),
    ],
    ids=["integer", "digits", "key", "strategy", "override"],
)
def test_a_huge_value_gives_a_short_line_that_states_its_length(override: str, message: str) -> None:
    # Execute
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "smoke.toml", [override])
    # Assert: one line, short, the value cut and its length said
    line = str(error.value)
    assert message in line and "\n" not in line and len(line) <= 400, line[:2000]
    assert "characters)" in line


def test_a_huge_value_in_a_config_file_gives_a_short_line(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text((CONFIGS / "smoke.toml").read_text().replace("rounds = 2", f'rounds = "{"x" * BIG}"'))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert "train.rounds" in str(error.value) and len(str(error.value)) < 300
    assert f"({BIG} characters)" in str(error.value)


@pytest.mark.parametrize(
    "override, bound",
    [
        ("train.rounds=100001", "less than or equal to 100000"),
        ("train.local_epochs=10000001", "less than or equal to 10000000"),
        ("train.max_steps=10000001", "less than or equal to 10000000"),
        ("train.batch_size=65537", "less than or equal to 65536"),
        ("data.num_clients=100001", "less than or equal to 100000"),
        ("federation.evaluate_every=100001", "less than or equal to 100000"),
        ("faults.max_failed_rounds=100001", "less than or equal to 100000"),
        ("faults.max_examples=1000000000001", "less than or equal to 1000000000000"),
    ],
)
def test_counts_have_upper_bounds(override: str, bound: str) -> None:
    # Execute / Assert: one line naming the key and the bound; the bound itself is allowed
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "smoke.toml", [override])
    assert f"invalid config '{key}'" in str(error.value) and bound in str(error.value)
    at_bound = f"{key}={int(override.split('=')[1]) - 1}"
    if key not in ("data.num_clients", "train.rounds"):  # those need other keys to agree (clients.ranks, warm-ups)
        load_config(CONFIGS / "smoke.toml", [at_bound])
    assert load_config(CONFIGS / "smoke.toml", ["train.rounds=100000"]).train.rounds == 100000


@pytest.mark.parametrize(
    "text, path, value",
    [
        ("train.lr=1e-3", ["train", "lr"], 1e-3),
        ("train.rounds=3", ["train", "rounds"], 3),
        ("model.path=tiny-bert", ["model", "path"], "tiny-bert"),
        ("clients.ranks=[2, 4]", ["clients", "ranks"], [2, 4]),
        ("output.save_adapters=false", ["output", "save_adapters"], False),
    ],
)
def test_override_values_parse_as_toml(text: str, path: list[str], value: object) -> None:
    assert parse_override(text) == (path, value)


def test_overrides_apply_and_hash_changes() -> None:
    base = load_config(CONFIGS / "smoke.toml")
    changed = load_config(CONFIGS / "smoke.toml", ["train.lr=0.01"])
    assert changed.train.lr == 0.01
    assert base.hash() != changed.hash()
    assert build_config(base.model_dump(mode="json")).hash() == base.hash()


def test_a_run_ignores_the_fidelity_benchmarks_table_and_set_cannot_reach_it(tmp_path: Path) -> None:
    # Prepare: the smoke config with a [fidelity] table (the benchmark's plan of a scenario)
    path = tmp_path / "with_table.toml"
    path.write_text((CONFIGS / "smoke.toml").read_text() + '\n[fidelity]\nclaim = "x"\n[fidelity.jobs.fedit]\n'
                    'strategy = "fedit"\n')
    # Execute / Assert: the same experiment as without the table; an override into it is an unknown key
    assert load_config(path).hash() == load_config(CONFIGS / "smoke.toml").hash()
    with pytest.raises(ConfigError, match="unknown config key 'fidelity'"):
        load_config(path, ["fidelity.claim=y"])
    for scenario in sorted((CONFIGS / "scenarios").glob("*.toml")):  # every scenario config carries one
        assert "\n[fidelity]\n" in scenario.read_text() and isinstance(load_config(scenario), ExperimentConfig)


def test_missing_config_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.toml")


def test_ranks_list_length_must_match_clients() -> None:
    with pytest.raises(ConfigError, match="one rank per client"):
        load_config(CONFIGS / "smoke.toml", ["data.num_clients=3", "clients.ranks=[2, 4]"])


@pytest.mark.parametrize(
    "tiers, n, expected",
    [
        ({"2": 0.3, "4": 0.5, "8": 0.2}, 10, [2, 2, 2, 4, 4, 4, 4, 4, 8, 8]),
        ({"4": 1.0}, 3, [4, 4, 4]),
        ({"2": 0.5, "8": 0.5}, 3, [2, 2, 8]),
    ],
)
def test_rank_tiers_assign_in_client_order(tiers: dict[str, float], n: int, expected: list[int]) -> None:
    assert tier_ranks(tiers, n) == expected


def test_node_config_overrides_the_configured_rank() -> None:
    config = load_config(CONFIGS / "smoke.toml", ["clients.ranks=[2, 4, 8]"])
    assert resolve_profile(config, {"partition-id": 1}).rank == 4
    assert resolve_profile(config, {"partition-id": 1, "rank": 16}).rank == 16
    profile = resolve_profile(config, {"partition-id": 0, "budget-download": "1000"})
    assert profile.budgets == {"download": 1000.0}
