"""Hostile clients: no reply crashes the server or moves the model unless it is valid; weights the
server can stand behind; replies bound to their sender.

Strategies are built on the tiny random BERT of configs/smoke.toml without training: an in-process
grid answers the profile query (``profile_app``), replies are made here. The property-based test
feeds every registered strategy's ``aggregate_train`` and ``aggregate_evaluate`` random malformed
and adversarial replies mixed with valid ones, next to a twin strategy that gets the valid ones
only: the two must stay bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategy_helpers import short_run_overrides

from fedlora.app.server import run_server
from fedlora.config import ConfigError, load_config
from fedlora.data import build_federated_data
from fedlora.evaluation import GlobalEvaluator
from fedlora.lora import ADAPTER_DTYPE, Combine, weighted_average
from fedlora.profile import ClientProfile
from fedlora.protocol import MetricRule
from fedlora.results import RoundRecord
from fedlora.schema import FaultsConfig
from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.base import LoRAStrategy
from fedlora.strategies.registry import create_strategy, strategy_names
from fedlora.strategies.replies import capped_weights
from fedlora.strategies.validation import norm_outliers, ratio_bound, reference_norm
from fedlora.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
RANKS = [2, 4, 8, 2, 4, 8]  # configs/smoke.toml's clients.ranks (3 clients), twice for the property test's 6
DECLARED = [100, 110, 120, 100, 110, 120]  # training examples each client declares (no honest share reaches 0.6)
SIX = ("data.num_clients=6", "clients.ranks=[2, 4, 8, 2, 4, 8]", "federation.min_clients=1")
NODE = 1000  # InProcessGrid: node 1000 + k holds partition k


# ---------------------------------------------------------------------------------- fixtures
@cache
def federated() -> Any:
    return build_federated_data(load_config(SMOKE).data)


@cache
def evaluator(name: str) -> tuple[GlobalEvaluator, dict[str, tuple[int, int]]]:
    """The server's models for strategy ``name`` (its init, e.g. FedPissa's PiSSA) and the module shapes."""
    config = load_config(SMOKE, [f"strategy.name={name}", *short_run_overrides(name)])
    init = create_strategy(config, lambda rank: {}, {"m": (4, 4)}).model_init()
    server = GlobalEvaluator(config.model, config.train, federated(), init=init)
    return server, server.module_shapes()


def profile_app(msg: Message, context: Context) -> Message:
    """A ClientApp that only answers the query: partition k with rank and declared examples from
    its node config (defaults RANKS[k], DECLARED[k])."""
    k, node = int(context.node_config["partition-id"]), context.node_config
    profile = ClientProfile(partition_id=k, rank=int(node["rank"] if "rank" in node else RANKS[k]),
                            num_train_examples=int(node["declared"] if "declared" in node else DECLARED[k]),
                            fedlora_version=str(node.get("version", __version__)))
    return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)


def connected(name: str, overrides: tuple[str, ...] = (), nodes: list[dict[str, Any]] | None = None
              ) -> tuple[LoRAStrategy, InProcessGrid]:
    """Strategy ``name`` on the smoke experiment and a grid of profile-only clients."""
    config = load_config(SMOKE, [f"strategy.name={name}", *short_run_overrides(name), *overrides])
    server, shapes = evaluator(name)
    nodes = nodes or [{"partition-id": k} for k in range(config.data.num_clients)]
    return create_strategy(config, server.initial_adapter, shapes), InProcessGrid(profile_app, nodes)


def partition(msg: Message) -> int:
    return msg.metadata.dst_node_id - NODE


def reply(msg: Message, payload: dict[str, np.ndarray], metrics: dict[str, Any]) -> Message:
    arrays = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)


def honest_upload(strategy: LoRAStrategy, msg: Message, server_round: int, seed: int) -> dict[str, np.ndarray]:
    k = partition(msg)
    rng = np.random.default_rng([seed, k, server_round])
    shapes = strategy.sent_this_round("train")[k].expected()  # the download it answers
    return {key: (0.01 * rng.standard_normal(shape)).astype(np.float32) for key, shape in shapes.items()}


def honest_metrics(k: int, server_round: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, k, server_round, 1])
    return {"num-examples": DECLARED[k] - int(rng.integers(0, 20)), "partition-id": k, "train-loss": 0.5 + k,
            "train-seconds": 1.0, "train-examples": 40}


def honest_train(strategy: LoRAStrategy, msg: Message, server_round: int, seed: int) -> Message:
    return reply(msg, honest_upload(strategy, msg, server_round, seed), honest_metrics(partition(msg), server_round, seed))


def honest_evaluate(msg: Message, seed: int) -> Message:
    k = partition(msg)
    rng = np.random.default_rng([seed, k, 7])
    metrics = {"accuracy": float(rng.uniform()), "loss": 1.0, "num-examples": float(rng.integers(1, 50)),
               "partition-id": float(k), "val-accuracy": float(rng.uniform()), "val-examples": 5.0,
               "global-accuracy": float(rng.uniform())}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)


# ------------------------------------------------------------------------- hostile replies
TRAIN_KINDS = ["no-metrics", "no-arrays", "empty", "metrics-as-config", "keys", "dtype", "shape", "nonfinite",
               "overflow", "huge-norm", "count", "partition", "metric-range", "metric-type", "list-metric",
               "too-many-metrics", "metric-record", "corrupt-array", "lying-array", "stype", "error"]
EVALUATE_KINDS = ["no-metrics", "empty", "count", "partition", "metric-range", "metric-type", "list-metric",
                  "missing-accuracy", "metric-record", "error"]
NAN, INF = math.nan, math.inf
# metric records that break the contract (fedlora/protocol.py) added to a valid reply: undeclared keys,
# keys too long or too many, bytes over budget, values out of range, companions missing
BAD_TRAIN_METRICS: list[dict[str, Any]] = [
    {"custom-metric": 1.0}, {"noise-made-up": 1.0}, {"fedtreelora-lam-x": 0.5}, {"fedtreelora-lam-": 0.5},
    {"noise-" + "x" * 10**5: 1.0}, {f"noise-{i:02d}" + "x" * 10**4: 1.0 for i in range(20)},
    {f"m{i:03d}" + "x" * 58: 1.0 for i in range(120)}, {f"fedtreelora-lam-{i}": 0.5 for i in range(200)},
    {"noise-precision": 2e306}, {"noise-flagged-fraction": -50.0}, {"fedtreelora-lam-0": 1e300},
    {"noise-flagged": 5.0, "noise-samples": 2.0}, {"noise-weight-sum-clean": 9.0, "noise-weight-n-clean": 3.0},
    {"noise-true-positives": 5.0, "noise-flagged": 6.0, "noise-noisy": 2.0},
    {"received-token-accuracy": 0.5}, {"received-tokens": 0.0, "received-token-accuracy": 0.5, "received-loss": 1.0},
    {"received-token-accuracy": 5.0, "received-loss": 1.0, "received-tokens": 10.0},
    {"received-token-accuracy": 0.5, "received-loss": INF, "received-tokens": 10.0},
    {"received-accuracy": 0.5}, {"train-seconds": 1.7e308}, {"train-examples": 1.7e308}, {"train-steps": 1e15},
    {"fedhera-r-main": 5.0, "fedhera-r-tot": 2.0}, {"upload-rank": 0.0}, {"setup-seconds": -1.0},
]
BAD_EVALUATE_METRICS: list[dict[str, Any]] = [
    {"custom-metric": 1.0}, {"x" * 10**5: 1.0}, {f"accuracy-{i}": 1.0 for i in range(200)},
    {"global-rouge-l": 0.5}, {"global-loss": 1.0, "global-rouge-l": 0.5}, {"loss": 1e300}, {"num-examples": 1e15},
    {"dpa-mean-weight": 3.0}, {"received-accuracy": 0.5}, {"val-loss": 1.0},
]


def _bypass(record: MetricRecord, key: str, value: Any) -> MetricRecord:
    """Put a value Flower's MetricRecord refuses (text, None, a dict) into it, as a peer that does
    not use Flower's client could."""
    record.__dict__["_data"][key] = value
    return record


def _any_key(data: st.DataObject, payload: dict[str, np.ndarray]) -> str:
    return data.draw(st.sampled_from(sorted(payload)))


def hostile_train(data: st.DataObject, msg: Message, payload: dict[str, np.ndarray], metrics: dict[str, Any]
                  ) -> Message:
    """A malformed or adversarial version of an honest training reply (drawn by hypothesis)."""
    kind = data.draw(st.sampled_from(TRAIN_KINDS))
    k = int(metrics["partition-id"])
    payload, metrics = dict(payload), dict(metrics)
    if not payload and kind in ("dtype", "shape", "nonfinite", "overflow", "huge-norm", "corrupt-array",
                                "lying-array", "stype"):
        kind = "keys"  # nothing to corrupt in an empty upload: an unexpected key instead
    if kind == "error":
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="x" * data.draw(st.integers(0, 5000))),
                       reply_to=msg)
    if kind == "no-metrics":
        return Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in payload.items()})}), reply_to=msg)
    if kind == "no-arrays":
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
    if kind == "empty":
        return Message(RecordDict(), reply_to=msg)
    if kind == "metrics-as-config":
        arrays = ArrayRecord({k: Array(v) for k, v in payload.items()})
        return Message(RecordDict({"arrays": arrays, "metrics": ConfigRecord({**metrics, "num-examples": "many"})}),
                       reply_to=msg)
    if kind == "keys":
        if payload and data.draw(st.booleans()):
            del payload[_any_key(data, payload)]
        else:
            payload[data.draw(st.sampled_from(["evil::A", "head::extra.weight", "layer.0.query::A "]))] = np.ones((2, 2), np.float32)
    elif kind == "dtype":
        key = _any_key(data, payload)
        dtype = data.draw(st.sampled_from(["int32", "int64", "uint8", "complex64", "complex128", "bool", "str"]))
        payload[key] = np.full(payload[key].shape, "0.1") if dtype == "str" else payload[key].astype(dtype)
    elif kind == "shape":
        key = _any_key(data, payload)
        shape = list(payload[key].shape)
        if data.draw(st.booleans()):
            shape.append(1)
        else:
            shape[data.draw(st.integers(0, len(shape) - 1))] += data.draw(st.integers(1, 3))
        payload[key] = np.zeros(shape, np.float32)
    elif kind == "nonfinite":
        key = _any_key(data, payload)
        flat = payload[key].copy().reshape(-1)
        flat[data.draw(st.integers(0, flat.size - 1))] = data.draw(st.sampled_from([NAN, INF, -INF]))
        payload[key] = flat.reshape(payload[key].shape)
    elif kind == "overflow":  # finite in float64, Inf once cast to the adapters' float32
        key = _any_key(data, payload)
        payload[key] = payload[key].astype(np.float64)
        payload[key].reshape(-1)[0] = 1e300
    elif kind == "huge-norm":
        factor = data.draw(st.sampled_from([1e4, 1e8, 1e15, 1e30]))
        payload = {key: (value.astype(np.float64) * factor).astype(np.float32) for key, value in payload.items()}
    elif kind == "count":
        metrics["num-examples"] = data.draw(st.sampled_from(
            [-5, 0, 2.5, NAN, INF, -INF, 1e30, 10**400, DECLARED[k] + 1, DECLARED[k] + 10**6, [1.0, 2.0]]))
    elif kind == "partition":
        others = [p for p in range(len(RANKS)) if p != k]
        metrics["partition-id"] = data.draw(st.sampled_from([*others, -1, len(RANKS), 10**9, NAN, 0.5, [float(k)]]))
    elif kind == "metric-range":
        key, value = data.draw(st.sampled_from([
            ("train-loss", -1.0), ("train-loss", INF), ("received-accuracy", 1.5), ("received-accuracy", -0.1),
            ("received-accuracy", NAN), ("train-examples", -3), ("train-examples", 2.5), ("train-seconds", -1.0),
            ("dp-epsilon", -1.0), ("dp-epsilon", NAN)]))
        metrics[key] = value
    elif kind == "list-metric":
        metrics[data.draw(st.sampled_from(["train-loss", "custom-metric", "upload-rank"]))] = [1.0, 2.0]
    elif kind == "too-many-metrics":
        metrics |= {f"m{i}": float(i) for i in range(300)}
    elif kind == "metric-record":
        metrics |= data.draw(st.sampled_from(BAD_TRAIN_METRICS))
    arrays = ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in payload.items()})
    if kind in ("corrupt-array", "lying-array", "stype"):
        key = _any_key(data, payload)
        shape = tuple(payload[key].shape)
        if kind == "corrupt-array":
            forged = Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=data.draw(st.binary(max_size=64)))
        elif kind == "lying-array":  # the metadata says the expected float32 array, the bytes hold another
            other = data.draw(st.sampled_from([np.zeros((3,), np.float32), np.zeros(shape, np.complex64),
                                               np.zeros(shape, np.int32)]))
            forged = Array(dtype="float32", shape=shape, stype="numpy.ndarray", data=Array(other).data)
        else:
            forged = Array(dtype="float32", shape=shape, stype="torch.Tensor", data=Array(payload[key]).data)
        arrays[key] = forged
    record = MetricRecord(metrics)
    if kind == "metric-type":
        key = data.draw(st.sampled_from(["num-examples", "partition-id", "train-loss", "custom-metric"]))
        _bypass(record, key, data.draw(st.sampled_from(["many", None, {"a": 1}, b"x", True])))
    return Message(RecordDict({"arrays": arrays, "metrics": record}), reply_to=msg)


def hostile_evaluate(data: st.DataObject, msg: Message, seed: int) -> Message:
    """A malformed or adversarial version of an honest evaluation reply."""
    kind = data.draw(st.sampled_from(EVALUATE_KINDS))
    k = partition(msg)
    metrics = dict(honest_evaluate(msg, seed).content.metric_records["metrics"])
    if kind == "error":
        return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="evaluation failed"), reply_to=msg)
    if kind == "no-metrics":
        return Message(RecordDict({"config": ConfigRecord(metrics)}), reply_to=msg)
    if kind == "empty":
        return Message(RecordDict(), reply_to=msg)
    if kind == "count":
        metrics["num-examples"] = data.draw(st.sampled_from([-1.0, NAN, INF, 2.5, 10**400]))
    elif kind == "partition":
        metrics["partition-id"] = data.draw(st.sampled_from([*(p for p in range(len(RANKS)) if p != k), NAN, -1.0]))
    elif kind == "metric-range":
        key = data.draw(st.sampled_from(["accuracy", "val-accuracy", "global-accuracy", "loss", "val-examples"]))
        bad = [-0.5, NAN, INF, -INF] if key == "loss" else [-0.5, 1.5, NAN, INF, -INF]  # a loss may be 1.5
        metrics[key] = data.draw(st.sampled_from(bad))
    elif kind == "list-metric":
        metrics["accuracy"] = [0.5, 0.5]
    elif kind == "missing-accuracy":
        del metrics["accuracy"]
    elif kind == "metric-record":
        bad = data.draw(st.sampled_from([*BAD_EVALUATE_METRICS, "no-val-examples"]))
        if bad == "no-val-examples":  # val-accuracy without the examples it is weighted by
            del metrics["val-examples"]
        else:
            metrics |= bad
    record = MetricRecord(metrics)
    if kind == "metric-type":
        _bypass(record, data.draw(st.sampled_from(["accuracy", "num-examples", "partition-id"])), "high")
    return Message(RecordDict({"metrics": record}), reply_to=msg)


def stray(msg_type: str, node: int, content: RecordDict) -> Message:
    """A reply from ``node`` to a message the server never sent it."""
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=node, message_type=msg_type))


# ---------------------------------------------------------------------------- comparisons
NOT_COMPARED = {"records", "started"}  # the round records differ by the rejections they count
COUNTERS = {"rejected", "rejections", "wire_bytes_up", "wire_bytes_eval", "seconds", "aggregation_seconds"}


def same(a: Any, b: Any) -> bool:
    """Bit-identical: arrays with their dtypes, NaN equal to NaN, RNG states, nested containers."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")))
    if isinstance(a, np.random.Generator):
        return a.bit_generator.state == b.bit_generator.state
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset)):
        return a == b
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if dataclasses.is_dataclass(a) or hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and same(vars(a), vars(b))
    return bool(a == b)


def assert_same_strategy(honest_only: LoRAStrategy, attacked: LoRAStrategy) -> None:
    state_a = {k: v for k, v in honest_only.state_dict().items() if k not in NOT_COMPARED}
    state_b = {k: v for k, v in attacked.state_dict().items() if k not in NOT_COMPARED}
    assert state_a.keys() == state_b.keys()
    for key, value in state_a.items():
        assert same(value, state_b[key]), f"strategy state '{key}' differs"
    global_a, global_b = honest_only.global_payload(), attacked.global_payload()
    assert same(global_a, global_b), "global model differs"
    assert all(v.dtype == ADAPTER_DTYPE for v in (global_b or {}).values()), "the global model left float32"


def assert_same_record(a: RoundRecord, b: RoundRecord) -> None:
    for field in dataclasses.fields(RoundRecord):
        if field.name not in COUNTERS:
            assert same(getattr(a, field.name), getattr(b, field.name)), f"record field '{field.name}' differs"


def assert_same_messages(a: list[Message], b: list[Message]) -> None:
    assert [m.metadata.dst_node_id for m in a] == [m.metadata.dst_node_id for m in b]
    for ma, mb in zip(a, b):
        arrays_a = {k: v.numpy() for k, v in ma.content.array_records["arrays"].items()}
        arrays_b = {k: v.numpy() for k, v in mb.content.array_records["arrays"].items()}
        assert same(arrays_a, arrays_b), "the next round's downloads differ"
        assert dict(ma.content.config_records["config"]) == dict(mb.content.config_records["config"])


# --------------------------------------------------------------------------- property test
def train_round(data: st.DataObject, twins: tuple[LoRAStrategy, LoRAStrategy], grids: tuple[InProcessGrid, InProcessGrid],
                server_round: int, seed: int) -> None:
    """One training round: the twin `honest_only` gets the valid replies, `attacked` the same
    and, from every other client (at least half of them), malformed and adversarial ones."""
    honest_only, attacked = twins
    sent_a = list(honest_only.configure_train(server_round, ArrayRecord(), ConfigRecord(), grids[0]))
    sent_b = list(attacked.configure_train(server_round, ArrayRecord(), ConfigRecord(), grids[1]))
    assert_same_messages(sent_a, sent_b)  # the state so far is the same: so are the downloads
    sampled = [partition(m) for m in sent_b]
    valid = data.draw(st.sets(st.sampled_from(sampled), max_size=len(sampled) // 2), label="valid partitions")
    honest = [honest_train(honest_only, m, server_round, seed) for m in sent_a if partition(m) in valid]
    replies = [honest_train(attacked, m, server_round, seed) for m in sent_b if partition(m) in valid]
    hostile = []
    for msg in sent_b:
        if partition(msg) not in valid:  # one bad reply, sometimes a second (refused as a duplicate)
            base = honest_upload(attacked, msg, server_round, seed), honest_metrics(partition(msg), server_round, seed)
            hostile += [hostile_train(data, msg, *base) for _ in range(data.draw(st.integers(1, 2)))]
    if data.draw(st.booleans(), label="a node the server does not know"):
        hostile.append(stray(MessageType.TRAIN, 4242, RecordDict({"metrics": MetricRecord(honest_metrics(0, 1, seed))})))
    for k in sorted(set(attacked.roster.partitions) - set(sampled)):  # not sampled, replies anyway
        hostile.append(stray(MessageType.TRAIN, NODE + k, RecordDict({"metrics": MetricRecord(honest_metrics(k, 1, seed))})))

    honest_only.aggregate_train(server_round, honest)
    attacked.aggregate_train(server_round, data.draw(st.permutations(replies + hostile), label="order"))

    errors = sum(m.has_error() for m in hostile)
    record = attacked.record(server_round)
    assert honest_only.record(server_round).rejected == 0
    assert record.rejected == len(hostile) - errors, record.rejections
    assert record.clients == len(valid) and all("(node " in line for line in record.rejections)
    assert_same_strategy(honest_only, attacked)
    assert_same_record(honest_only.record(server_round), record)


def evaluate_round(data: st.DataObject, twins: tuple[LoRAStrategy, LoRAStrategy],
                   grids: tuple[InProcessGrid, InProcessGrid], server_round: int, seed: int) -> None:
    """The round's personalised evaluation, the same way."""
    honest_only, attacked = twins
    rejected = attacked.record(server_round).rejected
    asked_a = list(honest_only.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grids[0]))
    asked_b = list(attacked.configure_evaluate(server_round, ArrayRecord(), ConfigRecord(), grids[1]))
    asked = [partition(m) for m in asked_b]
    answering = data.draw(st.sets(st.sampled_from(asked), max_size=len(asked) // 2), label="valid evaluations")
    hostile = [hostile_evaluate(data, m, seed) for m in asked_b if partition(m) not in answering]
    honest_only.aggregate_evaluate(server_round, [honest_evaluate(m, seed) for m in asked_a if partition(m) in answering])
    attacked.aggregate_evaluate(server_round, data.draw(st.permutations(
        [honest_evaluate(m, seed) for m in asked_b if partition(m) in answering] + hostile)))
    errors = sum(m.has_error() for m in hostile)
    assert attacked.record(server_round).rejected == rejected + len(hostile) - errors
    assert_same_record(honest_only.record(server_round), attacked.record(server_round))


@pytest.mark.e2e
@pytest.mark.parametrize("name", strategy_names())
@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_reply_crashes_the_server_or_moves_the_model(name: str, data: st.DataObject) -> None:
    # Prepare: twin strategies over six clients; one sees the valid replies only
    seed = data.draw(st.integers(0, 2**16), label="seed")
    (honest_only, grid_a), (attacked, grid_b) = connected(name, SIX), connected(name, SIX)
    twins, grids = (honest_only, attacked), (grid_a, grid_b)
    # Execute + Assert: two rounds of training and evaluation; after each step the twins are
    # bit-identical (state, global model, downloads, results), every hostile reply refused and counted
    for server_round in (1, 2):
        train_round(data, twins, grids, server_round, seed)
        evaluate_round(data, twins, grids, server_round, seed)


# ------------------------------------------------------------ every malformation, one by one
def _arrays(payload: dict[str, np.ndarray], **forged: Array) -> ArrayRecord:
    record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in payload.items()})
    for key, array in forged.items():
        record[key.replace("__", "::")] = array
    return record


def _with(payload: dict[str, np.ndarray], key: str, value: np.ndarray) -> dict[str, np.ndarray]:
    return {**payload, key: value}


A_KEY = "bert.encoder.layer.0.attention.self.query::A"  # tiny-bert's first adapted module
BAD_TRAIN = {  # case -> (payload, metrics) -> the reply's content
    **{f"dtype-{d}": (lambda p, m, d=d: RecordDict({"arrays": _arrays(_with(p, A_KEY, p[A_KEY].astype(d))),
                                                     "metrics": MetricRecord(m)}))
       for d in ("int32", "int64", "uint8", "bool", "complex64", "complex128")},
    "dtype-text": lambda p, m: RecordDict({"arrays": _arrays(_with(p, A_KEY, np.full(p[A_KEY].shape, "0.1"))),
                                           "metrics": MetricRecord(m)}),
    **{f"lying-{d}": (lambda p, m, d=d: RecordDict({"arrays": _arrays(p, **{A_KEY.replace("::", "__"): Array(
        dtype="float32", shape=p[A_KEY].shape, stype="numpy.ndarray", data=Array(np.zeros(p[A_KEY].shape, d)).data)}),
        "metrics": MetricRecord(m)})) for d in ("complex64", "int32")},
    "lying-shape": lambda p, m: RecordDict({"arrays": _arrays(p, **{A_KEY.replace("::", "__"): Array(
        dtype="float32", shape=p[A_KEY].shape, stype="numpy.ndarray", data=Array(np.zeros(3, np.float32)).data)}),
        "metrics": MetricRecord(m)}),
    "corrupt-bytes": lambda p, m: RecordDict({"arrays": _arrays(p, **{A_KEY.replace("::", "__"): Array(
        dtype="float32", shape=p[A_KEY].shape, stype="numpy.ndarray", data=b"\x93NUMPY garbage")}), "metrics": MetricRecord(m)}),
    "torch-stype": lambda p, m: RecordDict({"arrays": _arrays(p, **{A_KEY.replace("::", "__"): Array(
        dtype="float32", shape=p[A_KEY].shape, stype="torch.Tensor", data=Array(p[A_KEY]).data)}), "metrics": MetricRecord(m)}),
    "shape": lambda p, m: RecordDict({"arrays": _arrays(_with(p, A_KEY, np.zeros((9, 32), np.float32))), "metrics": MetricRecord(m)}),
    "missing-key": lambda p, m: RecordDict({"arrays": _arrays({k: v for k, v in p.items() if k != A_KEY}), "metrics": MetricRecord(m)}),
    "extra-key": lambda p, m: RecordDict({"arrays": _arrays(_with(p, "evil::A", np.ones((2, 2), np.float32))),
                                          "metrics": MetricRecord(m)}),
    **{f"value-{v}": (lambda p, m, v=v: RecordDict({"arrays": _arrays(_with(p, A_KEY, np.full(p[A_KEY].shape, v, np.float32))),
                                                      "metrics": MetricRecord(m)})) for v in (NAN, INF, -INF)},
    "overflow": lambda p, m: RecordDict({"arrays": _arrays(_with(p, A_KEY, np.full(p[A_KEY].shape, 1e300))),
                                         "metrics": MetricRecord(m)}),
    **{f"norm-x{f:g}": (lambda p, m, f=f: RecordDict({"arrays": _arrays({k: (v * f).astype(np.float32) for k, v in p.items()}),
                                                       "metrics": MetricRecord(m)})) for f in (1e4, 1e30)},
    **{f"count-{c!r}": (lambda p, m, c=c: RecordDict({"arrays": _arrays(p), "metrics": MetricRecord({**m, "num-examples": c})}))
       for c in (-5, 0, 2.5, NAN, INF, 1e30, 10**400, DECLARED[2] + 1, [1.0, 2.0])},
    **{f"partition-{c!r}": (lambda p, m, c=c: RecordDict({"arrays": _arrays(p), "metrics": MetricRecord({**m, "partition-id": c})}))
       for c in (0, 1, -1, 99, NAN, 0.5, [2.0])},
    **{f"{key}={v!r}": (lambda p, m, key=key, v=v: RecordDict({"arrays": _arrays(p), "metrics": MetricRecord({**m, key: v})}))
       for key, v in (("train-loss", -1.0), ("train-loss", INF), ("received-accuracy", 1.5), ("received-accuracy", NAN),
                      ("train-examples", -3), ("train-seconds", -1.0), ("dp-epsilon", -1.0), ("custom", [1.0]),
                      ("train-examples", 1.7e308), ("received-token-accuracy", 0.5), ("fedtreelora-lam-x", 0.5))},
    **{f"text-{key}": (lambda p, m, key=key: RecordDict({"arrays": _arrays(p), "metrics": _bypass(MetricRecord(m), key, "many")}))
       for key in ("num-examples", "partition-id", "custom")},
    "too-many-metrics": lambda p, m: RecordDict({"arrays": _arrays(p), "metrics": MetricRecord({**m, **{f"m{i}": 1.0 for i in range(300)}})}),
    "no-metrics": lambda p, m: RecordDict({"arrays": _arrays(p)}),
    "metrics-as-config": lambda p, m: RecordDict({"arrays": _arrays(p), "metrics": ConfigRecord(m)}),
    "no-arrays": lambda p, m: RecordDict({"metrics": MetricRecord(m)}),
    "empty": lambda p, m: RecordDict(),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAIN))
def test_every_kind_of_bad_training_reply_is_refused_and_moves_nothing(case: str) -> None:
    # Prepare: FedIT twins over three clients; client 2 sends the bad reply to `attacked`, nothing to `honest_only`
    (honest_only, grid_a), (attacked, grid_b) = connected("fedit"), connected("fedit")
    sent_a = list(honest_only.configure_train(1, ArrayRecord(), ConfigRecord(), grid_a))
    sent_b = list(attacked.configure_train(1, ArrayRecord(), ConfigRecord(), grid_b))
    bad = Message(BAD_TRAIN[case](honest_upload(attacked, sent_b[2], 1, 0), honest_metrics(2, 1, 0)), reply_to=sent_b[2])
    # Execute
    honest_only.aggregate_train(1, [honest_train(honest_only, m, 1, 0) for m in sent_a[:2]])
    attacked.aggregate_train(1, [honest_train(attacked, m, 1, 0) for m in sent_b[:2]] + [bad])
    # Assert
    assert attacked.record(1).rejected == 1 and attacked.record(1).rejections[0].startswith("client 2 (node 1002): ")
    assert_same_strategy(honest_only, attacked)
    assert_same_record(honest_only.record(1), attacked.record(1))


# Replies that crashed the server (issue 40): strategy, and the metrics two clients add to honest replies
CRASHES = {
    "token-accuracy-without-tokens": ("fedit", {"received-token-accuracy": 0.5}),  # KeyError
    "zero-tokens": ("fedit", {"received-token-accuracy": 0.5, "received-loss": 1.0, "received-tokens": 0}),  # / 0
    "huge-train-examples": ("fedit", {"train-examples": 1.7e308}),  # the two sum to inf: OverflowError in int()
    "lambda-of-no-block": ("fedtreelora", {"fedtreelora-lam-x": 0.5}),  # ValueError in int("x")
}


@pytest.mark.parametrize("case", sorted(CRASHES))
def test_the_replies_that_crashed_the_server_are_refused_and_the_run_goes_on(case: str) -> None:
    # Prepare: twin strategies over six clients; in `attacked`, the last two sampled clients add the bad metrics
    name, bad = CRASHES[case]
    (honest_only, grid_a), (attacked, grid_b) = connected(name, SIX), connected(name, SIX)
    for server_round in (1, 2):
        sent_a = list(honest_only.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid_a))
        sent_b = list(attacked.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid_b))
        assert len(sent_b) >= 3
        replies = [honest_train(attacked, m, server_round, 0) for m in sent_b[:-2]] + [
            reply(m, honest_upload(attacked, m, server_round, 0), {**honest_metrics(partition(m), server_round, 0), **bad})
            for m in sent_b[-2:]]
        # Execute
        honest_only.aggregate_train(server_round, [honest_train(honest_only, m, server_round, 0) for m in sent_a[:-2]])
        attacked.aggregate_train(server_round, replies)
        # Assert: both refused, logged with their node, counted as failures; the round aggregated the others
        record = attacked.record(server_round)
        assert record.rejected == 2 and record.failures == 2 and record.clients == len(sent_b) - 2, record.rejections
        assert [line.split(":")[0] for line in record.rejections] == [
            f"client {partition(m)} (node {m.metadata.dst_node_id})" for m in sent_b[-2:]]
        assert_same_strategy(honest_only, attacked)
        assert_same_record(honest_only.record(server_round), record)


# ------------------------------------------------------------ metrics through a whole run
def metric_app(bad: dict[tuple[int, int], dict[str, Any]]) -> Any:
    """A ClientApp that never trains: it answers the query as ``profile_app``, a training message
    with its download plus noise and honest metrics (``bad[(round, partition)]`` added), an
    evaluation with fixed honest metrics."""
    def app(msg: Message, context: Context) -> Message:
        k = int(context.node_config["partition-id"])
        if msg.metadata.message_type == MessageType.EVALUATE:
            metrics = {"accuracy": 0.5, "loss": 1.0, "num-examples": 10.0, "partition-id": float(k), "global-accuracy": 0.5}
            return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
        if msg.metadata.message_type != MessageType.TRAIN:
            return profile_app(msg, context)
        server_round = int(msg.content.config_records["config"]["server-round"])
        rng = np.random.default_rng([k, server_round])
        upload = {key: (a.numpy() + 0.01 * rng.standard_normal(a.shape)).astype(np.float32)
                  for key, a in msg.content.array_records["arrays"].items()}
        metrics = {**honest_metrics(k, server_round, 0), **bad.get((server_round, k), {})}
        return reply(msg, upload, metrics)

    return app


def metric_run(name: str, rounds: int, bad: dict[tuple[int, int], dict[str, Any]], out: Path, resume: bool = False) -> Any:
    config = load_config(SMOKE, [f"strategy.name={name}", *short_run_overrides(name), f"train.rounds={rounds}",
                                 "output.save_adapters=false", "output.tensorboard=false"])
    grid = InProcessGrid(metric_app(bad), [{"partition-id": k} for k in range(config.data.num_clients)])
    return run_server(grid, config, out, resume=resume)


@pytest.mark.e2e
def test_a_run_poisoned_through_metrics_resumes(tmp_path: Path) -> None:
    # Prepare: round 1 client 1 reports a received token accuracy of 5 and client 2 a received loss
    # of inf; round 2 clients 1 and 2 each report train-seconds = 1.7e308 (the two sum to inf)
    lm = {"received-loss": 1.0, "received-tokens": 10.0}
    bad = {(1, 1): {**lm, "received-token-accuracy": 5.0}, (1, 2): {**lm, "received-token-accuracy": 0.5,
                                                                      "received-loss": INF},
           (2, 1): {"train-seconds": 1.7e308}, (2, 2): {"train-seconds": 1.7e308}}
    # Execute: two rounds, then a resumed third
    first = metric_run("fedit", 2, bad, tmp_path)
    resumed = metric_run("fedit", 3, {}, tmp_path, resume=True)
    # Assert: every poisoned reply refused and logged; nothing of theirs in the records; the run resumed
    assert [r.rejected for r in first.rounds] == [2, 2] and [r.clients for r in first.rounds] == [1, 1]
    assert all(line.startswith(("client 1 (node 1001): metric", "client 2 (node 1002): metric"))
               for r in first.rounds for line in r.rejections), [r.rejections for r in first.rounds]
    assert all(math.isfinite(r.client_train_seconds) and r.client_train_seconds <= 10 for r in first.rounds)
    assert math.isnan(first.rounds[0].received_token_accuracy) and math.isnan(first.rounds[0].received_loss)
    assert [r.round for r in resumed.rounds] == [1, 2, 3] and resumed.rounds[2].clients == 3


@pytest.mark.e2e
def test_twenty_metrics_of_a_megabyte_leave_the_results_and_the_checkpoint_small(tmp_path: Path) -> None:
    from fedlora import checkpoint

    # Prepare: FedDR-LoRA (it kept every noise-* metric); client 1 adds 20 keys of 1 MB each, every round
    huge = {f"noise-{i:02d}" + "x" * 2**20: float(i) for i in range(20)}
    # Execute
    writer = metric_run("feddr_lora", 2, {(1, 1): huge, (2, 1): huge}, tmp_path)
    # Assert: refused every round, in a short line; the files stay small
    assert [r.rejected for r in writer.rounds] == [1, 1]
    assert all(len(line) < 300 for r in writer.rounds for line in r.rejections)
    assert (tmp_path / "results.json").stat().st_size < 200_000
    saved = sum(f.stat().st_size for f in checkpoint.checkpoint_dir(tmp_path).rglob("*") if f.is_file())
    assert saved < 2_000_000


# -------------------------------------------------------------------- weighing and norms
@pytest.mark.parametrize(
    ("counts", "share", "expected"),
    [
        ([184, 85, 81], 0.6, [184, 85, 81]),  # configs/smoke.toml's shares (0.53 at most): unchanged
        ([700, 100], 0.6, [150, 100]),  # 150 / 250 = 0.6
        ([1e9, 100, 100], 0.6, [300, 100, 100]),  # 300 / 500 = 0.6
        ([500, 500, 10], 0.4, [20, 20, 10]),  # two cut: 20 / 50 = 0.4 each
        ([300, 100], 0.5, [1, 1]),  # two uploads, share 1/2: they weigh the same
        ([100, 0, 0], 0.6, [100, 0, 0]),  # one client with examples: no bound is possible
        ([700, 100], 1.0, [700, 100]),  # 1 = off
    ],
)
def test_capped_weights_bound_every_share_by_water_filling(counts, share, expected) -> None:
    weights = capped_weights(counts, share)
    np.testing.assert_allclose(weights, expected, rtol=1e-12)
    if sum(c > 0 for c in counts) * share > 1:
        assert weights.max() / weights.sum() <= share + 1e-12


def test_reference_norm_is_the_lower_median_so_one_of_two_clients_cannot_raise_it() -> None:
    assert reference_norm([3.0, 1e30], previous=5.0) == 3.0
    assert reference_norm([4.0, 2.0, 9.0], previous=5.0) == 4.0
    assert reference_norm([0.0, 0.0], previous=5.0) == 5.0  # empty uploads (a warm-up) keep it


def test_norm_bounds_take_the_tighter_limit_and_refuse_a_nan_norm() -> None:
    # Prepare: update norms 1, 2 and 30 (one array each)
    payloads = [{"m::A": np.array([n], np.float32)} for n in (1.0, 2.0, 30.0)]
    # Execute / Assert: 10 x the median (20) is tighter than the absolute 50; alone, 50 lets 30 pass
    assert list(norm_outliers(payloads, FaultsConfig(norm_outlier_factor=10.0, max_update_norm=50.0))) == [2]
    assert norm_outliers(payloads, FaultsConfig(norm_outlier_factor=0.0, max_update_norm=50.0)) == {}
    assert list(norm_outliers(payloads, FaultsConfig(norm_outlier_factor=0.0, max_update_norm=25.0))) == [2]
    assert norm_outliers(payloads[:2] + [payloads[0]], FaultsConfig(norm_outlier_factor=1.5)) == {1: (
        "update norm 2 above the bound 1.5")}
    # the ratio bound: above ratio x reference, and a NaN norm (never <= anything), are refused
    assert ratio_bound(10.0, reference=1.0, ratio=10.0) == ""
    assert "max_update_ratio" in ratio_bound(10.5, reference=1.0, ratio=10.0)
    assert "max_update_ratio" in ratio_bound(math.nan, reference=1.0, ratio=10.0)


@pytest.mark.parametrize(
    ("rule", "value", "problem"),
    [
        (MetricRule(low=1.0, integer=True), 2.5, "whole number"),
        (MetricRule(low=1.0, integer=True), 0.0, "outside"),
        (MetricRule(low=0.0, high=1.0), math.nan, "NaN"),
        (MetricRule(low=0.0, high=1.0), 1.5, "outside"),
        (MetricRule(low=0.0), math.inf, "infinite"),
        (MetricRule(low=0.0, infinite=True), math.inf, ""),
        (MetricRule(low=0.0, nan=True), math.nan, ""),
    ],
)
def test_metric_rules(rule: MetricRule, value: float, problem: str) -> None:
    assert (problem in rule.problem(value)) and (bool(rule.problem(value)) == bool(problem))


# ------------------------------------------------------------------------ robust aggregation
def test_robust_rules_are_flowers_median_and_trimmed_mean() -> None:
    # five clients, one coordinate poisoned by client 4: hand-computed answers
    arrays = [np.array([1.0, 10.0]), np.array([2.0, 20.0]), np.array([3.0, 30.0]), np.array([4.0, 40.0]),
              np.array([100.0, -1e6])]
    weights = [1, 1, 1, 1, 1]
    np.testing.assert_allclose(Combine("median")(arrays, weights), [3.0, 20.0])
    np.testing.assert_allclose(Combine("trimmed_mean", trim=0.2)(arrays, weights), [3.0, 20.0])  # (2+3+4)/3, (10+20+30)/3
    np.testing.assert_allclose(Combine("mean")(arrays, [1, 1, 1, 1, 0]), [2.5, 25.0])
    # two clients: nothing is trimmed and the median is the mean
    np.testing.assert_allclose(Combine("trimmed_mean", trim=0.2)(arrays[:2], [1, 1]), [1.5, 15.0])


def test_fedit_median_is_coordinatewise_over_zero_padded_factors() -> None:
    from fedlora.strategies.replies import ClientUpload

    strategy, grid = connected("fedit", ("faults.aggregation=median",))
    strategy.connect(grid)
    rng = np.random.default_rng(3)
    uploads = []
    for k in range(3):
        shapes = strategy.download(k, 1, "train").expected()
        payload = {key: rng.standard_normal(shape).astype(np.float32) for key, shape in shapes.items()}
        uploads.append(ClientUpload(k, payload, DECLARED[k], {}))
    uploads[2].payload = {key: value * 1e6 for key, value in uploads[2].payload.items()}  # the outlier
    strategy.aggregate(1, uploads)
    glob = strategy.global_payload()
    for key, value in glob.items():
        padded = []
        for u in uploads:  # zero-pad to the largest rank (8) by hand
            x = u.payload[key]
            pad = [(0, value.shape[i] - x.shape[i]) for i in range(x.ndim)]
            padded.append(np.pad(x.astype(np.float64), pad))
        np.testing.assert_allclose(value, np.median(np.stack(padded), axis=0), rtol=1e-6)
        assert value.dtype == ADAPTER_DTYPE
        assert np.abs(value).max() < 1e3  # the 1e6-scaled client moved nothing by more than a client's value


@pytest.mark.parametrize("name", strategy_names())
def test_robust_aggregation_is_refused_in_one_line_where_the_method_cannot_take_it(name: str) -> None:
    from fedlora.methods import method

    caps = method(name).capabilities
    assert bool(caps.not_robust) != caps.robust_aggregation, "say why not, exactly when it is not allowed"
    if caps.robust_aggregation:
        assert load_config(SMOKE, [f"strategy.name={name}", "faults.aggregation=trimmed_mean",
                                   "faults.trim_fraction=0.34"]).faults.aggregation  # cuts 1 of 3 at each end
        return
    with pytest.raises(ConfigError) as refused:
        load_config(SMOKE, [f"strategy.name={name}", *short_run_overrides(name), "faults.aggregation=median"])
    assert caps.not_robust in str(refused.value) and "\n" not in str(refused.value)


def test_an_aggregate_has_the_adapters_dtype_never_the_first_uploads() -> None:
    ints = {"x": np.zeros((2, 2), np.int64)}  # a first upload of integer zeros
    floats = {"x": np.ones((2, 2), np.float64)}
    for combine in (None, Combine("median")):
        out = weighted_average([ints, floats], [1, 1], combine)
        assert out["x"].dtype == ADAPTER_DTYPE and np.allclose(out["x"], 0.5)


# ------------------------------------------------------------------- two-client poisoning
def two_clients(overrides: tuple[str, ...] = (), declared: tuple[int, int] = (100, 100)
                ) -> tuple[LoRAStrategy, InProcessGrid]:
    nodes = [{"partition-id": k, "rank": 4, "declared": declared[k]} for k in range(2)]
    return connected("fedit", ("data.num_clients=2", "clients.ranks=[4, 4]", *overrides), nodes)


def training_round(strategy: LoRAStrategy, grid: InProcessGrid, server_round: int,
                   attack: dict[str, Any]) -> list[dict[str, np.ndarray]]:
    """Client 0 honest, client 1 its ``attack`` (scale, examples) on an otherwise honest update; the uploads."""
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    uploads, replies = [], []
    for msg in messages:
        k = partition(msg)
        download = {key: array.numpy() for key, array in msg.content.array_records["arrays"].items()}
        rng = np.random.default_rng([k, server_round])
        upload = {key: (value + 0.01 * rng.standard_normal(value.shape)).astype(np.float32) for key, value in download.items()}
        examples = 100
        if k == 1:
            upload = {key: (value.astype(np.float64) * attack.get("scale", 1.0)).astype(np.float32)
                      for key, value in upload.items()}
            examples = attack.get("examples", examples)
        uploads.append(upload)
        replies.append(reply(msg, upload, {"num-examples": examples, "partition-id": k, "train-loss": 1.0}))
    strategy.aggregate_train(server_round, replies)
    return uploads


def test_two_clients_a_1e30_update_is_refused_and_the_honest_client_never_is() -> None:
    # Prepare
    strategy, grid = two_clients()
    # Execute: round 1 a 1e30-scaled update, round 2 both honest, round 3 an enormous example count
    first = training_round(strategy, grid, 1, {"scale": 1e30})
    assert strategy.record(1).rejected == 1 and "client 1 (node 1001)" in strategy.record(1).rejections[0]
    assert "max_update_ratio" in strategy.record(1).rejections[0]
    for key, value in strategy.global_payload().items():  # the aggregate is the honest update alone
        np.testing.assert_array_equal(value, first[0][key])
    training_round(strategy, grid, 2, {})
    assert strategy.record(2).rejected == 0 and strategy.record(2).clients == 2
    training_round(strategy, grid, 3, {"examples": 10**9})
    # Assert: the count is refused as above what client 1 declared; client 0 was never refused
    assert strategy.record(3).rejected == 1 and "above the 100 it declared" in strategy.record(3).rejections[0]
    assert not any("client 0" in line for r in (1, 2, 3) for line in strategy.record(r).rejections)


def test_without_the_ratio_bound_two_clients_let_the_1e30_update_through() -> None:
    # the old behaviour (max_update_norm = 0, norm outliers need 3 uploads): what the bound prevents
    strategy, grid = two_clients(("faults.max_update_ratio=0",))
    training_round(strategy, grid, 1, {"scale": 1e30})
    assert strategy.record(1).rejected == 0
    assert max(float(np.abs(v).max()) for v in strategy.global_payload().values()) > 1e20


def test_a_client_that_declared_a_huge_partition_weighs_at_most_its_entitlement() -> None:
    # Prepare: client 1 declared 10**6 examples when it joined and reports them
    strategy, grid = two_clients(declared=(100, 10**6))
    # Execute
    uploads = training_round(strategy, grid, 1, {"examples": 10**6})
    # Assert: accepted, but weighed as faults.max_size_ratio (8) x the lower median declared size (100,
    # the smaller of two: the large one cannot raise it): 800 : 100, not 10**6 : 100
    assert strategy.record(1).rejected == 0
    for key, value in strategy.global_payload().items():
        expected = (100 * uploads[0][key].astype(np.float64) + 800 * uploads[1][key].astype(np.float64)) / 900
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-7)
    # ... and its evaluation weight is the test split of 800 examples (smoke: 0.2 of a partition, 0.7
    # training): floor(0.2 x 801 / 0.7 + 0.5) = 229 examples, not 10**12
    asked = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    strategy.aggregate_evaluate(1, [
        Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5 + 0.5 * partition(m), "num-examples": [10.0, 1e12][partition(m)],
                                                     "partition-id": partition(m)})}), reply_to=m) for m in asked])
    assert strategy.record(1).personalized_accuracy == pytest.approx((10 * 0.5 + 229 * 1.0) / 239)
    assert strategy.record(1).personalized_accuracy_unweighted == pytest.approx(0.75)  # reported beside it


# ------------------------------------------------------------------ zero-example evaluations
def test_an_evaluation_of_no_examples_moves_no_accuracy() -> None:
    # Prepare: FedDR-LoRA (no global model: the clients' global-test accuracy is averaged too); client 2
    # evaluated no example and reports a perfect score (and a received accuracy of 0 examples in training)
    strategy, grid = connected("feddr_lora")
    strategy.connect(grid)
    asked = list(strategy.configure_evaluate(2, ArrayRecord(), ConfigRecord(), grid))
    assert [partition(m) for m in asked] == [0, 1, 2]
    scores = {0: (0.9, 12.0), 1: (0.5, 12.0), 2: (1.0, 0.0)}  # accuracy, examples (within what they declared)

    def answer(m: Message) -> Message:
        accuracy, examples = scores[partition(m)]
        return Message(RecordDict({"metrics": MetricRecord({
            "accuracy": accuracy, "num-examples": examples, "partition-id": float(partition(m)),
            "val-accuracy": accuracy, "val-examples": examples, "global-accuracy": accuracy})}), reply_to=m)

    # Execute
    strategy.aggregate_evaluate(2, [answer(m) for m in asked])
    # Assert: clients 0 and 1 alone, weighted, unweighted, worst, p10, validation, global
    record = strategy.record(2)
    assert record.rejected == 0 and record.per_client["2"]["num-examples"] == 0.0
    assert record.personalized_accuracy == pytest.approx(0.7)
    assert record.personalized_accuracy_unweighted == pytest.approx(0.7)
    assert record.personalized_accuracy_worst == pytest.approx(0.5)
    assert record.personalized_accuracy_p10 == pytest.approx(0.54)
    assert record.validation_accuracy == pytest.approx(0.7) and record.global_accuracy == pytest.approx(0.7)
    # ... and when nobody evaluated an example, there is no accuracy at all
    strategy.aggregate_evaluate(3, [Message(RecordDict({"metrics": MetricRecord({
        "accuracy": 1.0, "num-examples": 0.0, "partition-id": float(partition(m))})}), reply_to=m)
        for m in strategy.configure_evaluate(3, ArrayRecord(), ConfigRecord(), grid)])
    assert math.isnan(strategy.record(3).personalized_accuracy) and math.isnan(strategy.record(3).personalized_accuracy_worst)


def test_a_received_accuracy_of_no_examples_moves_no_accuracy() -> None:
    # Prepare: three FedIT clients; client 2 reports a received accuracy of 1 over 0 examples
    strategy, grid = connected("fedit")
    sent = list(strategy.configure_train(2, ArrayRecord(), ConfigRecord(), grid))
    received = {0: (0.9, 15.0), 1: (0.5, 15.0), 2: (1.0, 0.0)}
    replies = [reply(m, honest_upload(strategy, m, 2, 0), {**honest_metrics(partition(m), 2, 0),
                                                           "received-accuracy": received[partition(m)][0],
                                                           "received-examples": received[partition(m)][1]})
               for m in sent]
    # Execute
    strategy.aggregate_train(2, replies)
    # Assert
    record = strategy.record(2)
    assert record.clients == 3 and record.received_accuracy == pytest.approx(0.7)
    assert record.received_accuracy_unweighted == pytest.approx(0.7)


# ------------------------------------------------------------------------ partition spoofing
def test_a_reply_that_speaks_for_another_partition_is_refused() -> None:
    # Prepare: three FedIT clients; client 2 sends a plausible update and a dp-epsilon as partition 0
    strategy, grid = connected("fedit")
    messages = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    uploads = [honest_upload(strategy, m, 1, seed=5) for m in messages]
    replies = [reply(m, u, {**honest_metrics(k, 1, 5), "dp-epsilon": 1.0 + k}) for k, (m, u) in enumerate(zip(messages, uploads))]
    replies[2] = reply(messages[2], uploads[2], {**honest_metrics(0, 1, 5), "dp-epsilon": 99.0})
    # Execute
    strategy.aggregate_train(1, replies)
    # Assert: refused, counted, logged with its node; the aggregate is FedAvg of clients 0 and 1 alone
    record = strategy.record(1)
    assert record.rejected == 1 and record.clients == 2
    assert record.rejections == ["client 2 (node 1002): the reply claims partition 0, its sender holds partition 2"]
    weights = np.array([honest_metrics(k, 1, 5)["num-examples"] for k in (0, 1)], dtype=np.float64)
    weights /= weights.sum()
    for key, value in strategy.global_payload().items():
        padded = []
        for k in (0, 1):
            x = uploads[k].get(key, np.zeros(0))
            padded.append(np.pad(x.astype(np.float64), [(0, value.shape[i] - x.shape[i]) for i in range(x.ndim)]))
        np.testing.assert_allclose(value, weights[0] * padded[0] + weights[1] * padded[1], rtol=1e-5, atol=1e-8)
    assert strategy.ledger.epsilon == {0: 1.0, 1: 2.0}  # the spoofed epsilon was not booked on partition 0

    # Evaluation: client 2 claims partition 1 with a perfect score
    asked = list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), grid))
    answers = []
    for m in asked:
        claimed = 1 if partition(m) == 2 else partition(m)
        accuracy = 1.0 if partition(m) == 2 else 0.25 * (partition(m) + 1)
        answers.append(Message(RecordDict({"metrics": MetricRecord(
            {"accuracy": accuracy, "num-examples": 10.0, "partition-id": float(claimed)})}), reply_to=m))
    strategy.aggregate_evaluate(1, answers)
    assert strategy.record(1).rejected == 2
    assert strategy.record(1).per_client["1"]["accuracy"] == 0.5 and "2" not in strategy.record(1).per_client
    assert strategy.record(1).personalized_accuracy == pytest.approx((0.25 + 0.5) / 2)


def test_a_second_node_claiming_an_accepted_partition_is_refused_at_join() -> None:
    strategy, grid = connected("fedit", nodes=[{"partition-id": 0}, {"partition-id": 1}, {"partition-id": 0}])
    strategy.connect(grid)
    assert strategy.roster.node_of == {0: 1000, 1: 1001}
    assert "already held by node 1000" in strategy.roster.refused["node 1002"]


def test_a_client_running_another_fedlora_version_is_refused_in_one_line() -> None:
    """Every node runs its installed fedlora (a run's FAB carries no code): a client of another
    version, or one whose profile does not say, is refused at join; the others take part."""
    strategy, grid = connected("fedit", nodes=[{"partition-id": 0}, {"partition-id": 1, "version": "0.0.9"},
                                               {"partition-id": 2, "version": ""}])
    strategy.connect(grid)
    assert strategy.roster.partitions == [0]
    assert strategy.roster.refused["partition 1"] == (
        f"1: it runs fedlora 0.0.9, this server runs fedlora {__version__}: install the same fedlora on every node")
    assert "2: it does not say which fedlora it runs" in strategy.roster.refused["partition 2"]


def test_a_query_reply_that_is_not_a_profile_refuses_the_node_only() -> None:
    def app(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 1:
            return Message(RecordDict({"profile": ConfigRecord({"json": "{not json"})}), reply_to=msg)
        if context.node_config["partition-id"] == 2:
            return Message(RecordDict({"profile": ConfigRecord({"json": '{"partition_id": 2, "rank": 4, '
                                                                 f'"fedlora_version": "{__version__}", '
                                                                 '"num_train_examples": -7}'})}), reply_to=msg)
        return profile_app(msg, context)

    strategy, _ = connected("fedit")
    strategy.connect(InProcessGrid(app, [{"partition-id": k} for k in range(3)]))
    assert strategy.roster.partitions == [0]
    assert "not valid" in strategy.roster.refused["node 1001"]
    assert "negative num_train_examples" in strategy.roster.refused["partition 2"]


# ------------------------------------------------ the in-process engine keeps Flower's rules
@pytest.mark.e2e
def test_in_process_a_late_reply_and_a_reply_for_another_node_are_failures_and_the_run_goes_on() -> None:
    """simulations/inprocess.py: with federation.round_timeout = 1 s, node 1001 answers its
    first training message after 2 s and node 1002 answers every message as node 1000. Both are
    failures of the round (no reply reached the strategy: Flower's grid leaves a late reply out,
    its link state refuses a reply from another node), nothing is rejected, and the run goes on."""
    from fedlora.strategies.loop import run_rounds

    strategy, _ = connected("fedit", ("federation.round_timeout=1",))

    def app(msg: Message, context: Context) -> Message:
        k, server_round = int(context.node_config["partition-id"]), 0
        if msg.metadata.message_type == MessageType.TRAIN:
            server_round = int(msg.content.config_records["config"]["server-round"])
            answer = honest_train(strategy, msg, server_round, seed=3)
        elif msg.metadata.message_type == MessageType.EVALUATE:
            answer = honest_evaluate(msg, seed=3)
        else:
            return profile_app(msg, context)
        if k == 1 and server_round == 1:
            time.sleep(2.0)
        if k == 2:
            answer.metadata.__dict__["_src_node_id"] = NODE
        return answer

    grid = InProcessGrid(app, [{"partition-id": k} for k in range(3)])
    run_rounds(strategy, grid, 1, 2, timeout=strategy.experiment.federation.round_timeout)
    assert [strategy.record(r).clients for r in (1, 2)] == [1, 2]
    assert [strategy.record(r).failures for r in (1, 2)] == [2, 1]
    assert [strategy.record(r).rejected for r in (1, 2)] == [0, 0]
    assert strategy.record(2).per_client.keys() == {"0", "1"}


# --------------------------------------------------------- a hostile ClientApp, really training
@pytest.mark.slow
def test_a_hostile_client_app_is_refused_every_round_and_the_honest_one_never(tmp_path: Path) -> None:
    from hostile_clientapp import EVALUATE_ATTACKS, TRAIN_ATTACKS
    from hostile_clientapp import app as hostile_app

    # Prepare: two real clients, client 1 hostile (text arrays, 1e30 norm, 10**15 examples, spoofing)
    config = load_config(SMOKE, ["data.num_clients=2", "clients.ranks=[4, 4]", "strategy.name=fedit",
                                 f"train.rounds={len(TRAIN_ATTACKS)}", "train.max_steps=2", "output.save_adapters=false",
                                 "output.tensorboard=false"])
    grid = InProcessGrid(hostile_app, [{"partition-id": 0, "num-partitions": 2},
                                       {"partition-id": 1, "num-partitions": 2, "hostile": True}])
    # Execute
    writer = run_server(grid, config, tmp_path)
    # Assert: every round aggregated client 0 alone; client 1's training and evaluation replies refused
    assert [r.clients for r in writer.rounds] == [1] * len(TRAIN_ATTACKS)
    assert [r.rejected for r in writer.rounds] == [2] * len(TRAIN_ATTACKS)  # one training + one evaluation reply
    for record in writer.rounds:
        assert all("client 1 (node 1001)" in line for line in record.rejections), record.rejections
        assert math.isfinite(record.global_accuracy) and record.per_client.keys() == {"0"}
    assert sum("evaluation: " in line for r in writer.rounds for line in r.rejections) == len(TRAIN_ATTACKS)
    assert len(EVALUATE_ATTACKS) < len(TRAIN_ATTACKS)  # so every evaluation attack ran too


def test_every_test_the_robustness_page_cites_exists() -> None:
    import re

    page = (ROOT / "docs" / "robustness.md").read_text()
    section = page.split("## What a client can do wrong", 1)[1].split("\n## ", 1)[0]
    cited = set(re.findall(r"`(?:tests/(test_\w+)\.py::)?(test_\w+)`", section))
    assert len(cited) >= 10
    for module, name in cited:
        files = [ROOT / "tests" / f"{module}.py"] if module else [Path(__file__)]
        assert any(f"def {name}(" in f.read_text() for f in files), f"docs/robustness.md cites {module}::{name}"
