"""Flower's contract: a fedlora strategy is a Flower ``Strategy`` a user can run with ``start``.

``aggregate_train`` returns the new global arrays and the round's metrics; ``configure_*`` build
their downloads from the ``arrays`` they are given (the ones returned change nothing, others of
the same keys and shapes replace the global state, anything else is refused); a strategy is built
from keywords (its options, Flower's sampling settings, the experiment sections the clients need);
and a user's own ServerApp (examples/flower_serverapp) runs one with fedlora's ClientApp.

The unit tests build every strategy from keywords on the tiny random BERT of configs/smoke.toml
and answer its messages here (a profile-only ClientApp on the in-process grid, honest random
uploads), without training.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from strategy_helpers import SMOKE_SETTINGS, short_run_options

from fedlora.config import ConfigError, config_from_json, load_config
from fedlora.data import build_federated_data
from fedlora.evaluation import GlobalEvaluator
from fedlora.lora import A_SUFFIX, B_SUFFIX, HEAD_PREFIX, from_array_record, split_payload, to_array_record
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid, node_configs
from fedlora.strategies.base import ArraysError, LoRAStrategy
from fedlora.strategies.registry import strategy_class, strategy_names
from fedlora.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
SETTINGS = SMOKE_SETTINGS
RANKS = [2, 4, 8]
DECLARED = [100, 110, 120]  # training examples each client declares
NODE = 1000  # InProcessGrid: node 1000 + k holds partition k


def profile_app(msg: Message, context: Context) -> Message:
    """A ClientApp that only answers the profile query (partition k: RANKS[k], DECLARED[k])."""
    k = int(context.node_config["partition-id"])
    profile = ClientProfile(partition_id=k, rank=RANKS[k], num_train_examples=DECLARED[k], fedlora_version=__version__)
    return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)


def keyword_strategy(name: str) -> LoRAStrategy:
    return strategy_class(name)(**short_run_options(name), **SETTINGS)


def honest_reply(strategy: LoRAStrategy, msg: Message, server_round: int) -> Message:
    """A valid training reply: random small arrays of the expected shapes, plausible metrics."""
    k = msg.metadata.dst_node_id - NODE
    rng = np.random.default_rng([k, server_round])
    shapes = strategy.sent_this_round("train")[k].expected()  # the download it answers
    arrays = ArrayRecord({key: Array((0.01 * rng.standard_normal(shape)).astype(np.float32))
                          for key, shape in shapes.items()})
    metrics = {"num-examples": DECLARED[k] - 5 * k, "partition-id": k, "train-loss": 0.5 + k, "train-seconds": 1.0,
               "train-examples": 40}
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)


def trained_round(strategy: LoRAStrategy, grid: InProcessGrid, arrays: ArrayRecord
                  ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Round 1 of Flower's loop: configure_train with ``arrays``, honest replies, aggregate_train."""
    sent = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    return strategy.aggregate_train(1, [honest_reply(strategy, m, 1) for m in sent])


def downloads(messages: list[Message]) -> list[tuple[int, dict[str, np.ndarray], dict[str, Any]]]:
    return [(m.metadata.dst_node_id, from_array_record(m.content.array_records["arrays"]),
             dict(m.content.config_records["config"])) for m in messages]


def assert_same_downloads(a: list[Message], b: list[Message]) -> None:
    for (node_a, arrays_a, config_a), (node_b, arrays_b, config_b) in zip(downloads(a), downloads(b), strict=True):
        assert node_a == node_b and config_a == config_b and arrays_a.keys() == arrays_b.keys()
        for key in arrays_a:
            np.testing.assert_array_equal(arrays_a[key], arrays_b[key], err_msg=key)


def model_of(payload: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """What a global payload means: s B A per module (s = alpha / rank) and the other arrays."""
    factors, rest = split_payload(payload)
    products = {m: (alpha / f.rank) * (f.B.astype(np.float64) @ f.A.astype(np.float64))
                for m, f in factors.items() if f.A.size and f.B.size}
    alone = {f"{m}{A_SUFFIX if f.A.size else B_SUFFIX}": f.A if f.A.size else f.B
             for m, f in factors.items() if not (f.A.size and f.B.size)}
    return products | alone | rest


# ----------------------------------------------------------------------------- keywords
@pytest.mark.e2e
def test_a_strategy_built_from_keywords_runs_the_experiment_of_the_same_config() -> None:
    # Execute: FedPissa from its own option, Flower's sampling keywords and smoke.toml's sections
    strategy = strategy_class("fedpissa")(lam=0.5, fraction_train=0.5, fraction_evaluate=0.25, min_train_nodes=2,
                                         min_evaluate_nodes=1, min_available_nodes=3,
                                         **{**SETTINGS, "federation": {"round_timeout": 60.0}})
    # Assert: the experiment the clients receive is the config file's, the Flower names map onto it
    config = load_config(SMOKE, ["strategy.name=fedpissa", "strategy.lam=0.5", "federation.fraction_train=0.5",
                                 "federation.fraction_evaluate=0.25", "federation.min_clients=2",
                                 "federation.round_timeout=60.0", "output.dir=runs/latest"])
    assert strategy.experiment == config
    assert (strategy.options.lam, strategy.options.init) == (0.5, "pissa")
    assert (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_train_nodes) == (0.5, 0.25, 2)
    assert (strategy.min_evaluate_nodes, strategy.min_available_nodes) == (1, 3)
    # the server's model is fedlora's ServerApp's, with FedPissa's PiSSA init (B != 0, unlike kaiming's B = 0)
    evaluator = GlobalEvaluator(config.model, config.train, build_federated_data(config.data), init="pissa")
    assert strategy.module_shapes == evaluator.module_shapes()
    initial, expected = strategy.initial_adapter(4), evaluator.initial_adapter(4)
    assert initial.keys() == expected.keys() and all(np.array_equal(initial[k], expected[k]) for k in expected)
    assert all(np.abs(v).max() > 0 for k, v in initial.items() if k.endswith(B_SUFFIX))


def test_keyword_settings_are_checked_like_a_config_file() -> None:
    fedit = strategy_class("fedit")
    with pytest.raises(ConfigError, match="unknown option 'strategy.lam' for strategy 'fedit'"):
        fedit(lam=0.5, **SETTINGS)
    with pytest.raises(ConfigError, match="federation.fraction_train"):
        fedit(fraction_train=1.5, **SETTINGS)
    with pytest.raises(TypeError, match="not both"):
        fedit(load_config(SMOKE), fraction_train=0.5)
    with pytest.raises(TypeError, match="the strategy is 'fedit'"):
        fedit(name="fedpissa", **SETTINGS)


# ----------------------------------------------------------------------------- arrays
@pytest.mark.parametrize("name", strategy_names())
def test_aggregate_train_returns_the_global_arrays_and_configure_takes_them_back(name: str) -> None:
    # Prepare: the strategy, and a twin that is always given an empty record (its own state)
    strategy, twin = keyword_strategy(name), keyword_strategy(name)
    grid, twin_grid = InProcessGrid(profile_app, node_configs(3)), InProcessGrid(profile_app, node_configs(3))
    # Execute: round 1 of Flower's loop, then round 2's hooks with the arrays round 1 returned
    arrays, metrics = trained_round(strategy, grid, ArrayRecord())
    trained_round(twin, twin_grid, ArrayRecord())
    assert arrays is not None and metrics is not None
    evaluate = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    twin_evaluate = list(twin.configure_evaluate(1, ArrayRecord(), ConfigRecord(), twin_grid))
    train = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    twin_train = list(twin.configure_train(2, ArrayRecord(), ConfigRecord(), twin_grid))
    # Assert: the returned arrays are the global ones (the global model where there is one) ...
    returned, current = from_array_record(arrays), strategy.global_arrays()
    assert returned.keys() == current.keys() and all(np.array_equal(returned[k], current[k]) for k in current)
    global_model = strategy.global_payload()
    if global_model is not None:  # FFA-LoRA's frozen A is no array: a constant every party draws from train.seed
        frozen = {k for k in global_model if name == "ffa_lora" and k.endswith(A_SUFFIX)}
        assert returned.keys() == global_model.keys() - frozen
        assert all(np.array_equal(returned[k], global_model[k]) for k in returned)
    assert metrics["clients"] == (1 if name == "centralized" else 3)  # every client (Centralized: its one trainer)
    assert math.isclose(float(metrics["train-loss"]), strategy.records[1].train_loss)
    # ... and passing them back changes nothing: the downloads are the twin's, bit for bit
    assert_same_downloads(evaluate, twin_evaluate)
    assert_same_downloads(train, twin_train)


PERTURBED = [n for n in strategy_names() if n not in ("local", "flora")]


@pytest.mark.parametrize("name", PERTURBED)
def test_configure_train_continues_from_other_arrays_it_is_given(name: str) -> None:
    # Prepare: after round 1, arrays of the same keys and shapes, every value moved
    strategy, twin = keyword_strategy(name), keyword_strategy(name)
    grid, twin_grid = InProcessGrid(profile_app, node_configs(3)), InProcessGrid(profile_app, node_configs(3))
    arrays, _ = trained_round(strategy, grid, ArrayRecord())
    trained_round(twin, twin_grid, ArrayRecord())
    assert arrays is not None
    strategy.configure_evaluate(1, arrays, ConfigRecord(), grid)  # as in Flower's loop (FedHera allocates round 2 here)
    twin.configure_evaluate(1, arrays, ConfigRecord(), twin_grid)
    rng = np.random.default_rng(0)
    given = {key: (value + 0.05 * rng.standard_normal(value.shape)).astype(value.dtype)
             for key, value in from_array_record(arrays).items()}
    # Execute
    train = list(strategy.configure_train(2, to_array_record(given), ConfigRecord(), grid))
    twin_train = list(twin.configure_train(2, arrays, ConfigRecord(), twin_grid))
    # Assert: the strategy's global arrays now describe the given model (s B A per module, head) ...
    alpha = strategy.experiment.model.lora_alpha
    now, expected = model_of(strategy.global_arrays(), alpha), model_of(given, alpha)
    assert now.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(now[key], expected[key], rtol=1e-4, atol=1e-6, err_msg=key)
    # ... and the round's downloads were built from them: every array differs from the twin's (FedTreeLoRA's
    # clients in the tree get their cluster's experts, which no arrays hold: only their head comes from them)
    for (_, arrays_a, _), (_, arrays_b, _) in zip(downloads(train), downloads(twin_train), strict=True):
        assert arrays_a.keys() == arrays_b.keys() and arrays_a
        from_given = [k for k in arrays_a if name != "fedtreelora" or k.startswith(HEAD_PREFIX)]
        assert from_given and not any(np.array_equal(arrays_a[k], arrays_b[k]) for k in from_given)


def test_fedit_sends_each_client_the_first_components_of_the_arrays_it_is_given() -> None:
    # Prepare: FedIT at r_max = 8 (ranks 2, 4, 8); arrays of the global adapter's shapes, by hand
    strategy = keyword_strategy("fedit")
    grid = InProcessGrid(profile_app, node_configs(3))
    list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))  # profiles, setup
    rng = np.random.default_rng(1)
    given = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in strategy.global_arrays().items()}
    # Execute: with a config of the user's own (one key is fedlora's: it does not travel)
    messages = list(strategy.configure_train(2, to_array_record(given), ConfigRecord({"note": 7, "lora-rank": 1}), grid))
    # Assert: client k (rank r_k) gets rows :r_k of every A, columns :r_k of every B, the head as given
    assert len(messages) == 3
    for node, arrays, config in downloads(messages):
        rank = RANKS[node - NODE]
        assert config["note"] == 7 and config["lora-rank"] == rank and config["server-round"] == 2
        assert arrays.keys() == given.keys()
        for key, value in given.items():
            expected = value[:rank] if key.endswith(A_SUFFIX) else value[:, :rank] if key.endswith(B_SUFFIX) else value
            np.testing.assert_array_equal(arrays[key], expected, err_msg=key)


@pytest.mark.parametrize("name", ["fedit", "fedsa_lora", "flora", "ffa_lora", "local"])
def test_arrays_a_strategy_cannot_continue_from_are_refused(name: str) -> None:
    # Prepare
    strategy = keyword_strategy(name)
    grid = InProcessGrid(profile_app, node_configs(3))
    arrays, _ = trained_round(strategy, grid, ArrayRecord())
    assert arrays is not None
    given = from_array_record(arrays)
    # Execute / Assert: a wrong shape, a NaN, and per method what it cannot take
    bad: list[tuple[dict[str, np.ndarray], str]] = [({"m::A": np.zeros((2, 2), np.float32)}, "missing|unexpected")]
    if given:
        key = next(iter(given))
        bad += [({**given, key: given[key][:1]}, "has shape"),
                ({**given, key: np.full_like(given[key], np.nan)}, "not finite")]
    if name == "flora":
        bad.append(({k: 2 * v for k, v in given.items()}, "cannot continue from other arrays than the ones it returned"))
    if name == "ffa_lora":  # its frozen A is no array: arrays that carry one are refused
        bad.append(({**given, **strategy.shared_A}, "unexpected"))
    for payload, message in bad:
        with pytest.raises(ArraysError, match=message):
            strategy.configure_train(2, to_array_record(payload), ConfigRecord(), grid)


@pytest.mark.e2e
def test_flowers_start_runs_the_rounds_with_the_arrays_the_strategy_returns() -> None:
    # Prepare: FedSA-LoRA (no single global model: it returns the global A and the head) from keywords,
    # and clients that answer every message at once (honest random uploads, fixed evaluation scores)
    strategy = keyword_strategy("fedsa_lora")
    seen: list[Message] = []

    def clients(msg: Message, context: Context) -> Message:
        seen.append(msg)
        if msg.metadata.message_type == "query":
            return profile_app(msg, context)
        if msg.metadata.message_type == "train":
            return honest_reply(strategy, msg, int(msg.content.config_records["config"]["server-round"]))
        k = msg.metadata.dst_node_id - NODE
        metrics = {"accuracy": 0.25 * (k + 1), "loss": 1.0, "num-examples": 10.0, "partition-id": float(k)}
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    # Execute: Flower's own loop, 3 rounds (the keywords said train.rounds = 2)
    result = strategy.start(grid=InProcessGrid(clients, node_configs(3)), initial_arrays=ArrayRecord(), num_rounds=3)
    # Assert: the final arrays are the strategy's global ones, every round trained and evaluated
    final, current = from_array_record(result.arrays), strategy.global_arrays()
    assert final.keys() == current.keys() and all(np.array_equal(final[k], current[k]) for k in current)
    assert {k.rsplit("::", 1)[-1] for k in final if not k.startswith(HEAD_PREFIX)} == {"A"}  # A (and head) only
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    # personalised accuracy 0.25 k + 0.25 over clients 0..2 with 10 examples each: 0.5
    assert [float(m["personalized-accuracy"]) for m in result.evaluate_metrics_clientapp.values()] == [0.5] * 3
    # the clients were told the run has 3 rounds (start sets train.rounds)
    sent = [m for m in seen if m.metadata.message_type in ("train", "evaluate")]
    assert {config_from_json(str(m.content.config_records["config"]["experiment"])).train.rounds for m in sent} == {3}


# ----------------------------------------------------------------------------- a user's ServerApp
@pytest.mark.e2e
def test_a_users_serverapp_runs_a_fedlora_strategy_with_flowers_start(tmp_path: Path) -> None:
    """examples/flower_serverapp: HetLoRA built from keywords, Flower's ``start``, fedlora's
    ClientApp on three in-process nodes (2 rounds of 5 steps on the tiny BERT)."""
    from safetensors.torch import load_file

    from fedlora.clients.app import app as client_app

    # Prepare: the app's module, its run config, three nodes
    spec = importlib.util.spec_from_file_location("flower_serverapp", ROOT / "examples/flower_serverapp/server_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import tomllib

    run_config = tomllib.loads((ROOT / "examples/flower_serverapp/pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    run_config["out-dir"] = str(tmp_path)
    grid = InProcessGrid(client_app, node_configs(int(run_config["num-clients"])))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    # Execute
    module.app(grid, context)
    # Assert: the final global model is HetLoRA's rank-8 (r_max) adapter, trained (B starts at zero) and finite
    final = load_file(tmp_path / "final_model.safetensors")
    factors, head = split_payload({k: v.numpy() for k, v in final.items()})
    assert len(factors) == 4 and head
    for module_name, f in factors.items():
        assert f.A.shape == (8, 32) and f.B.shape == (32, 8), module_name
        assert np.isfinite(f.B).all() and np.abs(f.B).max() > 0, module_name


# ------------------------------------------------------------------------------ the method contract
@pytest.mark.parametrize("name", strategy_names())
def test_a_download_is_one_value_for_its_round_and_changes_nothing(name: str) -> None:
    """A method's ``download`` is one value per client and round (the round it is for, payload,
    config, the shapes of the reply) with no side effect: calling it again gives the same value and
    leaves the checkpointed state as it was (FedHera memoises each push, so that the evaluation
    after round t and round t + 1's training send the same one)."""
    from fedlora import state

    # Prepare: round 1 trained, its evaluation messages sent (for round 2)
    strategy = keyword_strategy(name)
    grid = InProcessGrid(profile_app, node_configs(3))
    arrays, _ = trained_round(strategy, grid, ArrayRecord())
    evaluate = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    sent = strategy.sent_this_round("evaluate")
    before = state.encode(strategy.state_dict())
    # Execute: each client's download for round 2 asked twice more
    again = [(strategy.download(k, 2, "evaluate"), strategy.download(k, 2, "train")) for k in sent]
    # Assert: the value states its round and equals what was sent; nothing moved
    for (k, download), (twice, train) in zip(sent.items(), again):
        assert (download.partition, download.for_round, download.phase) == (k, 2, "evaluate") == (
            twice.partition, twice.for_round, twice.phase)
        assert download.payload.keys() == twice.payload.keys() == train.payload.keys()
        assert all(np.array_equal(download.payload[key], twice.payload[key]) for key in download.payload)
        assert all(np.array_equal(train.payload[key], twice.payload[key]) for key in download.payload)
        assert download.config == twice.config and download.upload == train.upload
    assert len(evaluate) == len(sent)
    after = state.encode(strategy.state_dict())
    assert repr(after[0]) == repr(before[0]) and after[1].keys() == before[1].keys()
    assert all(np.array_equal(after[1][key], before[1][key]) for key in before[1])
