"""Server optimisers (FedAvgM, FedAdam, FedYogi on a method's mean) against Flower's own strategies on
the same arrays; the fedavg name; the refusals of methods that cannot take a server optimiser or
FedProx; a run that steps with one (in process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvgM, FedYogi

from fedlora.config import ConfigError, load_config
from fedlora.schema import ServerOptimizerConfig
from fedlora.strategies.server_optimizer import server_step

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
SHAPES = {"m.lora_A": (2, 5), "m.lora_B": (6, 2), "classifier.weight": (3, 6)}


def _arrays(rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {k: (scale * rng.standard_normal(shape)).astype(np.float32) for k, shape in SHAPES.items()}


def _reply(arrays: dict[str, np.ndarray]) -> Message:
    """One training reply whose arrays are ``arrays`` (Flower's FedAvg of one reply is the reply itself)."""
    from fedlora.simulations.inprocess import InProcessGrid

    InProcessGrid(None, [])  # sets Flower's task identity, as a server process has it
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": 1})})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def _flower(name: str, config: ServerOptimizerConfig) -> Any:
    lr = config.resolved_lr()
    if name == "fedavgm":
        return FedAvgM(server_learning_rate=lr, server_momentum=config.momentum)
    cls = FedAdam if name == "fedadam" else FedYogi
    return cls(eta=lr, beta_1=config.beta_1, beta_2=config.beta_2, tau=config.tau)


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi"])
def test_server_step_is_flowers_arithmetic_on_the_same_arrays(name: str) -> None:
    # Prepare: four rounds of means near the current arrays; Flower's strategy told the same current arrays
    rng = np.random.default_rng(7)
    config = ServerOptimizerConfig(name=name, lr=0.05, momentum=0.8, beta_1=0.85, beta_2=0.95, tau=1e-2)
    flower = _flower(name, config)
    ours, moments = _arrays(rng), {}
    flowers = {k: v.copy() for k, v in ours.items()}
    for server_round in range(1, 5):
        mean = {k: v + _arrays(rng, 0.1)[k] for k, v in ours.items()}
        # Execute: ours, and Flower's aggregate_train on one reply carrying the mean
        if name == "fedavgm":
            flower.current_arrays = ArrayRecord({k: Array(v) for k, v in flowers.items()})
        else:
            flower.current_arrays = {k: v.copy() for k, v in flowers.items()}
        new, moments = server_step(config, server_round, ours, mean, moments)
        stepped, _ = flower.aggregate_train(server_round, [_reply(mean)])
        flowers = {k: stepped[k].numpy() for k in SHAPES}
        # Assert: the same arrays (ours kept float32), and a real step (not the mean)
        for k in SHAPES:
            assert new[k].dtype == np.float32
            np.testing.assert_allclose(new[k], flowers[k], rtol=1e-5, atol=1e-6)
            assert not np.allclose(new[k], mean[k], atol=1e-4)
        ours = new
        flowers = {k: v.astype(np.float32) for k, v in flowers.items()}


def test_adam_by_hand_in_its_first_round() -> None:
    # Prepare: x = 0, the mean y = d; m = (1 - b1) d, v = (1 - b2) d^2
    config = ServerOptimizerConfig(name="fedadam", lr=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    d = np.array([[0.5, -2.0]], dtype=np.float32)
    # Execute
    new, moments = server_step(config, 1, {"w": np.zeros_like(d)}, {"w": d}, {})
    # Assert: eta_1 = lr sqrt(1 - b2^2) / (1 - b1^2) (Flower's bias correction at round 1), by hand
    m, v = 0.1 * d, 0.01 * d**2
    eta = 0.1 * np.sqrt(1 - 0.99**2) / (1 - 0.9**2)
    np.testing.assert_allclose(new["w"], eta * m / (np.sqrt(v) + 1e-3), rtol=1e-6)
    np.testing.assert_allclose(moments["m"]["w"], m, rtol=1e-6)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_without_memory_and_with_a_large_tau_adam_and_yogi_step_to_the_mean(name: str) -> None:
    # beta_1 = beta_2 = 0: m = d, v = d^2; x + lr d / (|d| + tau) with lr = tau >> |d| is x + d, the mean
    rng = np.random.default_rng(3)
    x, y = _arrays(rng), _arrays(rng)
    config = ServerOptimizerConfig(name=name, lr=1e6, beta_1=0.0, beta_2=0.0, tau=1e6)
    stepped, _ = server_step(config, 4, x, y, {})
    for k in SHAPES:
        np.testing.assert_allclose(stepped[k], y[k], rtol=1e-4, atol=1e-5)


def test_none_and_flowers_off_switch_give_the_mean_itself() -> None:
    rng = np.random.default_rng(1)
    x, y = _arrays(rng), _arrays(rng)
    off, _ = server_step(ServerOptimizerConfig(name="none"), 1, x, y, {})
    plain, _ = server_step(ServerOptimizerConfig(name="fedavgm", lr=1.0, momentum=0.0), 1, x, y, {})
    for k in SHAPES:
        np.testing.assert_array_equal(off[k], y[k])
        np.testing.assert_array_equal(plain[k], y[k])


def test_other_keys_or_shapes_are_refused() -> None:
    rng = np.random.default_rng(2)
    x = _arrays(rng)
    y = {**x, "m.lora_A": np.zeros((3, 5), np.float32)}
    with pytest.raises(ValueError, match="keys and shapes"):
        server_step(ServerOptimizerConfig(name="fedadam"), 1, x, y, {})


def test_fedavg_names_fedit_and_the_run_is_fedits() -> None:
    # Execute
    alias = load_config(SMOKE, ["strategy.name=fedavg"])
    fedit = load_config(SMOKE, ["strategy.name=fedit"])
    # Assert: the same experiment (config and hash)
    assert alias.strategy.name == "fedit"
    assert alias.hash() == fedit.hash()


def test_a_mistyped_fedavg_is_pointed_at_fedavg() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'fedavg'\?.*fedavg \(= fedit\)"):
        load_config(SMOKE, ["strategy.name=fedavgg"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy.name=flexlora", "server_optimizer.name=fedadam"],
     (r"^server_optimizer.name = 'fedadam' is not supported by strategy 'flexlora': SVD-based.*use one of feddpa, "
      r"feddr_lora, fedit, fedsa_lora, ffa_lora, or server_optimizer.name = 'none'$")),
    (["strategy.name=local", "train.proximal_mu=0.01"],
     r"^train.proximal_mu = 0.01 \(FedProx\) is not supported by strategy 'local': nothing is downloaded"),
    (["strategy.name=centralized", "train.proximal_mu=0.01"], r"strategy 'centralized': one trainer"),
])
def test_methods_that_cannot_take_them_refuse_in_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(SMOKE, overrides)
    assert "\n" not in str(refused.value)


def test_flowers_dp_wrapper_is_refused_with_a_server_optimiser() -> None:
    from fedlora.strategies.fedit import FedIT

    config = load_config(SMOKE, ["server_optimizer.name=fedyogi"])
    strategy = FedIT(config, lambda rank: {}, {})
    assert "server_optimizer.name = 'fedyogi'" in strategy.flower_dp_problem()


@pytest.mark.e2e
def test_a_run_steps_with_the_server_optimiser(tmp_path: Path) -> None:
    """In process: FedAdam's global adapter is not FedIT's mean, and FedAvgM at lr 1 with momentum 0
    (Flower's off switch) is FedIT bit for bit."""
    from fedlora.app.runner import run_inprocess
    from fedlora.results import load_results

    def final(name: str, *extra: str) -> dict[str, Any]:
        config = load_config(SMOKE, ["train.precision=fp32", "train.rounds=2", f"server_optimizer.name={name}", *extra])
        run_inprocess(config, tmp_path / name)
        return load_results(tmp_path / name / "results.json")

    # Execute
    plain, adam, off = final("none"), final("fedadam", "server_optimizer.lr=0.01"), final(
        "fedavgm", "server_optimizer.lr=1.0", "server_optimizer.momentum=0.0")
    # Assert
    assert off["rounds"][-1]["train_loss"] == plain["rounds"][-1]["train_loss"]
    assert off["rounds"][-1]["global_accuracy"] == plain["rounds"][-1]["global_accuracy"]
    assert adam["rounds"][-1]["train_loss"] != plain["rounds"][-1]["train_loss"]  # round 2 trained from Adam's step
    assert adam["config"]["server_optimizer"]["name"] == "fedadam"


@pytest.mark.e2e
def test_a_resumed_run_continues_the_optimisers_moments(tmp_path: Path) -> None:
    """FedAdam, interrupted when round 3's training is sent and resumed from round 2's checkpoint,
    ends where the uninterrupted run does: its m and v travel in the checkpoint."""
    from test_golden import assert_close
    from test_resume import _adapters, _grid, _Interrupted, _rounds

    from fedlora.app.server import run_server

    # Prepare
    config = load_config(SMOKE, ["train.rounds=3", "train.max_steps=2", "server_optimizer.name=fedadam",
                                 "server_optimizer.lr=0.01", "train.precision=fp32"])
    reference, resumed = tmp_path / "a" / "run", tmp_path / "b" / "run"
    run_server(_grid(config, 1000), config, reference)
    with pytest.raises(_Interrupted):
        run_server(_grid(config, 2000, crash_round=3), config, resumed)
    # Execute
    run_server(_grid(config, 3000), config, resumed, resume=True)
    # Assert
    import json

    assert_close(_rounds(json.loads((resumed / "results.json").read_text())),
                 _rounds(json.loads((reference / "results.json").read_text())), "rounds")
    ref, res = _adapters(reference), _adapters(resumed)
    for name, tensors in ref.items():
        for key, value in tensors.items():
            np.testing.assert_allclose(res[name][key], value, atol=1e-6, err_msg=f"{name} {key}")
