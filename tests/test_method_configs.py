"""Each per-method config a user reaches for first (`configs/<method>.toml`) runs its method with the
choices of the method's fidelity scenario (`configs/scenarios/<method>.toml`), at a smaller size.

Compared per method: the whole resolved `[strategy]` section (every option of the method's options
model, defaults filled in; `warmup_rounds` scales with the run's length, so it only has to leave
rounds after the warm-up), and the keys listed in METHOD_KEYS below. Size keys (rounds, clients,
examples, steps, evaluation cadence, output) may differ. A per-method config that was removed is
skipped: the issue allows "or go".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from strategy_helpers import SHORT_RUN_ROUNDS, short_run_overrides

from fedlora.config import ConfigError, load_config
from fedlora.methods import method, method_names

ROOT = Path(__file__).resolve().parents[1]

COMMON = ("model.path", "model.head", "model.lora_rank", "model.lora_alpha", "model.target_modules",
          "data.source", "data.task", "data.partition", "data.dirichlet_alpha")
METHOD_KEYS: dict[str, tuple[str, ...]] = {
    # personalised under label skew: the skew and the shared head
    "fedpissa": COMMON,
    # resource tiers: who declares which rank and which budgets, and half the clients sampled a round
    "fedhera": (*COMMON, "clients.rank_tiers", "clients.budget_tiers", "federation.fraction_train"),
    # label noise on the training labels: its type and rate
    "feddr_lora": (*COMMON, "data.label_noise", "data.noise_rate"),
    # clients in task groups with disjoint labels (true clusters), local heads
    "fedtreelora": (*COMMON, "data.num_groups"),
}
SCALED_OPTIONS = ("warmup_rounds",)  # counted in rounds: scaled with the run's length


def value(config: Any, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(config, section).model_dump(mode="json")[key]


def strategy_options(config: Any) -> dict[str, Any]:
    """The method's options as the strategy sees them (defaults filled in)."""
    options = method(config.strategy.name).options.model_validate(config.strategy.options())
    return {k: v for k, v in options.model_dump(mode="json").items() if k not in SCALED_OPTIONS}


@pytest.mark.parametrize("name", list(METHOD_KEYS))
def test_per_method_config_carries_its_scenarios_method_relevant_choices(name: str) -> None:
    path = ROOT / "configs" / f"{name}.toml"
    if not path.is_file():
        pytest.skip(f"configs/{name}.toml was removed (the issue allows it to go)")
    mine, scenario = load_config(path), load_config(ROOT / "configs" / "scenarios" / f"{name}.toml")
    assert mine.strategy.name == scenario.strategy.name == name
    differences = {key: (value(mine, key), value(scenario, key)) for key in METHOD_KEYS[name]
                   if value(mine, key) != value(scenario, key)}
    assert not differences, f"configs/{name}.toml differs from its scenario (mine, scenario): {differences}"
    assert strategy_options(mine) == strategy_options(scenario)
    for option in SCALED_OPTIONS:
        if option in method(name).options.model_fields:
            warmup = getattr(method(name).options.model_validate(mine.strategy.options()), option)
            assert 1 <= warmup < mine.train.rounds, (option, warmup, mine.train.rounds)


def test_the_shared_short_run_options_fit_every_method_and_each_is_needed() -> None:
    # tests/strategy_helpers.py: every registered method validates a short smoke run with its
    # short-run options, and leaving any one of them out is refused (none is superfluous)
    smoke = ROOT / "configs" / "smoke.toml"
    for name in method_names():
        base, extra = [f"strategy.name={name}", f"train.rounds={SHORT_RUN_ROUNDS}"], short_run_overrides(name)
        load_config(smoke, [*base, *extra])
        for left_out in extra:
            with pytest.raises(ConfigError, match=left_out.split("=")[0]):
                load_config(smoke, [*base, *(o for o in extra if o != left_out)])
