"""Differential privacy: [privacy] validation, a private step really trains the adapter, the
accountant composes over rounds, and a DP run reports epsilon <= target_epsilon."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fedlora_run

from fedlora.config import ConfigError, load_config
from fedlora.privacy import epsilon_of, private_train
from fedlora.strategies.registry import strategy_class, strategy_names

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["privacy.dp=true", "privacy.noise_multiplier=-1"], "noise_multiplier"),
        (["privacy.dp=true"], "exactly one of"),
        (["privacy.dp=true", "privacy.noise_multiplier=1", "privacy.target_epsilon=3"], "exactly one of"),
        (["privacy.dp=true", "privacy.target_epsilon=0"], "target_epsilon"),
        (["privacy.dp=true", "privacy.noise_multiplier=1", "privacy.delta=1.5"], "delta"),
        (["privacy.dp=true", "privacy.noise_multiplier=1", "strategy.name=fedhera"], "not supported by strategy 'fedhera'"),
        (["privacy.dp=true", "privacy.noise_multiplier=1", "strategy.name=feddr_lora"], "not supported"),
        (["privacy.dp=true", "privacy.noise_multiplier=1", "strategy.name=feddpa"], "not supported"),
    ],
)
def test_bad_privacy_config_is_refused(overrides, message):
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=message):
        load_config(SMOKE, overrides)


@pytest.mark.e2e
def test_cli_negative_noise_multiplier_is_one_line_exit_2(tmp_path):
    # Prepare / Execute
    proc = fedlora_run(tmp_path, "privacy.dp=true", "privacy.noise_multiplier=-0.5", timeout=120)
    # Assert
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "noise_multiplier" in proc.stderr


def test_dp_compatible_strategies_train_with_the_base_step():
    # Prepare: the trainers of every strategy that declares DP support
    from fedlora.clients.trainers import trainer_class
    from fedlora.clients.trainers.base import LocalTrainer

    for name in strategy_names():
        if not strategy_class(name).capabilities.dp_compatible:
            continue
        # Execute
        trainer = trainer_class(name)
        # Assert: the private step (LocalTrainer.fit -> fit_private) is the one it trains with
        assert trainer.fit is LocalTrainer.fit, name
        assert trainer.after_backward is LocalTrainer.after_backward, name


def _tiny_setup(overrides: list[str]):
    from fedlora.backbones import load_tokenizer
    from fedlora.data import build_federated_data
    from fedlora.models import build_model
    from fedlora.training import make_loader

    cfg = load_config(SMOKE, overrides)
    federated = build_federated_data(cfg.data)
    model = build_model(cfg.model, len(federated.label_names), 4, seed=0)
    loader = make_loader(federated.client(0).train, load_tokenizer(cfg.model.path), 16, 32, shuffle=True, seed=0)
    return cfg, model, loader


@pytest.mark.e2e
def test_private_steps_change_the_adapter_and_compose_over_rounds():
    import torch
    from peft import PeftModel

    from fedlora.models import adapter_payload

    # Prepare
    cfg, model, loader = _tiny_setup(["privacy.dp=true", "privacy.noise_multiplier=1.0"])
    before = {k: v.copy() for k, v in adapter_payload(model).items()}  # not views of the parameters
    kwargs = {"privacy": cfg.privacy, "epochs": 1, "lr": 1e-2, "device": torch.device("cpu"), "rounds": 2, "max_steps": 3}

    # Execute: two "rounds", the second starting from the first's accountant history; Opacus'
    # warnings (its secure mode off, the frozen embeddings' hooks) never reach the user
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = private_train(model, loader, history=[], seed=1, **kwargs)
    after = {k: v.copy() for k, v in adapter_payload(model).items()}
    second = private_train(model, loader, history=first.history, seed=2, **kwargs)

    # Assert: every LoRA factor and the head changed; the model is a plain peft model again
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert sorted(changed) == sorted(before)
    assert isinstance(model, PeftModel)
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())
    assert first.stats.steps == 3 and sum(h[2] for h in second.history) == 6
    assert 0 < first.epsilon < second.epsilon == pytest.approx(epsilon_of(second.history, cfg.privacy.delta))


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["fedit", "fedsa_lora"])  # global; personalised (client-kept A/B)
def test_dp_run_reports_epsilon_within_target(tmp_path, strategy):
    from fedlora.app.runner import run_inprocess

    # Prepare
    target = 3.0
    cfg = load_config(SMOKE, [f"strategy.name={strategy}", "privacy.dp=true", f"privacy.target_epsilon={target}",
                              "train.rounds=2", "train.max_steps=3"])

    # Execute
    run_inprocess(cfg, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())

    # Assert: epsilon is the max over clients, within the target, and composes over the rounds
    privacy = results["privacy"]
    per_client = privacy["per_client"]
    assert len(per_client) == cfg.data.num_clients
    assert privacy["epsilon"] == max(per_client.values())
    assert 0 < privacy["epsilon"] <= target
    assert privacy["delta"] == cfg.privacy.delta
    first, last = (results["rounds"][i]["extra"]["dp_epsilon"] for i in (0, -1))
    assert all(last[k] > first[k] for k in first)
    assert results["final"]["clients"] == cfg.data.num_clients


def test_noiseless_private_step_follows_the_clipped_gradient():
    import torch

    from fedlora.models import adapter_payload

    # Prepare: no noise, so any change comes from the (clipped, per-example) gradient itself
    cfg, model, loader = _tiny_setup(["privacy.dp=true", "privacy.noise_multiplier=0"])
    before = {k: v.copy() for k, v in adapter_payload(model).items()}

    # Execute
    result = private_train(model, loader, privacy=cfg.privacy, epochs=1, lr=1e-2, device=torch.device("cpu"),
                           rounds=1, history=[], seed=0, max_steps=1)
    after = adapter_payload(model)

    # Assert: B (zero at init, so only the gradient moves it) and the head were updated
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert {k for k in before if k.endswith("::B")} <= moved
    assert any(k.startswith("head::") for k in moved)
    assert result.noise_multiplier == 0.0 and result.stats.steps == 1


# ------------------------------------------------------------------------------ noise the server cannot replay
def _private_adapter(seed: int | None) -> dict[str, np.ndarray]:
    """The adapter after 3 private steps from the same seeded model and data (only ``seed`` varies)."""
    import torch

    from fedlora.models import adapter_payload

    cfg, model, loader = _tiny_setup(["privacy.dp=true", "privacy.noise_multiplier=1.0"])
    private_train(model, loader, privacy=cfg.privacy, epochs=1, lr=1e-2, device=torch.device("cpu"), rounds=1,
                  history=[], seed=seed, max_steps=3)
    return adapter_payload(model)


@pytest.mark.e2e
def test_default_noise_differs_between_identical_runs_and_the_opt_in_repeats_it() -> None:
    # Execute: two default (OS-entropy) calls, two calls with the same research seed
    fresh = [_private_adapter(None) for _ in range(2)]
    replayed = [_private_adapter(11) for _ in range(2)]
    # Assert
    assert any(not np.array_equal(fresh[0][k], fresh[1][k]) for k in fresh[0])
    assert all(np.array_equal(replayed[0][k], replayed[1][k]) for k in replayed[0])


@pytest.mark.parametrize("reproducible", [False, True])
def test_the_client_derives_no_seed_from_the_config_unless_asked(monkeypatch, reproducible: bool) -> None:
    from flwr.app import RecordDict

    import fedlora.privacy
    from fedlora.clients.trainers import trainer_class
    from fedlora.clients.trainers.base import ClientJob
    from fedlora.data import build_federated_data
    from fedlora.profile import resolve_profile

    # Prepare: capture the seed the trainer hands to private_train
    seen: list[object] = []

    def capture(*args, seed=None, **kwargs):
        seen.append(seed)
        raise RuntimeError("captured")

    monkeypatch.setattr(fedlora.privacy, "private_train", capture)
    cfg = load_config(SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1", f"privacy.reproducible_noise={str(reproducible).lower()}"])
    federated = build_federated_data(cfg.data)
    job = ClientJob(cfg, resolve_profile(cfg, {"partition-id": 1}), federated.client(1), federated, RecordDict(),
                    {"server-round": 3})
    trainer = trainer_class("fedit")(job)
    # Execute
    with pytest.raises(RuntimeError, match="captured"):
        trainer.fit(trainer.prepare({}))
    # Assert: None (OS entropy inside private_train) by default; the research seed only on request
    assert seen == [cfg.train.seed + 1000 * 3 + 1 if reproducible else None]


def test_per_example_gradients_are_clipped_to_max_grad_norm(monkeypatch) -> None:
    import torch

    import fedlora.privacy
    from fedlora.backbones import load_tokenizer
    from fedlora.training import TrainStats, make_loader

    # Prepare: a small bound, no noise; probe the DP optimiser on single-example batches
    cfg, model, _ = _tiny_setup(["privacy.dp=true", "privacy.noise_multiplier=0", "privacy.max_grad_norm=0.05"])
    singles = make_loader(_client_train(cfg), load_tokenizer(cfg.model.path), 1, 32, shuffle=False)
    observed: list[tuple[float, float]] = []
    trainable = sum(1 for p in model.parameters() if p.requires_grad)

    def probe(private_model, loader, optimizer, epochs, max_steps, loss_fn, *args, **kwargs):
        assert len(optimizer.params) == trainable  # every trainable parameter is privatised
        for index, batch in enumerate(singles):
            if index == 4:
                break
            optimizer.zero_grad(set_to_none=True)
            loss_fn(private_model, batch).backward()
            raw = torch.stack([g.reshape(len(g), -1).norm(dim=-1) for g in optimizer.grad_samples], 1).norm(dim=1)
            optimizer.clip_and_accumulate()
            clipped = torch.sqrt(sum((p.summed_grad.double() ** 2).sum() for p in optimizer.params))
            observed.append((float(raw[0]), float(clipped)))
            for p in optimizer.params:
                p.summed_grad = None
        return TrainStats(0.0, 0, 0, 0.0)

    monkeypatch.setattr(fedlora.privacy, "optimise", probe)
    # Execute
    private_train(model, _plain_loader(cfg), privacy=cfg.privacy, epochs=1, lr=1e-2, device=torch.device("cpu"),
                  rounds=1, history=[], max_steps=1)
    # Assert: every raw per-example norm was above the bound, and each clipped one is the bound
    assert len(observed) == 4
    for raw, clipped in observed:
        assert raw > 0.05
        assert clipped == pytest.approx(0.05, rel=1e-3)


def _client_train(cfg):
    from fedlora.data import build_federated_data

    return build_federated_data(cfg.data).client(0).train


def _plain_loader(cfg):
    from fedlora.backbones import load_tokenizer
    from fedlora.training import make_loader

    return make_loader(_client_train(cfg), load_tokenizer(cfg.model.path), 16, 32, shuffle=True, seed=0)


@pytest.mark.e2e
def test_the_noise_seed_appears_in_no_result_log_or_checkpoint(monkeypatch, tmp_path, caplog) -> None:
    import logging
    import secrets

    from fedlora.app.runner import run_inprocess

    # Prepare: make the OS-entropy seeds recognisable
    marker = 987654321987654321
    monkeypatch.setattr(secrets, "randbits", lambda bits: marker)
    cfg = load_config(SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1", "train.rounds=1", "train.max_steps=2"])
    # Execute
    with caplog.at_level(logging.DEBUG):
        run_inprocess(cfg, tmp_path)
    # Assert: nowhere in what the run wrote or logged; results.json says how the noise was seeded
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["privacy"]["reproducible_noise"] is False and "never sent or stored" in results["privacy"]["noise_seed"]
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()]
    assert all(str(marker).encode() not in blob for blob in written)
    assert str(marker) not in caplog.text
