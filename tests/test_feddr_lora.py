"""FedDR-LoRA: negative learning, the GMM clean / suspect split, where gradients flow in the dual
branch, what leaves the client (B^r only) and the byte ledger end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fedlora_run

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

    from clients.trainers.feddr_lora import negative_learning_loss

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

    from clients.trainers.feddr_lora import negative_learning_loss

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

    from clients.trainers.feddr_lora import negative_learning_loss, noise_targets

    # Prepare: p = (1/4, 1/4, 1/2), (3/5, 1/5, 1/5), (1/3, 1/3, 1/3); sample 1 is the suspect
    logits = torch.tensor([[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0], [0.0, 0.0, 0.0]])
    labels, clean = torch.tensor([2, 0, 1]), torch.tensor([True, False, True])
    complementary = torch.tensor([0, 2, 2])
    # Execute
    mask, targets = noise_targets(labels, clean, nl_target, complementary)
    value = negative_learning_loss(logits[mask], targets[mask]).mean()
    # Assert
    assert float(value) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode, expected", [("clean", (1.0 + 3.0) / 2), ("all", (1.0 + 2.0 + 3.0) / 3)])
def test_robust_branch_cross_entropy_on_clean_or_all_samples(mode: str, expected: float) -> None:
    import torch

    from clients.trainers.feddr_lora import robust_term

    # Execute: per-sample CE (1, 2, 3), sample 1 suspect
    value = robust_term(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True]), mode)
    # Assert
    assert float(value) == pytest.approx(expected)


def test_complementary_labels_never_equal_the_given_label() -> None:
    import torch

    from clients.trainers.feddr_lora import complementary_labels

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


def test_split_summary_micro_averages_client_counts() -> None:
    from fedlora.methods.feddr_lora import split_summary

    # Prepare: client 0 flagged 3 (2 noisy) of 4 noisy; client 1 flagged 1 (1 noisy) of 2 noisy
    per_client = {
        0: {"noise-flagged": 3.0, "noise-true-positives": 2.0, "noise-noisy": 4.0, "noise-samples": 10.0},
        1: {"noise-flagged": 1.0, "noise-true-positives": 1.0, "noise-noisy": 2.0, "noise-samples": 10.0},
    }
    # Execute
    summary = split_summary(per_client)
    # Assert: (2 + 1) / (3 + 1) and (2 + 1) / (4 + 2)
    assert summary["noise_precision"] == pytest.approx(0.75)
    assert summary["noise_recall"] == pytest.approx(0.5)
    assert summary["noise_true_rate"] == pytest.approx(0.3)
    assert set(summary["noise_split_per_client"]) == {"0", "1"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.beta=-1"], "strategy.beta"),
        (["strategy.topology=three_lora"], "strategy.topology"),
        (["strategy.nl_target=random"], "strategy.nl_target"),
        (["strategy.robust_loss=some"], "strategy.robust_loss"),
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

    from clients.trainers.base import ClientJob
    from clients.trainers.feddr_lora import FedDRLoRATrainer
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
    from clients.trainers.feddr_lora import negative_learning_loss
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
    from clients.trainers.feddr_lora import NOISE_STATE_KEY
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
    metrics = trainer.train_metrics()
    assert 0.0 <= metrics["noise-recall"] <= 1.0 and metrics["noise-samples"] == len(trainer.job.data.train)


def test_warm_up_round_is_plain_cross_entropy_without_split_metrics() -> None:
    # Prepare
    trainer = make_trainer(["train.max_steps=2"], server_round=1)
    model = trainer.prepare({})
    # Execute
    trainer.fit(model)
    # Assert: no split, no B^n update
    assert trainer.train_metrics() == {}
    assert all(float(p.detach().abs().sum()) == 0.0 for p in trainer.noise.values())


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize(
    "overrides, rank, head_bytes",
    [
        (ONE_RANK, 4, HEAD_BYTES),
        (ONE_RANK + ["strategy.split=batch", "strategy.nl_target=given", "model.head=local"], 4, 0),
        ([], 2, HEAD_BYTES),  # smoke's mixed ranks [2, 4, 8]: one rank, the smallest (mixed_rank_policy)
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
        assert 0.0 <= record["personalized_accuracy"] <= 1.0 and 0.0 <= record["global_accuracy"] <= 1.0
    # Assert: split quality against the injected noise is reported after the warm-up
    warm_up, split = results["rounds"]
    assert warm_up["extra"]["noise_split"] == "warm-up"
    assert 0.0 <= split["extra"]["noise_recall"] <= 1.0
    assert split["extra"]["noise_true_rate"] == pytest.approx(0.4, abs=0.02)
    assert set(split["extra"]["noise_split_per_client"]) == {"0", "1", "2"}
    assert all((tmp_path / f"adapters/client_{k}/adapter_config.json").is_file() for k in range(3))


@pytest.mark.slow
def test_ray_noisy_smoke_run(tmp_path: Path) -> None:
    # Execute: the CLI on Flower's simulation engine
    proc = fedlora_run(tmp_path, *NOISY_SMOKE, *ONE_RANK)
    # Assert
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["strategy"] == "feddr_lora" and len(results["rounds"]) == 2
    assert all(r["bytes_up"] == 3 * (4 * B_BYTES_PER_RANK + HEAD_BYTES) for r in results["rounds"])
    assert "noise_precision" in results["rounds"][1]["extra"]
