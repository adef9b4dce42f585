"""FedDR-LoRA: negative learning, the GMM clean / suspect split and the posterior weighting of the
robust loss, where gradients flow in the dual branch, what leaves the client (B^r only), the
ablation without the noise branch and the byte ledger end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fedlora_run
from result_checks import assert_accuracies_add_up

from fedlora.config import ConfigError, load_config
from fedlora.lora import A_SUFFIX, B_SUFFIX, HEAD_PREFIX

ROOT = Path(__file__).resolve().parents[1]
NOISY_SMOKE = ["strategy.name=feddr_lora", "data.label_noise=symmetric", "data.noise_rate=0.4"]
ONE_RANK = ["clients.ranks=[4, 4, 4]"]  # smoke.toml declares mixed ranks [2, 4, 8]
# tiny-bert: 2 layers x (query, value), d = 32, 8 labels; float32 on the wire
B_BYTES_PER_RANK = 2 * 2 * 32 * 4
HEAD_BYTES = (8 * 32 + 8) * 4


# ------------------------------------------------------------------------------ negative learning
@pytest.mark.parametrize(
    "logits, target, expected_loss, expected_grad",
    [
        # p = (1/4, 1/2, 1/4), y = 1: NL = -log(1 - 1/2) = log 2; dNL/dz = p_y (e_y - p) / (1 - p_y) = e_y - p
        ([0.0, math.log(2.0), 0.0], 1, math.log(2.0), [-0.25, 0.5, -0.25]),
        # p = (1/2, 1/2), y = 0: log 2, gradient (1/2, -1/2)
        ([0.0, 0.0], 0, math.log(2.0), [0.5, -0.5]),
        # p = (1/6, 1/3, 1/2), y = 0: -log(5/6); gradient (1/6)(e_0 - p)/(5/6) = (e_0 - p) / 5
        ([0.0, math.log(2.0), math.log(3.0)], 0, -math.log(5.0 / 6.0), [(1 - 1 / 6) / 5, -(1 / 3) / 5, -(1 / 2) / 5]),
        # p_y -> 1 (z_y - z_other = 40): NL ~ 40, gradient ~ (1, -1), finite (no clamp needed)
        ([40.0, 0.0], 0, 40.0, [1.0, -1.0]),
    ],
)
def test_negative_learning_value_and_gradient(
    logits: list[float], target: int, expected_loss: float, expected_grad: list[float]
) -> None:
    import torch

    from fedlora.clients.trainers.feddr_lora import negative_learning_loss

    # Prepare
    z = torch.tensor([logits], dtype=torch.float64, requires_grad=True)
    # Execute
    loss = negative_learning_loss(z, torch.tensor([target]))
    loss.sum().backward()
    # Assert: value = -log(1 - softmax(z)_y), gradient as derived by hand
    assert loss.shape == (1,)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert z.grad is not None
    assert np.allclose(z.grad.numpy()[0], expected_grad, atol=1e-6)


def test_negative_learning_matches_the_definition_on_random_logits() -> None:
    import torch

    from fedlora.clients.trainers.feddr_lora import negative_learning_loss

    # Prepare
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(64, 8, generator=generator, dtype=torch.float64)
    target = torch.randint(0, 8, (64,), generator=generator)
    # Execute
    loss = negative_learning_loss(logits, target)
    # Assert
    p_y = torch.softmax(logits, -1).gather(1, target[:, None])[:, 0]
    assert torch.allclose(loss, -torch.log(1 - p_y), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "nl_target, expected",
    [
        # every sample with its complementary label y-bar = (0, 2, 2): -log(1 - p_y-bar) per sample
        ("complementary", (-math.log(1 - 0.25) - math.log(1 - 0.2) - math.log(1 - 1 / 3)) / 3),
        # the one suspect sample (index 1) with its given label 0: -log(1 - 0.6)
        ("given", -math.log(1 - 0.6)),
    ],
)
def test_noise_branch_negative_learning_value_by_hand(nl_target: str, expected: float) -> None:
    import torch

    from fedlora.clients.trainers.feddr_lora import negative_learning_loss, noise_targets

    # Prepare: p = (1/4, 1/4, 1/2), (3/5, 1/5, 1/5), (1/3, 1/3, 1/3); sample 1 is the suspect
    logits = torch.tensor([[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0], [0.0, 0.0, 0.0]])
    labels, clean = torch.tensor([2, 0, 1]), torch.tensor([True, False, True])
    complementary = torch.tensor([0, 2, 2])
    # Execute
    mask, targets = noise_targets(labels, clean, nl_target, complementary)
    value = negative_learning_loss(logits[mask], targets[mask]).mean()
    # Assert
    assert float(value) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("clean", (1.0 + 3.0) / 2),  # the batch's clean samples (posterior > 0.5: 0 and 2)
        ("all", (1.0 + 2.0 + 3.0) / 3),
        # w = (0.9, 0.2, 0.6), the split's mean weight 0.5: (0.9 + 0.4 + 1.8) / (3 * 0.5)
        ("posterior", (0.9 * 1.0 + 0.2 * 2.0 + 0.6 * 3.0) / (3 * 0.5)),
    ],
)
def test_robust_branch_cross_entropy_by_mode(mode: str, expected: float) -> None:
    import torch

    from fedlora.clients.trainers.feddr_lora import robust_term
    from fedlora.methods.feddr_lora import robust_weights

    # Prepare: per-sample CE (1, 2, 3), clean posteriors (0.9, 0.2, 0.6): sample 1 suspect
    weights = robust_weights(np.array([0.9, 0.2, 0.6]), mode, threshold=0.5)
    # Execute
    value = robust_term(torch.tensor([1.0, 2.0, 3.0]), torch.from_numpy(weights).float(), mode, split_mean=0.5)
    # Assert
    assert float(value) == pytest.approx(expected)


def test_default_robust_loss_gives_the_split_noisy_samples_less_weight() -> None:
    """Acceptance (issue 29): with the default options the samples the split calls noisy get less
    weight in the robust loss, and the loss is the posterior-weighted CE."""
    import torch

    from fedlora.clients.trainers.feddr_lora import robust_term
    from fedlora.methods.feddr_lora import FedDRLoRAOptions, robust_weights, split_posterior

    # Prepare: 10 per-sample CE values of two given labels, each with a low and a high-loss group
    options = FedDRLoRAOptions()
    ce = [0.10, 0.20, 0.15, 2.30, 2.60, 0.05, 0.12, 0.08, 0.11, 2.40]
    labels = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1])
    high = np.array([False, False, False, True, True, False, False, False, False, True])
    # Execute: the split (fitted on these losses, as split = epoch does) and the robust term
    posterior = split_posterior(np.array(ce), labels, options.split_scope)
    flagged = posterior <= options.clean_threshold
    weights = robust_weights(posterior, options.robust_loss, options.clean_threshold)
    value = robust_term(torch.tensor(ce), torch.from_numpy(weights).float(), options.robust_loss, float(weights.mean()))
    # Assert: the split flags exactly the high-loss group, and they weigh less than every clean sample
    assert flagged.tolist() == high.tolist()
    assert weights[flagged].max() < 0.01 and weights[~flagged].min() > 0.99
    # Assert: the loss is the weighted mean sum w_i CE_i / sum w_i (the split covers this batch) ...
    hand = sum(w * c for w, c in zip(weights.tolist(), ce)) / sum(weights.tolist())
    assert float(value) == pytest.approx(hand, rel=1e-5)
    # ... which, with weights ~1 / ~0, is the mean of the seven low losses, not the plain mean 0.816
    assert float(value) == pytest.approx((0.10 + 0.20 + 0.15 + 0.05 + 0.12 + 0.08 + 0.11) / 7, abs=0.02)


def test_class_scope_splits_each_label_among_itself() -> None:
    from fedlora.methods.feddr_lora import split_posterior

    # Prepare: label 0 is learned (low losses, one high); label 1 is not yet (all high, one higher);
    # label 2 has 3 samples only
    losses = np.array([0.10, 0.20, 0.15, 0.12, 2.50, 1.90, 2.00, 1.95, 2.05, 3.20, 0.1, 0.1, 3.0])
    labels = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2])
    # Execute
    pooled = split_posterior(losses, labels, "pooled") > 0.5
    per_class = split_posterior(losses, labels, "class") > 0.5
    # Assert: pooled flags the whole unlearned label 1; per class only its outlier (and label 0's);
    # label 2 is too small to split and counts as clean
    assert pooled[5:10].tolist() == [False] * 5
    assert per_class.tolist() == [True] * 4 + [False] + [True] * 4 + [False] + [True] * 3


@pytest.mark.parametrize(
    "posterior, mode, expected",
    [
        ([0.9, 0.2, 0.6], "posterior", [0.9, 0.2, 0.6]),
        ([0.9, 0.2, 0.6], "clean", [1.0, 0.0, 1.0]),
        ([0.9, 0.2, 0.6], "all", [1.0, 1.0, 1.0]),
    ],
)
def test_robust_weights_by_mode(posterior: list[float], mode: str, expected: list[float]) -> None:
    from fedlora.methods.feddr_lora import robust_weights

    # Execute / Assert
    assert robust_weights(np.array(posterior), mode, threshold=0.5).tolist() == expected


def test_complementary_labels_never_equal_the_given_label() -> None:
    import torch

    from fedlora.clients.trainers.feddr_lora import complementary_labels

    # Prepare
    labels = torch.arange(8).repeat(500)
    # Execute
    other = complementary_labels(labels, 8, torch.Generator().manual_seed(0))
    # Assert: never y, and each of the 7 other classes about equally often (4000 / 8 / 7 ~ 71)
    assert not bool((other == labels).any())
    counts = np.bincount(other[labels == 0].numpy(), minlength=8)
    assert counts[0] == 0 and counts[1:].min() > 40


# ------------------------------------------------------------------------------ GMM split
@pytest.mark.parametrize(
    "noise_rate, clean_loss, noisy_loss, min_precision, min_recall",
    [
        (0.2, (0.3, 0.2), (2.5, 0.6), 0.9, 0.9),  # (mean, std) of the per-sample CE
        (0.4, (0.3, 0.2), (2.5, 0.6), 0.9, 0.9),
        (0.6, (0.5, 0.3), (2.0, 0.5), 0.9, 0.9),  # more noisy than clean: clean is still the low-loss mode
        (0.4, (0.8, 0.4), (1.8, 0.5), 0.75, 0.75),  # overlapping modes: chance precision is 0.4
    ],
)
def test_gmm_split_flags_injected_noise_far_above_chance(
    noise_rate: float,
    clean_loss: tuple[float, float],
    noisy_loss: tuple[float, float],
    min_precision: float,
    min_recall: float,
) -> None:
    from fedlora.methods.feddr_lora import gmm_clean_mask, split_counts, split_quality

    # Prepare: per-sample losses where noisy samples (wrong label) have high loss
    rng = np.random.default_rng(0)
    n = 1000
    is_noisy = np.zeros(n, dtype=bool)
    is_noisy[rng.choice(n, size=int(noise_rate * n), replace=False)] = True
    losses = np.where(is_noisy, rng.normal(*noisy_loss, n), rng.normal(*clean_loss, n)).clip(min=0.0)
    # Execute
    suspect = ~gmm_clean_mask(losses)
    quality = split_quality(split_counts(suspect, is_noisy))
    # Assert: chance (flagging at random) has precision = noise_rate; the split is far above it
    assert quality["precision"] > min_precision > noise_rate
    assert quality["recall"] > min_recall
    assert abs(quality["flagged-fraction"] - noise_rate) < 0.15


@pytest.mark.parametrize("losses", [[1.0] * 50, [0.5, 2.0, 0.1], []])
def test_gmm_split_keeps_everything_when_there_is_nothing_to_separate(losses: list[float]) -> None:
    from fedlora.methods.feddr_lora import gmm_clean_mask

    # Execute
    clean = gmm_clean_mask(np.asarray(losses))
    # Assert: constant losses or fewer than 4 samples: all clean
    assert clean.dtype == bool and clean.all() and len(clean) == len(losses)


def test_split_quality_counts_on_a_hand_made_mask() -> None:
    from fedlora.methods.feddr_lora import split_counts, split_quality

    # Prepare: 3 flagged, 2 of them noisy; 4 noisy in 10
    suspect = np.array([1, 1, 1, 0, 0, 0, 0, 0, 0, 0], dtype=bool)
    is_noisy = np.array([1, 1, 0, 1, 1, 0, 0, 0, 0, 0], dtype=bool)
    # Execute
    counts = split_counts(suspect, is_noisy)
    quality = split_quality(counts)
    # Assert
    assert counts == {"flagged": 3.0, "true-positives": 2.0, "noisy": 4.0, "samples": 10.0}
    assert quality == pytest.approx({"precision": 2 / 3, "recall": 0.5, "flagged-fraction": 0.3})


# ------------------------------------------------------------------------------ server math
@pytest.mark.parametrize("weights", [[1.0, 1.0, 2.0], [0.2, 0.3, 0.5], [5.0, 0.0, 0.0]])
def test_server_averages_robust_B_and_refuses_A(weights: list[float]) -> None:
    from fedlora.methods.feddr_lora import aggregate_robust_B

    # Prepare
    rng = np.random.default_rng(1)
    uploads = [{"m::B": rng.standard_normal((6, 2)), "head::w": rng.standard_normal(3)} for _ in weights]
    # Execute
    averaged = aggregate_robust_B(uploads, weights)
    # Assert: B = sum_k p_k B_k^r, head the same
    p = np.asarray(weights) / sum(weights)
    assert np.allclose(averaged["m::B"], sum(pk * u["m::B"] for pk, u in zip(p, uploads)))
    assert np.allclose(averaged["head::w"], sum(pk * u["head::w"] for pk, u in zip(p, uploads)))
    with pytest.raises(ValueError, match="keeps A local"):
        aggregate_robust_B([{**uploads[0], "m::A": np.zeros((2, 4))}], [1.0])


def test_split_summary_micro_averages_client_counts_and_weights() -> None:
    from fedlora.methods.feddr_lora import split_summary, weight_sums

    # Prepare: client 0 flagged 3 (2 noisy) of 4 noisy; client 1 flagged 1 (1 noisy) of 2 noisy;
    # client 2 does not know the truth (no is_noisy column): flagged 2 of 10
    per_client = {
        0: {"noise-flagged": 3.0, "noise-true-positives": 2.0, "noise-noisy": 4.0, "noise-samples": 10.0},
        1: {"noise-flagged": 1.0, "noise-true-positives": 1.0, "noise-noisy": 2.0, "noise-samples": 10.0},
        2: {"noise-flagged": 2.0, "noise-samples": 10.0},
    }
    # client 0's robust weights: noisy samples 0.1 and 0.3, clean 0.8, 1.0, 0.9
    weights = np.array([0.1, 0.3, 0.8, 1.0, 0.9])
    noisy = np.array([True, True, False, False, False])
    per_client[0] |= {"noise-" + k: v for k, v in weight_sums(weights, {"noisy": noisy, "clean": ~noisy}).items()}
    # client 1's: one noisy sample 0.5, one clean 0.7
    per_client[1] |= {"noise-weight-sum-noisy": 0.5, "noise-weight-n-noisy": 1.0,
                      "noise-weight-sum-clean": 0.7, "noise-weight-n-clean": 1.0}
    # Execute
    summary = split_summary(per_client)
    # Assert: (2 + 1) / (3 + 1) and (2 + 1) / (4 + 2) over the clients that know the truth
    assert summary["feddr_noise_precision"] == pytest.approx(0.75)
    assert summary["feddr_noise_recall"] == pytest.approx(0.5)
    assert summary["feddr_noise_rate"] == pytest.approx(0.3)
    assert summary["feddr_flagged_fraction"] == pytest.approx(6 / 30)
    assert summary["feddr_split_active"] == 1.0
    # Assert: mean weight per group over all the clients' samples: (0.1 + 0.3 + 0.5) / 3, (2.7 + 0.7) / 4
    assert summary["feddr_weight_noisy"] == pytest.approx(0.9 / 3)
    assert summary["feddr_weight_clean"] == pytest.approx(3.4 / 4)
    assert "feddr_weight_flagged" not in summary  # no client reported that group
    assert set(summary["feddr_split_per_client"]) == {"0", "1", "2"}
    assert all(isinstance(v, float) for k, v in summary.items() if k != "feddr_split_per_client")


def test_epoch_split_batches_hands_each_epoch_its_capped_batches() -> None:
    from fedlora.clients.trainers.feddr_lora import EpochSplitBatches

    # Prepare: a 5-batch loader, at most 3 steps in all
    seen: list[list[int]] = []
    wrapped = EpochSplitBatches([{"b": i} for i in range(5)], 3, lambda batches: seen.append([b["b"] for b in batches]))
    # Execute: two epochs
    first, second = [b["b"] for b in wrapped], [b["b"] for b in wrapped]
    # Assert: the split sees exactly what the epoch yields; the cap is spent in the first epoch
    assert first == [0, 1, 2] and second == [] and seen == [[0, 1, 2]]
    uncapped = EpochSplitBatches([{"b": i} for i in range(2)], 0, lambda batches: seen.append([b["b"] for b in batches]))
    assert [b["b"] for b in uncapped] + [b["b"] for b in uncapped] == [0, 1, 0, 1] and seen[1:] == [[0, 1], [0, 1]]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.beta=-1"], "strategy.beta"),
        (["strategy.topology=three_lora"], "strategy.topology"),
        (["strategy.nl_target=random"], "strategy.nl_target"),
        (["strategy.robust_loss=some"], "strategy.robust_loss"),
        (["strategy.noise_branch=maybe"], "strategy.noise_branch"),
        (["strategy.clean_threshold=1.5"], "strategy.clean_threshold"),
        (["strategy.warmup=2"], "unknown option 'strategy.warmup'"),
    ],
)
def test_bad_options_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(ROOT / "configs/smoke.toml", NOISY_SMOKE + overrides)


# ------------------------------------------------------------------------------ client: dual branch
def make_trainer(overrides: list[str], server_round: int):
    """A FedDR-LoRA client trainer for partition 0 of the noisy smoke federation."""
    from flwr.app import RecordDict

    from fedlora.clients.trainers.base import ClientJob
    from fedlora.clients.trainers.feddr_lora import FedDRLoRATrainer
    from fedlora.data import build_federated_data
    from fedlora.profile import resolve_profile

    config = load_config(ROOT / "configs/smoke.toml", NOISY_SMOKE + ONE_RANK + overrides)
    federated = build_federated_data(config.data)
    profile = resolve_profile(config, {"partition-id": 0})
    job = ClientJob(config, profile, federated.client(0), federated, RecordDict(), {"server-round": server_round})
    return FedDRLoRATrainer(job)


def randomise_B(model, trainer) -> None:
    """Non-zero B^r and B^n, so that A is reachable through both branches."""
    import torch

    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
        for param in trainer.noise.values():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))


def grad_norms(model, trainer) -> dict[str, float]:
    """Total |grad| of A, B^r, head, B^n and A^n (0 when a parameter got no gradient)."""
    def norm(p) -> float:
        return 0.0 if p.grad is None else float(p.grad.abs().sum())

    named = dict(model.named_parameters())
    return {
        "A": sum(norm(p) for n, p in named.items() if ".lora_A." in n),
        "B_r": sum(norm(p) for n, p in named.items() if ".lora_B." in n),
        "head": sum(norm(p) for n, p in named.items() if "classifier" in n),
        "B_n": sum(norm(p) for n, p in trainer.noise.items() if ".lora_B." in n),
        "A_n": sum(norm(p) for n, p in trainer.noise.items() if ".lora_A." in n),
    }


@pytest.mark.parametrize(
    "options, reached, untouched",
    [
        (["strategy.topology=shared_a"], {"A", "B_n"}, {"B_r", "A_n", "head"}),  # NL reaches the shared A
        (["strategy.topology=two_lora"], {"A_n", "B_n"}, {"A", "B_r", "head"}),  # (A^n, B^n) take it all
        (["strategy.noise_head=shared"], {"A", "B_n", "head"}, {"B_r", "A_n"}),  # ... and the head if asked
    ],
)
def test_negative_learning_gradient_reaches_the_noise_branch_only(
    options: list[str], reached: set[str], untouched: set[str]
) -> None:
    from fedlora.clients.trainers.feddr_lora import negative_learning_loss
    from fedlora.training import model_inputs

    # Prepare
    trainer = make_trainer(options, server_round=2)
    model = trainer.prepare({})
    randomise_B(model, trainer)
    model.train()
    batch = next(iter(trainer.loader(trainer.job.data.train, "train", shuffle=True)))
    # Execute: the NL loss through f_n alone
    logits = trainer._noise_forward(model, model_inputs(batch, trainer.device))
    negative_learning_loss(logits, batch["labels"]).mean().backward()
    norms = grad_norms(model, trainer)
    # Assert
    assert all(norms[k] > 0 for k in reached), norms
    assert all(norms[k] == 0 for k in untouched), norms


def test_cross_entropy_gradient_reaches_the_robust_branch_only() -> None:
    import torch.nn.functional as F

    from fedlora.training import model_inputs

    # Prepare
    trainer = make_trainer([], server_round=2)
    model = trainer.prepare({})
    randomise_B(model, trainer)
    model.train()
    batch = next(iter(trainer.loader(trainer.job.data.train, "train", shuffle=True)))
    # Execute: CE through f_r (the peft model as it is)
    F.cross_entropy(model(**model_inputs(batch, trainer.device)).logits, batch["labels"]).backward()
    norms = grad_norms(model, trainer)
    # Assert
    assert norms["A"] > 0 and norms["B_r"] > 0 and norms["head"] > 0
    assert norms["B_n"] == 0


@pytest.mark.parametrize("head, head_sent", [("global", True), ("local", False)])
def test_client_uploads_B_r_only_and_keeps_A_and_B_n(head: str, head_sent: bool) -> None:
    from fedlora.clients.trainers.feddr_lora import NOISE_STATE_KEY
    from fedlora.lora import from_array_record

    # Prepare: a round after warm-up, so the full dual-branch objective runs
    trainer = make_trainer([f"model.head={head}", "train.max_steps=3"], server_round=2)
    model = trainer.prepare({})
    # Execute
    stats = trainer.fit(model)
    upload = trainer.upload(model)
    trainer.save_state(trainer.keep(model))
    # Assert: B^r of every module (+ head when global), never A or the noise branch
    assert stats.steps == 3 and math.isfinite(stats.loss)
    assert sum(k.endswith(B_SUFFIX) for k in upload) == 4
    assert not any(k.endswith(A_SUFFIX) or "noise" in k for k in upload)
    assert any(k.startswith(HEAD_PREFIX) for k in upload) == head_sent
    # Assert: A and B^n stay in the client state; B^n moved away from zero
    noise = from_array_record(trainer.job.state[NOISE_STATE_KEY])
    assert len(noise) == 4 and any(np.abs(v).sum() > 0 for v in noise.values())
    # Assert: the split covered the samples of the 3 trained batches (split = epoch, capped by max_steps)
    metrics = trainer.train_metrics()
    assert metrics["noise-samples"] == 3 * 16 and 0 < metrics["noise-noisy"] < metrics["noise-samples"]
    assert metrics["noise-recall"] == metrics["noise-true-positives"] / metrics["noise-noisy"]
    assert metrics["noise-true-positives"] <= min(metrics["noise-flagged"], metrics["noise-noisy"])


def test_epoch_split_is_fitted_on_exactly_the_batches_the_round_trains_on() -> None:
    # Prepare: record the samples each training step sees
    trainer = make_trainer(["train.max_steps=3"], server_round=2)
    model = trainer.prepare({})
    trained: list[int] = []
    loss = trainer.loss

    def recording_loss(model, batch):
        trained.extend(batch["index"].tolist())
        return loss(model, batch)

    trainer.loss = recording_loss
    # Execute
    trainer.fit(model)
    # Assert: the posterior is known for the trained samples and no other
    assert len(trained) == 3 * 16
    assert sorted(np.flatnonzero(np.isfinite(trainer.posterior)).tolist()) == sorted(trained)
    assert trainer.splits == 1


@pytest.mark.parametrize("noise_branch", [False, True])
def test_trainer_robust_loss_is_the_posterior_weighted_cross_entropy(noise_branch: bool) -> None:
    import torch
    import torch.nn.functional as F

    from fedlora.clients.trainers.feddr_lora import negative_learning_loss
    from fedlora.training import model_inputs

    # Prepare: a round after warm-up; a hand posterior for the batch's samples (as an epoch split)
    trainer = make_trainer([f"strategy.noise_branch={str(noise_branch).lower()}"], server_round=2)
    model = trainer.prepare({})
    randomise_B(model, trainer)
    model.eval()  # no dropout, so the test's forward equals the trainer's
    batch = next(iter(trainer.loader(trainer.job.data.train, "train", shuffle=True)))
    index = batch["index"].numpy()
    posterior = np.linspace(0.0, 1.0, len(index))
    trainer.posterior[index] = posterior
    trainer.split_mean = 0.4
    generator_state = trainer.generator.get_state()
    # Execute
    value = float(trainer.loss(model, batch).detach())
    # Assert: sum_i w_i CE_i / (n * 0.4), plus beta * mean NL on the complementary labels with the branch
    with torch.no_grad():
        ce = F.cross_entropy(model(**model_inputs(batch, trainer.device)).logits, batch["labels"], reduction="none")
        hand = float((torch.from_numpy(posterior).float() * ce).sum()) / (len(index) * 0.4)
        if noise_branch:
            trainer.generator.set_state(generator_state)
            other = trainer._complementary(batch["labels"])
            noise_logits = trainer._noise_forward(model, model_inputs(batch, trainer.device))
            hand += trainer.options.beta * float(negative_learning_loss(noise_logits, other).mean())
    assert value == pytest.approx(hand, rel=1e-5)
    # Assert: the weights were recorded per group (flagged: posterior <= 0.5)
    weights = trainer.train_metrics()
    flagged = posterior <= 0.5
    assert weights["noise-weight-sum-flagged"] == pytest.approx(posterior[flagged].sum())
    assert weights["noise-weight-n-unflagged"] == (~flagged).sum()


def test_without_the_noise_branch_there_is_no_B_n_to_train_or_keep() -> None:
    from fedlora.clients.trainers.feddr_lora import NOISE_STATE_KEY

    # Prepare
    with_branch, without = (make_trainer([f"strategy.noise_branch={flag}", "train.max_steps=2"], server_round=2)
                            for flag in ("true", "false"))
    models = [with_branch.prepare({}), without.prepare({})]
    # Execute
    counts = [sum(p.numel() for p in t.trainable_parameters(m, []) ) for t, m in zip((with_branch, without), models)]
    without.fit(models[1])
    without.save_state(without.keep(models[1]))
    # Assert: rank 4 on 4 modules of width 32: A 4 x 4 x 32 = 512, B^r 512, head 8 x 32 + 8 = 264; B^n 512 more
    assert counts == [512 + 512 + 264 + 512, 512 + 512 + 264]
    assert without.noise == {} and NOISE_STATE_KEY not in without.job.state
    assert without.train_metrics()["noise-samples"] == 2 * 16


def test_warm_up_round_is_plain_cross_entropy_without_split_metrics() -> None:
    # Prepare
    trainer = make_trainer(["train.max_steps=2"], server_round=1)
    model = trainer.prepare({})
    # Execute
    trainer.fit(model)
    # Assert: no split, no B^n update; every trained sample has robust weight 1 (noisy ones too)
    metrics = trainer.train_metrics()
    assert not any(k in metrics for k in ("noise-samples", "noise-flagged", "noise-precision"))
    noisy = metrics["noise-weight-n-noisy"]
    assert noisy > 0 and noisy + metrics["noise-weight-n-clean"] == 2 * 16
    assert metrics["noise-weight-sum-noisy"] == noisy and "noise-weight-n-flagged" not in metrics
    assert all(float(p.detach().abs().sum()) == 0.0 for p in trainer.noise.values())


# ------------------------------------------------------------------------------ end to end
@pytest.mark.e2e
@pytest.mark.parametrize(
    "overrides, rank, head_bytes",
    [
        (ONE_RANK, 4, HEAD_BYTES),
        (ONE_RANK + ["strategy.split=batch", "strategy.nl_target=given", "model.head=local"], 4, 0),
        ([], 2, HEAD_BYTES),  # smoke's mixed ranks [2, 4, 8]: one rank, the smallest (mixed_rank_policy)
        (ONE_RANK + ["strategy.noise_branch=false"], 4, HEAD_BYTES),  # the ablation moves the same bytes
    ],
)
def test_inprocess_noisy_smoke_ledger_is_B_r_only(
    tmp_path: Path, overrides: list[str], rank: int, head_bytes: int
) -> None:
    from fedlora.app.runner import run_inprocess

    # Prepare: 3 clients, 40 % symmetric noise, 2 rounds (round 1 = warm-up)
    config = load_config(ROOT / "configs/smoke.toml", NOISY_SMOKE + overrides)
    # Execute
    run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: the byte ledger is B^r (+ head) up and B (+ head) down, exactly
    per_client = rank * B_BYTES_PER_RANK + head_bytes
    for record in results["rounds"]:
        assert record["failures"] == 0 and record["clients"] == 3
        assert record["bytes_up"] == record["bytes_down"] == 3 * per_client
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])
    # Assert: the warm-up round records weight 1 for every sample and no split
    warm_up, split = (r["extra"] for r in results["rounds"])
    assert warm_up["feddr_split_active"] == 0.0 and "feddr_noise_precision" not in warm_up
    assert warm_up["feddr_weight_noisy"] == warm_up["feddr_weight_clean"] == 1.0
    # Assert: then the split's quality against the injected noise and the weights per group
    assert split["feddr_split_active"] == 1.0
    counts = {key: sum(c[key] for c in split["feddr_split_per_client"].values())
              for key in ("true-positives", "noisy", "flagged", "samples")}  # each client's own counts
    assert split["feddr_noise_recall"] == pytest.approx(counts["true-positives"] / counts["noisy"])
    assert split["feddr_noise_rate"] == pytest.approx(counts["noisy"] / counts["samples"])
    assert 0.2 < split["feddr_noise_rate"] < 0.6  # 40 % injected, over the few samples trained on
    # hits / samples two ways: precision * flagged fraction = recall * noise rate
    assert split["feddr_noise_precision"] * split["feddr_flagged_fraction"] == pytest.approx(
        split["feddr_noise_recall"] * split["feddr_noise_rate"])
    if "robust_loss" not in " ".join(overrides):  # the default, posterior: flagged means posterior <= 0.5
        assert split["feddr_weight_flagged"] <= 0.5 < split["feddr_weight_unflagged"]
    assert set(split["feddr_split_per_client"]) == {"0", "1", "2"}
    assert all((tmp_path / f"adapters/client_{k}/adapter_config.json").is_file() for k in range(3))


@pytest.mark.slow
def test_cli_noisy_smoke_run(tmp_path: Path) -> None:
    # Execute: the CLI, in process (Ray: tests/test_run.py, tests/test_ray_cluster.py; gRPC: tests/test_deploy_strategies.py)
    proc = fedlora_run(tmp_path, *NOISY_SMOKE, *ONE_RANK, args=("--engine", "inprocess"))
    # Assert
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["strategy"] == "feddr_lora" and len(results["rounds"]) == 2
    assert all(r["bytes_up"] == 3 * (4 * B_BYTES_PER_RANK + HEAD_BYTES) for r in results["rounds"])
    assert "feddr_noise_precision" in results["rounds"][1]["extra"]
