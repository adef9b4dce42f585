"""Secure aggregation (SecAgg+): the arithmetic of fedlora/secagg.py and the config refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlora import secagg
from fedlora.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
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
    (["secure_aggregation.clip_norm=2.0", "secure_aggregation.clipping_range=1.0"], "is below clip_norm"),
    (["secure_aggregation.max_error=1e-12"], "worst-case error bound"),
])
def test_what_secure_aggregation_cannot_do_is_refused_in_one_line(overrides: list[str], why: str) -> None:
    # Execute / Assert
    with pytest.raises(ConfigError) as refused:
        load_config(SMOKE, ["secure_aggregation.enabled=true", *overrides])
    assert why in str(refused.value) and "\n" not in str(refused.value)


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
