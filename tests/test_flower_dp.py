"""Flower's central DP with client-side fixed clipping around fedlora's linear strategies.

Flower's ``DifferentialPrivacyClientSideFixedClipping`` wraps a fedlora strategy; fedlora's
ClientApp clips with Flower's ``fixedclipping_mod`` when the wrapper's ``clipping_norm`` is in the
training config (``fedlora.clients.app.clipping_when_asked``). The unit tests answer the messages here
(honest replies passed through the client's mod, no training) on the tiny random BERT of
configs/smoke.toml; the end-to-end test runs Flower's ``start`` on the wrapper around FedIT with
fedlora's real ClientApp. Expected values (the clipped updates, the weighted mean, the noise std
z C / m of Flower's ``compute_stdv``) are computed here by hand.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping
from strategy_helpers import SMOKE_SETTINGS, short_run_options

from fedlora.clients.app import clipping_when_asked
from fedlora.config import ConfigError, config_from_json
from fedlora.lora import A_SUFFIX, B_SUFFIX, from_array_record
from fedlora.methods import method, method_names
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid, node_configs
from fedlora.strategies.base import LoRAStrategy
from fedlora.strategies.fedit import FedIT
from fedlora.strategies.registry import strategy_class
from fedlora.version import __version__

SETTINGS: dict[str, Any] = SMOKE_SETTINGS | {"clients": {"ranks": [4, 4, 4]}}  # configs/smoke.toml, every client at rank 4
DECLARED = [100, 110, 120]  # training examples each client declares
NODE = 1000  # InProcessGrid: node 1000 + k holds partition k
WRAPPABLE = [name for name in method_names() if method(name).capabilities.flower_dp]
NOT_WRAPPABLE = [name for name in method_names() if not method(name).capabilities.flower_dp]


def context(node: int = NODE) -> Context:
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


def norm(arrays: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in arrays.values()))


def minus(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: a[k].astype(np.float64) - b[k].astype(np.float64) for k in a}


def train_message(arrays: dict[str, np.ndarray], config: dict[str, Any]) -> Message:
    InProcessGrid(profile_app, [])  # sets Flower's task identity, as a server process has it
    content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                          "config": ConfigRecord(config)})
    return Message(content=content, dst_node_id=NODE, message_type=MessageType.TRAIN)


def client_adding(update: dict[str, np.ndarray], metrics: dict[str, Any] | None = None):
    """A ClientApp whose reply is the arrays it received plus ``update`` (a fixed update)."""

    def app(msg: Message, _: Context) -> Message:
        received = from_array_record(msg.content.array_records["arrays"])
        arrays = {k: (received[k] + update[k]).astype(np.float32) for k in received}
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                              "metrics": MetricRecord(metrics or {"num-examples": 1})})
        return Message(content=content, reply_to=msg)

    return app


# ----------------------------------------------------------------------------- the client's mod
def test_the_client_clips_an_update_above_the_clipping_norm_to_exactly_that_norm() -> None:
    # Prepare: received arrays and an update of norm 5 (3 and 4 in two arrays), clipping norm 1
    received = {"m::A": np.array([[1.0, 2.0]], np.float32), "m::B": np.array([[0.5], [-1.0]], np.float32)}
    update = {"m::A": np.array([[3.0, 0.0]]), "m::B": np.array([[0.0], [4.0]])}
    msg = train_message(received, {"clipping_norm": 1.0, "server-round": 1})
    # Execute
    reply = clipping_when_asked(msg, context(), client_adding(update))
    # Assert: the update is (3, 4) / 5, norm exactly 1: A = (1.6, 2.0), B = (0.5, -0.2)
    sent = from_array_record(reply.content.array_records["arrays"])
    np.testing.assert_allclose(sent["m::A"], [[1.6, 2.0]], rtol=1e-6)
    np.testing.assert_allclose(sent["m::B"], [[0.5], [-0.2]], rtol=1e-6)
    assert math.isclose(norm(minus(sent, received)), 1.0, rel_tol=1e-6)


def test_an_update_within_the_norm_and_an_unwrapped_run_pass_unchanged() -> None:
    received = {"m::A": np.array([[1.0, 2.0]], np.float32)}
    update = {"m::A": np.array([[0.3, 0.4]])}  # norm 0.5
    # within the clipping norm: unchanged
    reply = clipping_when_asked(train_message(received, {"clipping_norm": 1.0}), context(), client_adding(update))
    np.testing.assert_allclose(from_array_record(reply.content.array_records["arrays"])["m::A"], [[1.3, 2.4]], rtol=1e-6)
    # no clipping norm (no wrapper): the reply as the client made it, where Flower's mod alone fails the message
    update = {"m::A": np.array([[30.0, 40.0]])}
    msg = train_message(received, {"server-round": 1})
    reply = clipping_when_asked(msg, context(), client_adding(update))
    np.testing.assert_allclose(from_array_record(reply.content.array_records["arrays"])["m::A"], [[31.0, 42.0]])
    assert fixedclipping_mod(msg, context(), client_adding(update)).has_error()


# ----------------------------------------------------------------------------- the server's wrapper
def profile_app(msg: Message, ctx: Context) -> Message:
    """A ClientApp that only answers the profile query: its rank from the experiment's clients.ranks."""
    k = int(ctx.node_config["partition-id"])
    rank = config_from_json(str(msg.content.config_records["config"]["experiment"])).clients.ranks[k]
    profile = ClientProfile(partition_id=k, rank=rank, num_train_examples=DECLARED[k], fedlora_version=__version__)
    return Message(RecordDict({"profile": ConfigRecord({"json": profile.model_dump_json()})}), reply_to=msg)


def wrapped(name: str, noise: float, clip: float, **settings: Any) -> tuple[LoRAStrategy, Any, InProcessGrid]:
    strategy = strategy_class(name)(**{**SETTINGS, **settings})
    dp = DifferentialPrivacyClientSideFixedClipping(strategy, noise_multiplier=noise, clipping_norm=clip,
                                                    num_sampled_clients=3)
    return strategy, dp, InProcessGrid(profile_app, node_configs(3))


@pytest.mark.parametrize("name", WRAPPABLE)
def test_the_wrapper_adds_flowers_noise_to_the_weighted_mean_of_the_clipped_updates(name: str) -> None:
    # Prepare: z = 1, C = 0.05, 3 clients; each client's update has norm 0.5 C, 2 C or 5 C
    z, C = 1.0, 0.05
    strategy, dp, grid = wrapped(name, z, C)
    np.random.seed(0)  # Flower draws the noise from numpy's global generator
    sent = list(dp.configure_train(1, ArrayRecord(), ConfigRecord(), grid))
    assert len(sent) == 3
    rng = np.random.default_rng(1)
    replies, expected_uploads, counts = [], [], []
    for msg, factor in zip(sent, (0.5, 2.0, 5.0)):
        k = msg.metadata.dst_node_id - NODE
        assert msg.content.config_records["config"]["clipping_norm"] == C
        download = from_array_record(msg.content.array_records["arrays"])
        assert download.keys() == strategy.download(k, 1, "train").expected().keys()  # a reply is the download plus an update
        raw = {key: rng.standard_normal(v.shape) for key, v in download.items()}
        update = {key: v * factor * C / norm(raw) for key, v in raw.items()}  # norm factor x C
        counts.append(DECLARED[k] - 10)
        metrics = {"num-examples": counts[-1], "partition-id": k, "train-loss": 0.5, "train-seconds": 1.0,
                   "train-examples": 40}
        reply = clipping_when_asked(msg, context(msg.metadata.dst_node_id), client_adding(update, metrics))
        uploaded = from_array_record(reply.content.array_records["arrays"])
        # the client's mod: the update scaled by min(1, C / ||update||), computed here by hand
        clipped = {key: v * min(1.0, 1.0 / factor) for key, v in update.items()}
        assert math.isclose(norm(minus(uploaded, download)), min(factor, 1.0) * C, rel_tol=1e-4)
        expected_uploads.append({key: download[key] + clipped[key] for key in download})
        replies.append(reply)
    # Execute
    arrays, metrics = dp.aggregate_train(1, replies)
    # Assert: the strategy aggregated the plain weighted mean, p_k = n_k / sum n ...
    assert arrays is not None and metrics is not None and metrics["clients"] == 3
    p = np.array(counts, float) / sum(counts)
    mean = {key: sum(p_k * upload[key] for p_k, upload in zip(p, expected_uploads)) for key in expected_uploads[0]}
    plain = strategy.global_arrays()
    assert plain.keys() == mean.keys()
    for key, value in mean.items():
        np.testing.assert_allclose(plain[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # ... and the wrapper returned it plus Gaussian noise of std z C / m on every element
    noised = from_array_record(arrays)
    assert noised.keys() == mean.keys()
    residual = np.concatenate([(noised[key] - mean[key]).ravel() for key in mean])
    std = z * C / 3
    assert residual.size > 500
    assert abs(residual.std() / std - 1.0) < 0.1, (residual.std(), std)
    assert abs(residual.mean()) < 4 * std / math.sqrt(residual.size)
    if name == "ffa_lora":  # the noise never lands on FFA-LoRA's frozen A, which is no array
        assert not any(key.endswith(A_SUFFIX) for key in noised)
    # Execute / Assert: the next round's downloads are the noised arrays (one rank: the whole arrays)
    for msg in dp.configure_train(2, arrays, ConfigRecord(), grid):
        download = from_array_record(msg.content.array_records["arrays"])
        assert download.keys() == noised.keys()
        for key in noised:
            np.testing.assert_allclose(download[key], noised[key], rtol=1e-6, err_msg=key)


REFUSED = [(name, {}, method(name).capabilities.not_flower_dp) for name in NOT_WRAPPABLE] + [
    ("fedit", {"faults": {"aggregation": "median"}}, "faults.aggregation = 'median'"),
    ("ffa_lora", {"clients": {"ranks": [2, 4, 8]}}, "clients train ranks [2, 4, 8]"),
    ("fedsa_lora", {"clients": {"ranks": [2, 4, 8]}}, "clients train ranks [2, 4, 8]"),
]


@pytest.mark.parametrize(("name", "settings", "reason"), REFUSED, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REFUSED)])
def test_a_strategy_the_wrapper_cannot_wrap_refuses_it_in_one_line_saying_why(
        name: str, settings: dict[str, Any], reason: str) -> None:
    caps = method(name).capabilities
    assert bool(caps.not_flower_dp) != caps.flower_dp, "say why not, exactly when it is not allowed"
    assert reason and "|" not in reason  # the reason is a cell of docs/flower.md's table
    _, dp, grid = wrapped(name, 1.0, 0.05, **short_run_options(name), **settings)
    with pytest.raises(ConfigError) as refused:
        dp.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    message = str(refused.value)
    assert reason in message and "DifferentialPrivacyClientSideFixedClipping" in message and "\n" not in message


# ----------------------------------------------------------------------------- end to end
class RecordingFedIT(FedIT):
    """FedIT that keeps what it sent and what it received (the replies after the clients' mod)."""

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any) -> Any:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self.sent = {m.metadata.dst_node_id: from_array_record(m.content.array_records["arrays"]) for m in messages}
        self.got_arrays = from_array_record(arrays) if len(arrays) else {}
        return messages

    def aggregate_train(self, server_round: int, replies: Any) -> Any:
        replies = list(replies)
        self.got = {r.metadata.src_node_id: from_array_record(r.content.array_records["arrays"])
                    for r in replies if not r.has_error()}
        self.history = getattr(self, "history", []) + [(self.sent, self.got)]
        return super().aggregate_train(server_round, replies)


def padded(payload: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """FedIT's zero-padding to r_max, by hand."""
    out = {}
    for key, value in payload.items():
        if key.endswith(A_SUFFIX):
            out[key] = np.pad(value.astype(np.float64), ((0, rank - value.shape[0]), (0, 0)))
        elif key.endswith(B_SUFFIX):
            out[key] = np.pad(value.astype(np.float64), ((0, 0), (0, rank - value.shape[1])))
        else:
            out[key] = value.astype(np.float64)
    return out


def test_flowers_wrapper_around_fedit_with_fedloras_clientapp_clips_and_noises() -> None:
    """Flower's ``start`` on the wrapper around FedIT (ranks 2, 4, 8), fedlora's ClientApp on three
    in-process nodes, 2 rounds of 3 steps on the tiny BERT; every upload weighs 1/3."""
    from fedlora.clients.app import app as client_app

    # Prepare: z = 1, C = 1e-3 (below any real update of 3 steps)
    z, C, rounds = 1.0, 1e-3, 2
    fedit = RecordingFedIT(**{**SETTINGS, "clients": {"ranks": [2, 4, 8]},
                              "train": {**SETTINGS["train"], "rounds": rounds, "max_steps": 3},
                              "faults": {"max_client_share": 1 / 3}}, fraction_evaluate=0.0)
    dp = DifferentialPrivacyClientSideFixedClipping(fedit, noise_multiplier=z, clipping_norm=C, num_sampled_clients=3)
    np.random.seed(0)
    # Execute
    result = dp.start(grid=InProcessGrid(client_app, node_configs(3)), initial_arrays=ArrayRecord(), num_rounds=rounds)
    # Assert: every reply of every round arrived clipped to exactly C (the client's mod ran)
    assert len(fedit.history) == rounds
    for sent, got in fedit.history:
        assert sorted(got) == sorted(sent) == [NODE, NODE + 1, NODE + 2]
        for node in sent:
            assert list(got[node]) == list(sent[node])  # the same keys in the same order
            assert math.isclose(norm(minus(got[node], sent[node])), C, rel_tol=1e-4), node
    # round 1's arrays = the uniform mean of the zero-padded clipped replies + noise of std z C / 3 ...
    sent, got = fedit.history[0]
    uploads = [padded(got[node], 8) for node in sorted(got)]
    mean = {key: sum(u[key] for u in uploads) / 3 for key in uploads[0]}
    noised = fedit.got_arrays  # what Flower's loop handed round 2: the wrapper's return of round 1
    assert noised.keys() == mean.keys()
    residual = np.concatenate([(noised[key] - mean[key]).ravel() for key in mean])
    assert residual.size > 1000
    assert abs(residual.std() / (z * C / 3) - 1.0) < 0.1, residual.std()
    # ... from which round 2's downloads were cut (client k: its first r_k components)
    for node, download in fedit.history[1][0].items():
        rank = [2, 4, 8][node - NODE]
        for key, value in download.items():
            cut = (noised[key][:rank] if key.endswith(A_SUFFIX) else noised[key][:, :rank] if key.endswith(B_SUFFIX)
                   else noised[key])
            np.testing.assert_array_equal(value, cut, err_msg=key)
    # the final arrays are FedIT's global adapter, noised: the strategy continued from them
    final, state = from_array_record(result.arrays), fedit.global_arrays()
    assert final.keys() == state.keys() and all(np.array_equal(final[k], state[k]) for k in state)
    assert sorted(result.train_metrics_clientapp) == [1, 2]
