"""Secure aggregation (SecAgg+, docs/secure-aggregation.md): the arithmetic of fedlora/secagg.py,
the refusals, and rounds of the real protocol on the in-process grid.

The protocol tests run Flower's ``secaggplus_mod`` and fedlora's client mods (``clients/secure.py``)
around a small training handler (the download plus seeded noise, recorded by a spy) on the
in-process grid, and fedlora's server port (``strategies/secure.py``) in ``configure_train`` /
``aggregate_train`` of a strategy over one hand-made module: every number below comes from
the clients' real uploads and the strategy's real aggregate. The last test runs a whole
``fedlora run`` with secure aggregation on.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.serde import message_to_proto
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping
from scipy.stats import chisquare

from fedlora import protocol, secagg
from fedlora.clients.app import clipping_when_asked
from fedlora.clients.secure import masked_update, secure_when_asked
from fedlora.config import ConfigError, load_config
from fedlora.lora import from_array_record, to_array_record
from fedlora.profile import ClientProfile
from fedlora.simulations.inprocess import InProcessGrid
from fedlora.strategies.registry import create_strategy
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.screening import weigh
from fedlora.version import __version__

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
DECLARED = [100, 110, 120]  # training examples each client declares (and trains on)
MODULE = {"m": (48, 40)}  # one adapted module (d_out, d_in)
NODE = 1000  # InProcessGrid: node 1000 + k holds partition k
M = 2**32


# ---------------------------------------------------------------------------------- the arithmetic
def test_the_quantization_range_is_the_largest_power_of_two_that_cannot_wrap() -> None:
    # Execute / Assert: sampled * T < M, T <= 2^30 (the memo's table for M = 2^32)
    assert [secagg.quantization_range(n, M) for n in (2, 3, 4, 5, 10, 20)] == [2**30, 2**30, 2**29, 2**29, 2**28, 2**27]
    assert secagg.quantization_range(3, 2**8) == 64  # 3 x 64 = 192 < 256 <= 3 x 128
    # the wrap condition is strict: N x T = M wraps a full column to 0
    assert secagg.wrap_problem(4, 2**30, M).startswith("4 clients x quantization_range 2^30 >= modulus_range 2^32")
    assert secagg.wrap_problem(3, 2**30, M) == ""
    assert secagg.wrap_problem(5, 2**29, M) == ""


def test_the_error_bound_is_three_c_n_over_t_d() -> None:
    # Execute / Assert: 3 c |S| / (T D)
    assert secagg.error_bound(1.0, 5, 2**22, 1.0) == pytest.approx(15 / 2**22)
    assert secagg.error_bound(8.0, 3, 2**30, 1.5) == pytest.approx(3 * 8 * 3 / (2**30 * 1.5))
    assert secagg.error_bound(1.0, 20, 2**27, 20.0) == pytest.approx(3 / 2**27)  # equal weights: 3c / T


def test_shares_and_threshold_follow_flowers_rules() -> None:
    # Execute / Assert: a fraction of the sampled, made odd, all of them when <= 2; an even count made odd
    assert [secagg.resolve_shares(1.0, n) for n in (2, 3, 5)] == [2, 3, 5]
    assert secagg.resolve_shares(0.4, 5) == 3  # round(2.0) = 2 -> odd 3
    assert secagg.resolve_shares(0.1, 10) == 10  # 1 -> all of them
    assert secagg.resolve_shares(4, 10) == 5  # Flower sends 4 and builds neighbourhoods of 5
    assert secagg.resolve_shares(7, 5) == 5
    assert secagg.resolve_threshold(0.5, 3) == 2 and secagg.resolve_threshold(0.5, 2) == 2
    # fedlora's default (0): the smallest count above half of the shares
    assert [secagg.resolve_threshold(0, k) for k in (2, 3, 4, 5, 10, 20)] == [2, 2, 3, 3, 6, 11]
    assert secagg.threshold_problem(2, 5, allow_low=False).startswith("reconstruction threshold 2 is not above half")
    assert secagg.threshold_problem(2, 5, allow_low=True) == "" == secagg.threshold_problem(3, 5, allow_low=False)
    assert secagg.resolve_threshold(0.6, 10) == 6 and secagg.resolve_threshold(3, 10) == 3
    assert secagg.neighbours([5, 6, 7, 8, 9], 3) == {5: {9, 5, 6}, 6: {5, 6, 7}, 7: {6, 7, 8}, 8: {7, 8, 9},
                                                     9: {8, 9, 5}}


@pytest.mark.parametrize(("num_shares", "threshold", "T", "modulus"), [
    (1.0, 0.5, 2**22, M), (5, 3, 2**22, M), (5, 5, 2**22, M), (2, 0.5, 2**22, M), (0.0, 0.5, 2**22, M),
    (1.0, 0.0, 2**22, M), (1.0, 1.5, 2**22, M), (1.0, 0.5, 0, M), (1.0, 0.5, M, M), (1.0, 0.5, 2**22, 3 * 2**30),
    (3, 1, 2**22, M),
])
def test_every_parameter_flower_refuses_is_refused(num_shares: Any, threshold: Any, T: int, modulus: int) -> None:
    from flwr.server.workflow import SecAggPlusWorkflow

    # Execute
    ours = secagg.flower_problem(num_shares, threshold, T, modulus)
    try:
        SecAggPlusWorkflow(num_shares, threshold, quantization_range=T, modulus_range=modulus)
        flowers = ""
    except (TypeError, ValueError) as error:
        flowers = str(error)
    # Assert: Flower's refusals are ours (ours are a little stricter, never looser)
    assert bool(ours) >= bool(flowers), (ours, flowers)


def test_two_keys_that_differ_only_beyond_their_first_32_bits_give_unrelated_masks() -> None:
    from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen

    # Prepare: a 32-byte key, and the same key with bit 0 flipped in its words 1 and 2 (bytes 4 and
    # 8): their first 32 bits agree, and so does the XOR of their 32-bit words, the seed Flower's
    # pseudo_rand_gen gives numpy's MT19937
    key = bytes(np.random.default_rng(5).integers(0, 256, 32, dtype=np.uint8))
    other = bytearray(key)
    other[4] ^= 1
    other[8] ^= 1
    n = 100_000
    # Execute
    ours, theirs = secagg.mask(key, M, n), secagg.mask(bytes(other), M, n)
    # Assert: unrelated: equal entries no more often than chance (1 in 2^32), no correlation (the
    # standard error of a correlation of n independent pairs is 1 / sqrt(n) = 0.003), each uniform
    assert np.count_nonzero(ours == theirs) <= 1
    assert abs(np.corrcoef(ours, theirs)[0, 1]) < 0.02
    assert abs(np.corrcoef(ours % 2, theirs % 2)[0, 1]) < 0.02  # not even the low bits
    for mask in (ours, theirs):
        assert mask.dtype == np.int64 and 0 <= mask.min() and mask.max() < M
        assert chisquare(np.histogram(mask, bins=64, range=(0, M))[0]).pvalue > 1e-4
    # every byte of the key matters, the last one too
    assert all(not np.array_equal(secagg.mask(key[:i] + bytes([key[i] ^ 0x80]) + key[i + 1:], M, 8), ours[:8])
               for i in range(32))
    # Flower's generator gives these two keys the same mask: the reason fedlora ports its mod
    [flower_a], [flower_b] = pseudo_rand_gen(key, M, [(1000,)]), pseudo_rand_gen(bytes(other), M, [(1000,)])
    assert np.array_equal(flower_a, flower_b)
    # a pairwise key as Flower's key agreement returns it (URL-safe base64 of 32 bytes) is the same key
    import base64

    assert np.array_equal(secagg.mask(base64.urlsafe_b64encode(key), M, n), ours)
    with pytest.raises(ValueError, match="32 bytes"):
        secagg.mask(key[:4], M, 8)


def test_a_client_masks_its_padded_update_and_refuses_what_does_not_fit() -> None:
    # Prepare: a rank-2 upload in a round whose largest rank is 4
    download = {"m::A": np.ones((2, 3), np.float32), "m::B": np.zeros((5, 2), np.float32),
                "head::w": np.zeros((2, 5), np.float32)}
    upload = {"m::A": np.full((2, 3), 1.5, np.float32), "m::B": np.full((5, 2), -0.25, np.float32),
              "head::w": np.full((2, 5), 0.125, np.float32)}
    # Execute
    vector = secagg.update_vector(upload, download, pad_rank=4, clip_norm=0.0, clip_range=8.0)
    shapes = secagg.canonical_shapes({k: v.shape for k, v in upload.items()}, 4)
    update = secagg.unflatten(vector, shapes)
    # Assert: sorted keys, A rows / B columns zero-padded to 4, the update upload - download
    assert list(shapes) == ["head::w", "m::A", "m::B"] and shapes["m::A"] == (4, 3) and shapes["m::B"] == (5, 4)
    assert np.array_equal(update["m::A"], np.vstack([np.full((2, 3), 0.5), np.zeros((2, 3))]))
    assert np.array_equal(update["m::B"], np.hstack([np.full((5, 2), -0.25), np.zeros((5, 2))]))
    assert np.array_equal(update["head::w"], np.full((2, 5), 0.125))
    # clipped to the L2 norm asked for, and refused beyond the clipping range, for NaN, other arrays
    clipped = secagg.update_vector(upload, download, 4, clip_norm=0.5, clip_range=8.0)
    assert np.linalg.norm(clipped) == pytest.approx(0.5) and np.allclose(clipped / np.linalg.norm(clipped),
                                                                         vector / np.linalg.norm(vector))
    with pytest.raises(ValueError, match="beyond secure_aggregation's clipping range 0.4"):
        secagg.update_vector(upload, download, 4, 0.0, 0.4)
    with pytest.raises(ValueError, match="NaN"):
        secagg.update_vector({**upload, "m::A": np.full((2, 3), np.nan, np.float32)}, download, 4, 0.0, 8.0)
    with pytest.raises(ValueError, match="not the download's"):
        secagg.update_vector({"m::A": upload["m::A"]}, download, 4, 0.0, 8.0)


def test_the_weight_of_a_round_is_its_largest_sampled_weight() -> None:
    # Execute
    params = secagg.choose_params([0.2, 0.5, 0.3], 1.0, 0.5, clip_norm=2.0, configured_clipping=0.0,
                                  configured_quantization=0, modulus_range=M)
    # Assert
    assert (params.max_weight, params.clipping_range, params.quantization_range) == (0.5, 2.0, 2**30)
    assert (params.num_shares, params.threshold) == (3, 2)
    assert secagg.weight_factor(0.2, 0.5, 2**30) == round(0.4 * 2**30)


# ---------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("overrides", "why"), [
    (["strategy.name=flexlora"], "not supported by strategy 'flexlora': SVD-based"),
    (["strategy.name=local"], "not supported by strategy 'local': nothing is uploaded"),
    (["strategy.name=hetlora"], "not supported by strategy 'hetlora'"),
    (["faults.aggregation='median'"], "needs faults.aggregation = 'mean'"),
    (["strategy.name=fedsa_lora"], "strategy 'fedsa_lora' needs one LoRA rank, but clients declare ranks [2, 4, 8]"),
    (["secure_aggregation.quantization_range=1073741824", "data.num_clients=4", "clients.ranks=[4, 4, 4, 4]"],
     "4 clients x quantization_range 2^30 >= modulus_range 2^32: the masked sum would wrap"),
    (["secure_aggregation.num_shares=2"], "num_shares as an integer must be greater than 2"),
    (["secure_aggregation.clip_norm=2.0", "secure_aggregation.clipping_range=1.0"], "is below the clipping norm 2"),
    (["faults.max_update_norm=2.0", "secure_aggregation.clipping_range=1.0"], "is below the clipping norm 2"),
    (["secure_aggregation.max_error=1e-12"], "worst-case error bound"),
    (["faults.anomaly_action='reject'"], "cannot run with faults.anomaly_action = 'reject'"),
    (["faults.aggregation='krum'", "faults.num_malicious=0"], "needs faults.aggregation = 'mean'"),
    (["secure_aggregation.reconstruction_threshold=2", "data.num_clients=5", "clients.ranks=[4, 4, 4, 4, 4]"],
     "reconstruction threshold 2 is not above half of the 5 shares"),
    (["secure_aggregation.reconstruction_threshold=0.4", "data.num_clients=5", "clients.ranks=[4, 4, 4, 4, 4]"],
     "reconstruction threshold 2 is not above half of the 5 shares"),
])
def test_what_secure_aggregation_cannot_do_is_refused_in_one_line(overrides: list[str], why: str) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as refused:
        load_config(SMOKE, ["secure_aggregation.enabled=true", *overrides])
    assert why in str(refused.value) and "\n" not in str(refused.value)


def test_a_low_threshold_runs_only_when_explicitly_allowed() -> None:
    # Execute
    config = load_config(SMOKE, ["secure_aggregation.enabled=true", "secure_aggregation.reconstruction_threshold=2",
                                 "secure_aggregation.allow_low_threshold=true", "data.num_clients=5",
                                 "clients.ranks=[4, 4, 4, 4, 4]"])
    # Assert: accepted; and the default threshold of 5 clients is 3
    assert config.secure_aggregation.reconstruction_threshold == 2
    assert secagg.resolve_threshold(load_config(SMOKE).secure_aggregation.reconstruction_threshold, 5) == 3


@pytest.mark.e2e
def test_the_cli_refuses_a_method_that_cannot_aggregate_on_a_sum_with_exit_2(tmp_path: Path) -> None:
    # Execute
    done = subprocess.run([sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--engine", "inprocess",
                           "--out", str(tmp_path / "run"), "--set", "strategy.name=flexlora",
                           "--set", "secure_aggregation.enabled=true"], capture_output=True, text=True, timeout=300,
                          check=False)
    # Assert: one line on stderr, exit 2, nothing run
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "flexlora" in done.stderr
    assert not (tmp_path / "run" / "results.json").exists()


# ---------------------------------------------------------------------------------- the protocol, in process
def initial_adapter(rank: int) -> dict[str, np.ndarray]:
    """The common initial adapter at ``rank`` over :data:`MODULE` (seeded A, B = 0) and a 2-class head."""
    d_out, d_in = MODULE["m"]
    rng = np.random.default_rng(rank)
    return {"m::A": (0.1 * rng.standard_normal((rank, d_in))).astype(np.float32),
            "m::B": np.zeros((d_out, rank), np.float32),
            "head::classifier.weight": (0.1 * rng.standard_normal((2, d_out))).astype(np.float32)}


class RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every message the server sent and every reply it received."""

    def __init__(self, client_app: Any, nodes: list[dict[str, Any]]) -> None:
        super().__init__(client_app, nodes)
        self.sent: list[Message] = []
        self.received: list[Message] = []

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.sent += messages
        replies = list(super().send_and_receive(messages, timeout=timeout))
        self.received += replies
        return replies


Edits = dict[int, tuple[str, Callable[[ConfigRecord], None]]]  # partition -> (stage, edit of a SecAgg+ record)


def secure_client(ranks: list[int], spy: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
                  kill: dict[int, str], clip: bool = False, tamper: Edits | None = None, incoming: Edits | None = None,
                  profiles: dict[int, str] | None = None) -> ClientApp:
    """fedlora's client mods (its SecAgg+ port) around a small training handler: the upload is the
    download plus seeded noise (kept in ``spy``: partition -> (download, upload)). ``kill``:
    partition -> the stage at which that client raises (its ClientApp crashes). ``tamper``:
    partition -> (stage, edit): that client's reply at that stage has its SecAgg+ record edited (a
    hostile client). ``incoming``: the same for the record the client receives (a hostile server).
    ``profiles``: partition -> the profile JSON that client sends instead of its own. ``clip``:
    fedlora's ``clipping_when_asked`` innermost, as in fedlora's ClientApp (Flower's DP wrapper)."""
    app = ClientApp()

    def partition(context: Context) -> int:
        return int(context.node_config["partition-id"])

    def crash(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        asked = None if configs is None else configs.get(Key.STAGE)  # read first: the mods consume the record
        if asked is not None and kill.get(partition(context)) == asked:
            raise RuntimeError("killed")
        stage, edit = (incoming or {}).get(partition(context), ("", None))
        if asked is not None and edit is not None and stage == asked:
            edit(cast(ConfigRecord, configs))
        reply = call_next(msg, context)
        stage, edit = (tamper or {}).get(partition(context), ("", None))
        if asked is not None and edit is not None and stage == asked and not reply.has_error():
            edit(reply.content.config_records[RECORD_KEY_CONFIGS])
        return reply

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        k = partition(context)
        profile = ClientProfile(partition_id=k, rank=ranks[k], num_train_examples=DECLARED[k],
                                fedlora_version=__version__, capabilities=["secure-aggregation"],
                                secure_masks=secagg.MASK_GENERATOR)
        text = (profiles or {}).get(k, profile.model_dump_json())
        return Message(RecordDict({"profile": ConfigRecord({"json": text})}), reply_to=msg)

    @app.train(mods=[crash, secure_when_asked, masked_update, *([clipping_when_asked] if clip else [])])
    def train(msg: Message, context: Context) -> Message:
        k = partition(context)
        assert RECORD_KEY_CONFIGS not in msg.content.config_records  # Flower's record stays with the mods
        assert RECORD_KEY_STATE not in context.state.config_records  # and the mod's state out of the handler
        download = from_array_record(msg.content.array_records["arrays"])
        rng = np.random.default_rng(k)
        upload = {key: (value + 0.05 * rng.standard_normal(value.shape)).astype(np.float32)
                  for key, value in download.items()}
        spy[k] = (download, upload)
        metrics = {"num-examples": DECLARED[k], "partition-id": k, "train-loss": 1.0 + k, "train-seconds": 1.0,
                   "train-examples": 40}
        return Message(RecordDict({"arrays": to_array_record(upload), "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def secure_round(name: str, ranks: list[int], kill: dict[int, str] | None = None,
                 overrides: tuple[str, ...] = (), tamper: Edits | None = None, incoming: Edits | None = None,
                 rounds: int = 1, profiles: dict[int, str] | None = None,
                 ) -> tuple[Any, RecordingGrid, dict[int, Any], Any]:
    """``rounds`` rounds of ``name`` with secure aggregation over 3 clients of ``ranks``: each
    configure_train (setup, share keys), the masking stage's messages and replies, aggregate_train
    (unmask). Returns the last round's aggregate_train result (``spy`` holds the last round's uploads)."""
    config = load_config(SMOKE, [f"strategy.name={name}", "secure_aggregation.enabled=true",
                                 f"clients.ranks={ranks}", *overrides])
    strategy = create_strategy(config, initial_adapter, dict(MODULE))
    spy: dict[int, Any] = {}
    grid = RecordingGrid(secure_client(ranks, spy, kill or {}, tamper=tamper, incoming=incoming, profiles=profiles),
                         [{"partition-id": k} for k in range(3)])
    arrays, result = ArrayRecord(), None
    for server_round in range(1, rounds + 1):
        spy.clear()
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        result = strategy.aggregate_train(server_round, grid.send_and_receive(messages, timeout=60.0))
        arrays = result[0] or arrays
    return strategy, grid, spy, result


def plain_mean(spy: dict[int, Any], survivors: list[int], pad_rank: int) -> dict[str, np.ndarray]:
    """The plain example-weighted mean of the survivors' uploads, A rows / B columns zero-padded."""
    shapes = secagg.canonical_shapes({k: v.shape for k, v in spy[survivors[0]][1].items()}, pad_rank)
    n = np.array([DECLARED[k] for k in survivors], dtype=np.float64)
    stacked = np.stack([secagg.flatten(spy[k][1], shapes) for k in survivors])
    return secagg.unflatten(n @ stacked / n.sum(), shapes)


def assert_within(got: dict[str, np.ndarray], expected: dict[str, np.ndarray], bound: float) -> float:
    """Every entry of ``got`` within ``bound`` of ``expected`` (plus float32's rounding of it);
    returns the largest difference."""
    assert got.keys() == expected.keys()
    largest = 0.0
    for key, value in expected.items():
        difference = np.abs(got[key].astype(np.float64) - value)
        assert np.all(difference <= bound + 2**-23 * np.abs(value)), (key, difference.max(), bound)
        largest = max(largest, float(difference.max()))
    return largest


def test_fedit_aggregated_securely_is_the_weighted_mean_of_the_same_uploads_within_the_bound() -> None:
    # Execute: mixed ranks (2, 4, 8): every client masks its update zero-padded to rank 8
    strategy, _, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8])
    # Assert
    report = strategy.records[1].extra["secure_aggregation"]
    expected = plain_mean(spy, [0, 1, 2], 8)
    largest = assert_within(strategy.global_adapter, expected, report["error_bound"])
    assert 0 < report["error_bound"] < 1e-6 and largest <= report["error_bound"] + 1e-7
    assert metrics["clients"] == 3 and strategy.records[1].failures == 0 and arrays is not None
    assert report["masked"] == 3 and report["quantization_range"] == 2**30 and report["pad_rank"] == 8
    assert report["max_weight"] == pytest.approx(120 / 330)  # the largest sampled aggregation weight
    # the weights matter: the unweighted mean is farther away than the bound
    shapes = {key: value.shape for key, value in expected.items()}
    unweighted = np.mean([secagg.flatten(spy[k][1], shapes) for k in range(3)], axis=0)
    assert np.max(np.abs(unweighted - secagg.flatten(expected, shapes))) > 100 * report["error_bound"]


def test_fedsa_lora_aggregated_securely_is_the_weighted_mean_of_the_same_uploads_within_the_bound() -> None:
    # Execute: one rank (FedSA-LoRA averages A rows over their holders with mixed ranks: refused)
    strategy, _, spy, (_, metrics) = secure_round("fedsa_lora", [4, 4, 4])
    # Assert: the global A and head
    report = strategy.records[1].extra["secure_aggregation"]
    expected = plain_mean(spy, [0, 1, 2], 4)
    assert_within(strategy.global_arrays(), expected, report["error_bound"])
    assert metrics["clients"] == 3 and set(expected) == {"m::A", "head::classifier.weight"}


def test_a_secure_round_weighs_its_clients_by_the_weight_share_rule_of_plain_rounds() -> None:
    # Prepare: faults.max_size_ratio = 1: client 2 (120 declared examples) is entitled to 110, the
    # lower median of the declared sizes; a plain round of the same counts weighs them 100, 110, 110
    uploads = [ClientUpload(k, {}, DECLARED[k], {}) for k in range(3)]
    # Execute
    strategy, _, spy, (_, metrics) = secure_round("fedit", [4, 4, 4], overrides=("faults.max_size_ratio=1",))
    weigh(uploads, strategy.entitled(), strategy.experiment.faults.max_client_share)  # the plain round's step
    # Assert: the plain weights, and every client accepted them (it computes its own: 110 / 110 for client 2)
    assert [u.weight for u in uploads] == [100.0, 110.0, 110.0]
    assert [secagg.weight_ratio(DECLARED, k, 0.6, "examples", 110.0) for k in range(3)] == [100 / 110, 1.0, 1.0]
    assert secagg.weight_ratio(DECLARED, 2, 0.6, "examples") == 1.0 and secagg.weight_ratio(DECLARED, 1, 0.6, "examples") == 110 / 120
    report = strategy.records[1].extra["secure_aggregation"]
    assert metrics["clients"] == 3 and report["masked"] == 3 and not report["culprits"]
    shapes = secagg.canonical_shapes({k: v.shape for k, v in spy[0][1].items()}, 4)
    stacked = np.stack([secagg.flatten(spy[k][1], shapes) for k in range(3)])
    plain = np.array([u.weight for u in uploads])
    assert_within(strategy.global_adapter, secagg.unflatten(plain @ stacked / plain.sum(), shapes), report["error_bound"])
    declared = np.array(DECLARED, dtype=np.float64)  # the counts uncut: farther than the bound
    assert np.max(np.abs(declared @ stacked / declared.sum() - plain @ stacked / plain.sum())) > 100 * report["error_bound"]


@pytest.mark.parametrize("name", ["ffa_lora", "feddpa", "feddr_lora"])
def test_the_other_capable_methods_aggregate_securely_to_their_weighted_mean(name: str) -> None:
    # Execute: one rank (FFA-LoRA's B, FedDPA's global branch, FedDR-LoRA's robust B, and the heads)
    strategy, _, spy, (_, metrics) = secure_round(name, [4, 4, 4])
    # Assert: what every client downloads next is the plain weighted mean of what they uploaded
    report = strategy.records[1].extra["secure_aggregation"]
    assert_within(strategy.global_arrays(), plain_mean(spy, [0, 1, 2], 4), report["error_bound"])
    assert metrics["clients"] == 3


def test_a_method_that_weighs_its_clients_alike_is_checked_by_them_as_uniform() -> None:
    # Execute: FedDR-LoRA with weights = 'uniform' (every client 1 / K whatever its examples)
    strategy, _, spy, (_, metrics) = secure_round("feddr_lora", [4, 4, 4], overrides=("strategy.weights='uniform'",))
    # Assert: the clients accepted the uniform weights, and the aggregate is the unweighted mean
    report = strategy.records[1].extra["secure_aggregation"]
    assert metrics["clients"] == 3 and report["weighting"] == "uniform" and report["total_weight"] == 3.0
    shapes = secagg.canonical_shapes({k: v.shape for k, v in spy[0][1].items()}, 4)
    unweighted = secagg.unflatten(np.mean([secagg.flatten(spy[k][1], shapes) for k in range(3)], axis=0), shapes)
    assert_within(strategy.global_arrays(), unweighted, report["error_bound"])


def test_the_server_never_receives_an_update_only_masked_vectors() -> None:
    # Execute
    strategy, grid, spy, _ = secure_round("fedit", [2, 4, 8])
    # Assert: no reply of any stage carries an array, nor the bytes of an upload or of an update
    shapes = secagg.canonical_shapes({k: v.shape for k, v in spy[2][1].items()}, 8)
    secrets = [array.tobytes() for _, upload in spy.values() for array in upload.values()]
    secrets += [secagg.update_vector(up, down, 8, 0.0, 8.0).tobytes()[:64] for down, up in spy.values()]
    masked = []
    assert {reply.metadata.src_node_id for reply in grid.received} == {NODE, NODE + 1, NODE + 2}
    for reply in grid.received:
        assert all(len(record) == 0 for record in reply.content.array_records.values())
        wire = message_to_proto(reply).SerializeToString()
        assert not any(secret in wire for secret in secrets)
        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS, {})
        if Key.MASKED_PARAMETERS in configs:
            from flwr.common import bytes_to_ndarray

            masked.append(bytes_to_ndarray(configs[Key.MASKED_PARAMETERS][1]))
    # the masked entries are uniform on [0, M): without the masks they would sit near c T / 2c = T / 2
    assert len(masked) == 3 and all(v.shape == (sum(int(np.prod(s)) for s in shapes.values()),) for v in masked)
    counts = np.histogram(np.concatenate(masked), bins=16, range=(0, M))[0]
    assert chisquare(counts).pvalue > 1e-3, counts
    assert strategy.records[1].clients == 3


def test_a_client_killed_after_sharing_its_keys_leaves_the_round_to_the_survivors() -> None:
    # Execute: client 1 crashes in its training handler (after the setup and share-keys stages)
    strategy, _, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8], kill={1: Stage.COLLECT_MASKED_VECTORS})
    # Assert: its pairwise masks were rebuilt from its key's shares; the mean of clients 0 and 2
    report, record = strategy.records[1].extra["secure_aggregation"], strategy.records[1]
    assert report["dead_recovered"] == 1 and report["masked"] == 2 and 1 not in spy
    assert metrics["clients"] == 2 and record.clients == 2 and record.failures == 1 and arrays is not None
    assert_within(strategy.global_adapter, plain_mean(spy, [0, 2], 8), report["error_bound"])


def test_a_client_lost_while_sharing_keys_leaves_the_round_to_the_survivors() -> None:
    # Execute: client 1 crashes at the share-keys stage (Flower 1.39's workflow halts such a round
    # after every client trained: it asks the survivors for shares of a key they never received)
    strategy, grid, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8], kill={1: Stage.SHARE_KEYS})
    # Assert: client 1 is sent no training message; the round is the mean of clients 0 and 2
    report, record = strategy.records[1].extra["secure_aggregation"], strategy.records[1]
    trained = {m.metadata.dst_node_id for m in grid.sent if "arrays" in m.content.array_records}
    assert trained == {NODE, NODE + 2} and report["after_share_keys"] == 2 and report["dead_recovered"] == 0
    assert metrics["clients"] == 2 and record.failures == 1 and arrays is not None
    assert_within(strategy.global_adapter, plain_mean(spy, [0, 2], 8), report["error_bound"])


def replace(key: str, value: Any) -> Callable[[ConfigRecord], None]:
    def edit(record: ConfigRecord) -> None:
        record[key] = value
    return edit


def masked_arrays(record: ConfigRecord) -> list[np.ndarray]:
    from flwr.common import bytes_to_ndarray

    return [bytes_to_ndarray(b) for b in cast(list[bytes], record[Key.MASKED_PARAMETERS])]


def set_masked(record: ConfigRecord, arrays: list[np.ndarray]) -> None:
    from flwr.common import ndarray_to_bytes

    record[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in arrays]


def scramble_masked(record: ConfigRecord) -> None:
    """Random int64 entries in [0, M) of the right shapes, the weight factor included."""
    rng = np.random.default_rng(7)
    set_masked(record, [rng.integers(0, M, v.shape, dtype=np.int64) for v in masked_arrays(record)])


def scramble_entries(record: ConfigRecord) -> None:
    """Random masked entries, the right weight factor: a vector the server cannot tell from a real one."""
    factor, entries = masked_arrays(record)
    set_masked(record, [factor, np.random.default_rng(7).integers(0, M, entries.shape, dtype=np.int64)])


def shift_entry(amount: int) -> Callable[[ConfigRecord], None]:
    """Add ``amount`` (mod M) to the first masked entry: a client moving the sum where it likes."""
    def edit(record: ConfigRecord) -> None:
        factor, entries = masked_arrays(record)
        entries[0] = (int(entries[0]) + amount) % M
        set_masked(record, [factor, entries])
    return edit


def tamper_weight(record: ConfigRecord) -> None:
    """Double the weight factor (it travels in the clear next to the masked entries)."""
    factor, entries = masked_arrays(record)
    set_masked(record, [factor * 2, entries])


def drop_destination(record: ConfigRecord) -> None:
    """Leave one neighbour out: a missing share."""
    record[Key.DESTINATION_LIST] = list(cast(list[int], record[Key.DESTINATION_LIST]))[1:]
    record[Key.CIPHERTEXT_LIST] = list(cast(list[bytes], record[Key.CIPHERTEXT_LIST]))[1:]


def misaddress(record: ConfigRecord) -> None:
    """Address the first share to a node that is not a neighbour: a wrong destination."""
    record[Key.DESTINATION_LIST] = [NODE + 7, *list(cast(list[int], record[Key.DESTINATION_LIST]))[1:]]


def swap_destinations(record: ConfigRecord) -> None:
    """Each encrypted share labelled with the other neighbour's id: the server cannot see it."""
    record[Key.DESTINATION_LIST] = list(reversed(cast(list[int], record[Key.DESTINATION_LIST])))


def random_shares(record: ConfigRecord) -> None:
    """Random bytes of each share's length at the unmask stage."""
    rng = np.random.default_rng(3)
    record[Key.SHARE_LIST] = [rng.bytes(len(b)) for b in cast(list[bytes], record[Key.SHARE_LIST])]


def copied_share(record: ConfigRecord) -> None:
    """The share of the first node sent again as the second's (a duplicated share)."""
    shares = list(cast(list[bytes], record[Key.SHARE_LIST]))
    record[Key.SHARE_LIST] = [shares[0], shares[0], *shares[2:]]


def repeated_share(record: ConfigRecord) -> None:
    """The first node id and its share twice."""
    record[Key.NODE_ID_LIST] = [*cast(list[int], record[Key.NODE_ID_LIST]), cast(list[int], record[Key.NODE_ID_LIST])[0]]
    record[Key.SHARE_LIST] = [*cast(list[bytes], record[Key.SHARE_LIST]), cast(list[bytes], record[Key.SHARE_LIST])[0]]


class KeyCopier:
    """Client 0 keeps its setup reply's keys here; client 1 sends them as its own (a duplicated key)."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}

    def keep(self, record: ConfigRecord) -> None:
        self.keys = {Key.PUBLIC_KEY_1: record[Key.PUBLIC_KEY_1], Key.PUBLIC_KEY_2: record[Key.PUBLIC_KEY_2]}

    def copy(self, record: ConfigRecord) -> None:
        assert self.keys, "client 0 answers the setup stage first"
        record.update(self.keys)


class Replayer:
    """Client 1 keeps its first round's masked vector and sends it again in the next (a replay)."""

    def __init__(self) -> None:
        self.first: list[bytes] = []

    def __call__(self, record: ConfigRecord) -> None:
        if not self.first:
            self.first = list(cast(list[bytes], record[Key.MASKED_PARAMETERS]))
        else:
            record[Key.MASKED_PARAMETERS] = self.first


# client 1's reply at a stage, edited, and what must happen (the server never raises): the round
# aggregates clients 0 and 2 without client 1 ("survivors"), or all three where client 1's masked
# vector was summed before it misbehaved ("all"), naming client 1 either way ("culprit": a phrase
# of the reason); or fails cleanly ("fails", nobody named: a vector that cannot be told from a real one)
HOSTILE = [
    ("bad key: not a key", Stage.SETUP, replace(Key.PUBLIC_KEY_1, b"\x00" * 33), "survivors", "not a PEM public key"),
    ("bad key: of the wrong type", Stage.SETUP, replace(Key.PUBLIC_KEY_2, 12345), "survivors", "not a PEM public key"),
    ("bad key: the same twice", Stage.SETUP, lambda r: r.update({Key.PUBLIC_KEY_2: r[Key.PUBLIC_KEY_1]}), "survivors",
     "the same public key twice"),
    ("bad key: no proof of holding it", Stage.SETUP, replace(protocol.SECAGG_PROOF, b"\x00" * 32), "survivors",
     "cannot prove it holds"),
    ("wrong destination: not a neighbour", Stage.SHARE_KEYS, misaddress, "survivors", "wrong, missing or duplicate"),
    ("wrong destination: no node at all", Stage.SHARE_KEYS, replace(Key.DESTINATION_LIST, [-1, 10**12]), "survivors",
     "wrong, missing or duplicate"),
    ("missing share", Stage.SHARE_KEYS, drop_destination, "survivors", "wrong, missing or duplicate"),
    ("share keys: lists of different lengths", Stage.SHARE_KEYS, replace(Key.CIPHERTEXT_LIST, [b"junk"]), "survivors",
     "ciphertexts for 2 destinations"),
    ("share keys: no commitments", Stage.SHARE_KEYS, replace(protocol.SECAGG_COMMITMENTS, []), "survivors",
     "commitments"),
    ("wrong destination: inside the ciphertexts", Stage.SHARE_KEYS, swap_destinations, "survivors",
     "could not use"),
    ("share keys: ciphertexts that decrypt to nothing", Stage.SHARE_KEYS,
     replace(Key.CIPHERTEXT_LIST, [b"junk", b"junk"]), "survivors", "could not use"),
    ("masking: bytes that are no array", Stage.COLLECT_MASKED_VECTORS,
     replace(Key.MASKED_PARAMETERS, [b"junk", b"junk"]), "survivors", "cannot be read"),
    ("tampered weight", Stage.COLLECT_MASKED_VECTORS, tamper_weight, "survivors", "a tampered weight"),
    ("masking: a uniform vector, weight included", Stage.COLLECT_MASKED_VECTORS, scramble_masked, "survivors",
     "a tampered weight"),
    ("masking: complaints about strangers", Stage.COLLECT_MASKED_VECTORS, replace(protocol.SECAGG_COMPLAINTS, [5]),
     "survivors", "complained about nodes"),
    ("masking: uniform entries, the right weight", Stage.COLLECT_MASKED_VECTORS, scramble_entries, "fails", ""),
    # a false complaint about client 0 (a dispute the server cannot settle): client 0 keeps enough holders
    ("masking: a false complaint", Stage.COLLECT_MASKED_VECTORS, replace(protocol.SECAGG_COMPLAINTS, [NODE]), "all", ""),
    ("masking: complaints about every neighbour", Stage.COLLECT_MASKED_VECTORS,
     replace(protocol.SECAGG_COMPLAINTS, [NODE, NODE + 2]), "all", ""),
    ("unmask: no shares at all", Stage.UNMASK, lambda r: r.update({Key.NODE_ID_LIST: [], Key.SHARE_LIST: []}), "all",
     ""),
    ("inconsistent dealing: a seed commitment its shares do not reconstruct", Stage.SHARE_KEYS,
     replace(protocol.SECAGG_SEED_COMMITMENT, b"\x01" * 32), "fails", "do not reconstruct"),
    ("random share", Stage.UNMASK, random_shares, "all", "does not match its commitment"),
    ("duplicate share: another node's", Stage.UNMASK, copied_share, "all", "does not match its commitment"),
    ("duplicate share: one node twice", Stage.UNMASK, repeated_share, "all", "(a duplicate)"),
    ("unmask: junk shares", Stage.UNMASK, replace(Key.SHARE_LIST, [b"junk", b"junk", b"junk"]), "all",
     "does not match its commitment"),
    ("unmask: node ids of the wrong type", Stage.UNMASK, replace(Key.NODE_ID_LIST, ["x", "y", "z"]), "all",
     "not asked for"),
]


def assert_outcome(strategy: Any, spy: dict[int, Any], result: Any, outcome: str, culprit: str) -> None:
    """The round's result is ``outcome`` (:data:`HOSTILE`) and client 1 is named for ``culprit``."""
    record = strategy.records[max(strategy.records)]
    report = record.extra["secure_aggregation"]
    if outcome == "fails":
        assert result == (None, None) and strategy.failed_rounds == 1, report
        assert all(np.array_equal(value, initial_adapter(8)[key]) for key, value in strategy.global_adapter.items())
        assert report.get("failed_stage") or record.clients == 0, report
    else:
        summed = [0, 2] if outcome == "survivors" else [0, 1, 2]
        arrays, metrics = result
        assert arrays is not None and metrics["clients"] == len(summed), report
        assert record.failures == 3 - len(summed), report
        assert_within(strategy.global_adapter, plain_mean(spy, summed, 8), report["error_bound"])
    if culprit:  # named in the round's record, and never sampled again
        assert list(report["culprits"]) == [str(NODE + 1)] and culprit in report["culprits"][str(NODE + 1)], report
        assert list(strategy.excluded) == [1] and strategy.sample(1.0, 1) == [0, 2]
    else:
        assert report["culprits"] == {} and strategy.excluded == {}, report


@pytest.mark.parametrize(("case", "stage", "edit", "outcome", "culprit"), HOSTILE, ids=[case for case, *_ in HOSTILE])
def test_no_client_stops_a_secure_round_and_a_culprit_is_named_and_left_out(
        case: str, stage: str, edit: Callable[[ConfigRecord], None], outcome: str, culprit: str) -> None:
    # Execute: client 1 edits its SecAgg+ reply at one stage; 3 clients, threshold 2 (above half)
    strategy, _, spy, result = secure_round("fedit", [2, 4, 8], tamper={1: (stage, edit)})
    # Assert: aggregate_train returned, the round aggregated the others (within the bound) and named
    # client 1; never a silently wrong aggregate
    assert_outcome(strategy, spy, result, outcome, culprit)


def test_a_client_that_copies_another_clients_public_keys_is_named_and_the_round_goes_on() -> None:
    # Execute: client 1 sends client 0's public keys as its own (it cannot prove holding them)
    copier = KeyCopier()
    strategy, _, spy, result = secure_round("fedit", [2, 4, 8], tamper={0: (Stage.SETUP, copier.keep),
                                                                        1: (Stage.SETUP, copier.copy)})
    # Assert: client 0 keeps its keys and its place; client 1 is named
    assert_outcome(strategy, spy, result, "survivors", "cannot prove it holds")


def test_a_named_client_is_never_sampled_again_in_that_run() -> None:
    # Execute: two rounds; client 1 sends a key that is no key at setup (round 1)
    strategy, grid, spy, (_, metrics) = secure_round(
        "fedit", [2, 4, 8], rounds=2, tamper={1: (Stage.SETUP, replace(Key.PUBLIC_KEY_1, b"\x00" * 33))})
    # Assert: round 1 named it; round 2 sampled clients 0 and 2 only, sent client 1 nothing, aggregated both
    assert strategy.records[1].extra["secure_aggregation"]["culprits"] == {
        str(NODE + 1): "setup: sent a public key that is not a PEM public key"}
    round_2 = [m for m in grid.sent if m.metadata.group_id == "2"]
    assert round_2 and NODE + 1 not in {m.metadata.dst_node_id for m in round_2}
    assert strategy.records[2].sampled == 2 and metrics["clients"] == 2 and strategy.records[2].failures == 0
    assert strategy.records[2].extra["secure_aggregation"]["excluded"] == {"1": strategy.excluded[1]}
    assert_within(strategy.global_adapter, plain_mean(spy, [0, 2], 8),
                  strategy.records[2].extra["secure_aggregation"]["error_bound"] + 1e-7)


def test_the_norm_the_server_would_reject_above_becomes_the_clients_clipping_norm() -> None:
    # Execute: faults.max_update_norm = 0.5 (a plain run rejects an update above it); every update
    # here, 0.05 N(0, 1) on 800 entries, has norm about 1.4
    strategy, _, spy, (_, metrics) = secure_round("fedit", [8, 8, 8], overrides=("faults.max_update_norm=0.5",))
    # Assert: each client clipped its update to 0.5 before masking: the aggregate is the weighted
    # mean of the clipped uploads, computed here by hand
    report = strategy.records[1].extra["secure_aggregation"]
    assert report["clip_norm"] == 0.5 and report["mean_update_norm"] <= 0.5 and metrics["clients"] == 3
    clipped = {}
    for k, (download, upload) in spy.items():
        update = {key: upload[key].astype(np.float64) - download[key] for key in download}
        norm = np.sqrt(sum(float(np.sum(v**2)) for v in update.values()))
        assert norm > 2 * 0.5
        clipped[k] = (download, {key: download[key] + update[key] * 0.5 / norm for key in download})
    assert_within(strategy.global_adapter, plain_mean(clipped, [0, 1, 2], 8), report["error_bound"] + 1e-7)


def test_a_replayed_masked_vector_is_named_and_the_round_aggregates_the_others() -> None:
    # Execute: two rounds; in the second, client 1 sends its first round's masked vector again
    strategy, _, spy, result = secure_round("fedit", [2, 4, 8], rounds=2,
                                            tamper={1: (Stage.COLLECT_MASKED_VECTORS, Replayer())})
    # Assert: round 1 took all three; round 2 named client 1 and aggregated clients 0 and 2
    assert strategy.records[1].clients == 3 and strategy.records[1].extra["secure_aggregation"]["culprits"] == {}
    assert_outcome(strategy, spy, result, "survivors", "a replay")


def test_a_masked_vector_shifted_by_one_client_is_refused_or_bounded_by_the_clipping_norm() -> None:
    # Prepare: clients clip their updates to L2 norm C = 0.5 (each update, 0.05 N(0, 1) on 800
    # entries, has norm about 1.4: the clipping binds); the clipping range c = 8, Flower's default
    C = 0.5
    clip = (f"secure_aggregation.clip_norm={C}", "secure_aggregation.clipping_range=8.0")
    _, _, _, (honest_arrays, _) = secure_round("fedit", [8, 8, 8], overrides=clip)
    honest = from_array_record(honest_arrays)
    # Execute: client 1 adds 2^30 to one masked entry (the attack: about 5.8 on one weight)
    strategy, _, _, result = secure_round("fedit", [8, 8, 8], overrides=clip,
                                          tamper={1: (Stage.COLLECT_MASKED_VECTORS, shift_entry(2**30))})
    # Assert: the unmasked mean is beyond C: the round is refused, the model as it was
    report = strategy.records[1].extra["secure_aggregation"]
    assert result == (None, None) and "beyond" in report["failed_stage"], report
    assert all(np.array_equal(value, initial_adapter(8)[key]) for key, value in strategy.global_adapter.items())
    # Execute: a shift small enough to stay inside the bound (2^24 quanta: about 0.09 on one entry)
    strategy, _, _, (arrays, _) = secure_round("fedit", [8, 8, 8], overrides=clip,
                                               tamper={1: (Stage.COLLECT_MASKED_VECTORS, shift_entry(2**24))})
    # Assert: accepted, and the mean moved by less than 2 C (both means lie in the ball of radius C)
    moved = from_array_record(arrays)
    difference = np.sqrt(sum(float(np.sum((moved[k].astype(np.float64) - honest[k]) ** 2)) for k in honest))
    assert 0.01 < difference <= 2 * C, difference
    assert strategy.records[1].extra["secure_aggregation"]["mean_update_norm"] <= C + 1e-6


def test_a_client_never_sends_both_shares_of_one_node() -> None:
    # Execute: the server asks client 0 at the unmask stage for the key share of a node it also
    # lists as summed (with both, a server unmasks that node's update)
    def both(record: ConfigRecord) -> None:
        record[Key.DEAD_NODE_ID_LIST] = [NODE + 2]

    strategy, grid, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8], incoming={0: (Stage.UNMASK, both)})
    # Assert: client 0 refused; clients 1 and 2 hold threshold-many shares of every seed: all three summed
    errors = [r.error.reason for r in grid.received if r.has_error()]
    assert len(errors) == 1 and "both summed and dropped" in errors[0], errors
    assert metrics["clients"] == 3 and arrays is not None
    assert_within(strategy.global_adapter, plain_mean(spy, [0, 1, 2], 8),
                  strategy.records[1].extra["secure_aggregation"]["error_bound"])


def test_a_client_refuses_a_server_weight_that_departs_from_its_own_count() -> None:
    # Execute: the server tells client 0 a weight 100 times smaller than its examples give (the
    # issue's attack: tiny weights for the others make the "mean" one client's update)
    def shrink(record: ConfigRecord) -> None:
        record[protocol.SECAGG_WEIGHT] = float(cast(float, record[protocol.SECAGG_WEIGHT])) / 100

    # Assert: client 0 refused to mask, naming the weight; the round is clients 1 and 2
    assert_client_0_refuses("departs from the weight of its own 100 examples",
                            {0: (Stage.COLLECT_MASKED_VECTORS, shrink)})


@pytest.mark.parametrize(("edit", "why"), [
    # the others' counts inflated for client 0 alone (its own weight would shrink): its neighbours'
    # shares carry the digest of the parameters they were sent, not of its
    (replace(protocol.SECAGG_COUNTS, [100, 110, 10**6]), "round parameters this client was sent"),
    (replace(Key.THRESHOLD, 1), "shares and threshold"),
    (replace(protocol.SECAGG_GENERATOR, "mt19937-32"), "masks with 'mt19937-32'"),
    (replace(protocol.SECAGG_COUNTS, [10**15, 110, 120]), "example counts that are not"),
])
def test_a_client_refuses_round_parameters_a_server_changed(edit: Callable[[ConfigRecord], None], why: str) -> None:
    # Execute / Assert: the server sends client 0 changed parameters at the setup stage
    assert_client_0_refuses(why, {0: (Stage.SETUP, edit)})


def test_a_client_refuses_a_count_table_that_misstates_its_own_count_even_when_all_clients_get_it() -> None:
    # Execute / Assert: every client is sent one table, in which client 0 holds 90 examples, not 100
    edit = replace(protocol.SECAGG_COUNTS, [90, 110, 120])
    assert_client_0_refuses("lists 90 examples for this client, which holds 100",
                            {k: (Stage.SETUP, edit) for k in range(3)})


def assert_client_0_refuses(why: str, incoming: Edits) -> None:
    """A round whose server edits what clients receive (``incoming``): client 0 alone refuses (at
    setup, or at masking), saying ``why``, never masks; clients 1 and 2 are aggregated."""
    strategy, grid, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8], incoming=incoming)
    errors = [r.error.reason for r in grid.received if r.has_error()]
    assert len(errors) == 1 and why in errors[0], errors
    assert metrics["clients"] == 2 and arrays is not None
    assert_within(strategy.global_adapter, plain_mean(spy, [1, 2], 8),
                  strategy.records[1].extra["secure_aggregation"]["error_bound"])


def test_a_profile_of_ten_to_the_four_hundred_examples_is_refused_in_one_line() -> None:
    # Prepare: client 1 declares 10^400 training examples (it crashed any secure run before its
    # first round: an OverflowError in the weighing)
    huge = ('{"partition_id": 1, "rank": 4, "num_train_examples": 1' + "0" * 400
            + f', "fedlora_version": "{__version__}", "secure_masks": "{secagg.MASK_GENERATOR}"}}')
    # Execute
    strategy, _, spy, (arrays, metrics) = secure_round("fedit", [2, 4, 8], profiles={1: huge})
    # Assert: refused at join in one line naming the bound; the secure round runs with the others
    [reason] = strategy.roster.refused.values()
    assert "\n" not in reason and "less than or equal to 1000000000000" in reason, reason
    assert strategy.roster.partitions == [0, 2] and metrics["clients"] == 2 and arrays is not None
    assert_within(strategy.global_adapter, plain_mean(spy, [0, 2], 8),
                  strategy.records[1].extra["secure_aggregation"]["error_bound"])


@pytest.mark.parametrize("declared", ["", "mt19937-32"])
def test_a_silo_whose_client_would_use_the_32_bit_generator_cannot_join(declared: str) -> None:
    # Prepare: client 1's profile declares no mask generator (a client on Flower's own mod), or another
    profile = ClientProfile(partition_id=1, rank=4, num_train_examples=DECLARED[1], fedlora_version=__version__,
                            capabilities=["secure-aggregation"], secure_masks=declared)
    # Execute
    strategy, _, _, (_, metrics) = secure_round("fedit", [2, 4, 8], profiles={1: profile.model_dump_json()})
    # Assert: refused at join, one line naming it and why; the others run
    assert list(strategy.roster.refused) == ["partition 1"] and metrics["clients"] == 2
    reason = strategy.roster.refused["partition 1"]
    assert "\n" not in reason and "32 bits" in reason and secagg.MASK_GENERATOR in reason, reason


def test_a_round_below_the_threshold_fails_cleanly_and_leaves_the_state_as_it_was() -> None:
    # Execute: two of three clients crash after sharing keys: one survivor < threshold 2
    strategy, _, spy, result = secure_round("fedit", [2, 4, 8],
                                            kill={0: Stage.COLLECT_MASKED_VECTORS, 2: Stage.COLLECT_MASKED_VECTORS})
    # Assert: no aggregate, the failure counted, the global adapter the initial one
    record = strategy.records[1]
    assert result == (None, None) and strategy.failed_rounds == 1 and record.clients == 0
    assert record.extra["secure_aggregation"]["failed_stage"].startswith(Stage.COLLECT_MASKED_VECTORS)
    assert all(np.array_equal(value, initial_adapter(8)[key]) for key, value in strategy.global_adapter.items())
    assert set(spy) == {1}


def test_a_round_halted_at_setup_sends_no_training_message_and_counts_every_client_as_failed() -> None:
    # Execute: two of three clients crash at the setup stage
    strategy, grid, spy, result = secure_round("fedit", [2, 4, 8], kill={0: Stage.SETUP, 1: Stage.SETUP})
    # Assert: nobody trained, the round failed at setup
    record = strategy.records[1]
    assert result == (None, None) and spy == {} and record.failures == 3 and strategy.failed_rounds == 1
    assert record.extra["secure_aggregation"]["failed_stage"].startswith(Stage.SETUP)
    assert not any("arrays" in m.content.array_records for m in grid.sent)


def test_client_level_dp_noise_and_secure_aggregation_combine() -> None:
    # Prepare: FedIT at rank 8 with secure aggregation, wrapped in Flower's client-level DP
    # (client-side fixed clipping to C, Gaussian noise of std z C / m on the aggregate)
    config = load_config(SMOKE, ["strategy.name=fedit", "secure_aggregation.enabled=true", "clients.ranks=[8, 8, 8]"])
    strategy = create_strategy(config, initial_adapter, dict(MODULE))
    z, C = 1.0, 0.1  # every client's update (0.05 N(0, 1) on 800 entries, norm about 1.4) is clipped to C
    dp = DifferentialPrivacyClientSideFixedClipping(strategy, noise_multiplier=z, clipping_norm=C, num_sampled_clients=3)
    spy: dict[int, Any] = {}
    grid = RecordingGrid(secure_client([8, 8, 8], spy, {}, clip=True), [{"partition-id": k} for k in range(3)])
    np.random.seed(0)  # Flower draws the noise from numpy's global generator
    # Execute: a round through the wrapper (the clients clip, then mask what they clipped)
    replies = grid.send_and_receive(list(dp.configure_train(1, ArrayRecord(), ConfigRecord(), grid)), timeout=60.0)
    arrays, metrics = dp.aggregate_train(1, replies)
    # Assert: the server summed masked vectors only; the strategy's aggregate is the weighted mean
    # of the clipped uploads, computed here by hand, within the secure aggregation's error bound
    report = strategy.records[1].extra["secure_aggregation"]
    assert arrays is not None and metrics is not None and metrics["clients"] == 3 and report["masked"] == 3
    assert all(len(record) == 0 for reply in grid.received for record in reply.content.array_records.values())
    clipped = {}
    for k, (download, upload) in spy.items():
        update = {key: upload[key].astype(np.float64) - download[key] for key in download}
        norm = np.sqrt(sum(float(np.sum(v**2)) for v in update.values()))
        assert norm > 5 * C  # the clipping binds: an unclipped update would be far from the mean below
        clipped[k] = (download, {key: download[key] + update[key] * C / norm for key in download})
    expected = plain_mean(clipped, [0, 1, 2], 8)
    assert_within(strategy.global_arrays(), expected, report["error_bound"] + 1e-7)
    # ... and the wrapper returned it plus Flower's Gaussian noise, std z C / m, on every entry
    noised = from_array_record(arrays)
    residual = np.concatenate([(noised[key].astype(np.float64) - expected[key]).ravel() for key in expected])
    std = z * C / 3
    assert residual.size == 800 and abs(residual.std() / std - 1.0) < 0.1, (residual.std(), std)
    assert abs(residual.mean()) < 4 * std / np.sqrt(residual.size)


def server_arrays(state: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Every float array of a strategy's checkpointed state, by its path in the state."""
    if isinstance(state, np.ndarray):
        return {prefix: state} if state.dtype.kind == "f" else {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {path: array for key, value in items for path, array in server_arrays(value, f"{prefix}/{key}").items()}


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["fedit", "fedsa_lora"])
def test_a_whole_run_aggregated_securely_ends_at_the_plain_runs_adapter(name: str, tmp_path: Path) -> None:
    import fedlora
    from fedlora.checkpoint import load_server, restore_client_state

    # Execute: configs/smoke.toml (tiny BERT, 3 clients, 2 rounds; FedIT at ranks 2 / 4 / 8,
    # FedSA-LoRA at rank 4: it refuses mixed ranks), fedlora's ClientApp, plain and secure
    overrides = [f"strategy.name={name}", *(["clients.ranks=[4, 4, 4]"] if name == "fedsa_lora" else [])]
    plain = fedlora.run(str(SMOKE), overrides=overrides, out_dir=tmp_path / "plain", engine="inprocess")
    results = fedlora.run(str(SMOKE), overrides=[*overrides, "secure_aggregation.enabled=true"],
                          out_dir=tmp_path / "run", engine="inprocess")
    # Assert: every round masked and aggregated the three clients, within a tiny error bound
    assert [r["clients"] for r in results["rounds"]] == [3, 3]
    bounds = []
    for row in results["rounds"]:
        report = row["extra"]["secure_aggregation"]
        assert (report["masked"], report["dead_recovered"], report["after_share_keys"]) == (3, 0, 3)
        assert 0 < report["error_bound"] < 1e-6 and row["failures"] == 0
        bounds.append(report["error_bound"])
    # the server's state after round 2 (the global adapter; FedSA-LoRA's A and head) is the plain
    # run's within the rounds' error bounds (round 2's clients trained from round 1's secure mean)
    # plus float32's rounding of each of the two means
    secure_state = server_arrays(load_server(tmp_path / "run")["strategy"])
    plain_state = server_arrays(load_server(tmp_path / "plain")["strategy"])
    assert secure_state.keys() == plain_state.keys() and len(plain_state) >= 2
    for key, value in plain_state.items():
        difference = np.abs(secure_state[key].astype(np.float64) - value)
        assert np.all(difference <= sum(bounds) + 2 * 2**-23 * np.abs(value)), (key, difference.max(), bounds)
    assert sum(float(np.abs(v).sum()) for v in plain_state.values()) > 0
    for metric in ("global_accuracy", "personalized_accuracy", "train_loss"):
        assert [r[metric] for r in results["rounds"]] == pytest.approx([r[metric] for r in plain["rounds"]], abs=1e-5)
    # the mod's state (private keys, seeds, shares) never reaches a client's checkpoint
    for k in range(3):
        state = RecordDict()
        assert restore_client_state(tmp_path / "run" / "checkpoint" / "clients", k, 2, state) == 2
        assert len(state) > 0 and RECORD_KEY_STATE not in state.config_records
