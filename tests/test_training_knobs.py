"""The local step loop's knobs ([train]): gradient accumulation, the learning-rate schedule,
clipping by norm, gradient checkpointing, FedProx's term (plain and under Opacus), their refusals,
and the per-step progress; each against a hand computation or the loop without the knob."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedlora import training
from fedlora.config import ConfigError, load_config
from fedlora.training import StepOptions, cross_entropy_loss, optimise

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
LLM_SMOKE = ROOT / "configs" / "llm_smoke.toml"
CPU = torch.device("cpu")


class Probe(torch.nn.Module):
    """A linear classifier on float features carried as ``input_ids`` (no tokenizer)."""

    def __init__(self, features: int = 6, classes: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(features, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        return type("Output", (), {"logits": self.linear(input_ids.float())})()


def batches(count: int, size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randn(size, 6, generator=generator), "attention_mask": torch.ones(size, 6),
             "labels": torch.randint(0, 3, (size,), generator=generator)} for _ in range(count)]


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------- accumulation
@pytest.fixture(scope="module")
def smoke_rows() -> Any:
    from fedlora.data import build_federated_data

    return build_federated_data(load_config(SMOKE).data).client(0).train.select(range(22))


def tiny_bert() -> Any:
    """tiny-bert with LoRA and no dropout anywhere (the same forward however the batches are cut)."""
    from fedlora.models import build_model

    cfg = load_config(SMOKE, ["model.lora_dropout=0.0"])
    model = build_model(cfg.model, 8, 4, seed=0, device="cpu")
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


@pytest.mark.parametrize("max_steps", [0, 3])
def test_accumulating_k_batches_of_b_is_one_batch_of_k_times_b(smoke_rows: Any, max_steps: int) -> None:
    from fedlora.backbones import load_tokenizer
    from fedlora.training import make_loader

    # Prepare: 22 rows, batches of 3 accumulated twice vs batches of 6 (the same shuffle); plain SGD,
    # whose step scales with the gradient (Adam's would hide a gradient off by a constant)
    tokenizer = load_tokenizer("tiny-bert")
    runs = {}
    for batch, k in ((3, 2), (6, 1)):
        model = tiny_bert()
        loader = make_loader(smoke_rows, tokenizer, batch, 32, shuffle=True, seed=5)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model.train()
        # Execute
        stats = optimise(model, loader, optimizer, 2, max_steps, cross_entropy_loss, options=StepOptions(accumulation=k))
        runs[k] = (stats, weights(model))
    # Assert: the same steps (4 a pass, the last of 4 rows), losses and weights, within float error
    (accumulated, after_k), (single, after_1) = runs[2], runs[1]
    assert accumulated.steps == single.steps == (max_steps or 8)
    assert accumulated.examples == single.examples
    assert accumulated.loss == pytest.approx(single.loss, rel=1e-5)
    moved = max(float((a - b).abs().max()) for a, b in zip(after_1, weights(tiny_bert())))
    assert moved > 1e-3  # it trained
    for a, b in zip(after_k, after_1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- schedule
def lrs_of(options: StepOptions, steps: int, group_lrs: tuple[float, ...] = (0.1,)) -> list[list[float]]:
    """The learning rate of every group at every optimiser step of a loop run with ``options``."""
    model = Probe()
    groups = [{"params": [model.linear.weight], "lr": group_lrs[0]}]
    if len(group_lrs) > 1:
        groups.append({"params": [model.linear.bias], "lr": group_lrs[1]})
    optimizer = torch.optim.SGD(groups, lr=group_lrs[0])
    seen: list[list[float]] = []
    optimise(model, batches(steps), optimizer, 1, 0, cross_entropy_loss,
             after_backward=lambda _: seen.append([g["lr"] for g in optimizer.param_groups]), options=options)
    return seen


def test_linear_warmup_then_decay_by_hand() -> None:
    # Execute: 10 steps, 3 of warmup, two groups with their own rates
    seen = lrs_of(StepOptions(scheduler="linear", warmup_steps=3), 10, (0.1, 1.0))
    # Assert: transformers' linear schedule, t / 3 then (10 - t) / 7, of each group's own rate
    factors = [t / 3 if t < 3 else (10 - t) / 7 for t in range(10)]
    assert [s[0] for s in seen] == pytest.approx([0.1 * f for f in factors])
    assert [s[1] for s in seen] == pytest.approx(factors)


def test_cosine_with_a_warmup_ratio_by_hand() -> None:
    # Execute: 8 steps, warmup_ratio 0.2 -> ceil(1.6) = 2 steps
    seen = lrs_of(StepOptions(scheduler="cosine", warmup_ratio=0.2), 8)
    # Assert
    factors = [t / 2 if t < 2 else 0.5 * (1 + math.cos(math.pi * (t - 2) / 6)) for t in range(8)]
    assert [s[0] for s in seen] == pytest.approx([0.1 * f for f in factors])


def test_the_default_is_a_constant_rate_without_a_scheduler() -> None:
    assert lrs_of(StepOptions(), 5) == [[0.1]] * 5
    assert training.lr_schedule(torch.optim.SGD(Probe().parameters(), lr=0.1), StepOptions(), 5) is None


def test_the_schedule_counts_accumulated_optimiser_steps() -> None:
    # 9 batches in groups of 2: 5 optimiser steps (the last of one batch), linear with no warmup
    seen = lrs_of(StepOptions(scheduler="linear", accumulation=2), 9)
    assert [s[0] for s in seen] == pytest.approx([0.1 * (5 - t) / 5 for t in range(5)])


# --------------------------------------------------------------------------- clipping
class RecordingSGD(torch.optim.SGD):
    """SGD that notes the gradient norm it steps with."""

    norms: list[float]

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
        return super().step(closure)


@pytest.mark.parametrize("bound", [0.0, 0.05])
def test_clipping_steps_with_the_gradient_at_the_bound(bound: float) -> None:
    # Prepare
    model = Probe()
    optimizer = RecordingSGD(model.parameters(), lr=0.1)
    optimizer.norms = []
    # Execute
    optimise(model, batches(6), optimizer, 1, 0, cross_entropy_loss, options=StepOptions(max_grad_norm=bound))
    # Assert: unclipped, every norm is above 0.05; clipped, every step's norm is 0.05
    if bound:
        assert optimizer.norms == pytest.approx([bound] * 6, rel=1e-5)
    else:
        assert min(optimizer.norms) > 0.05


# --------------------------------------------------------------------------- FedProx
class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.3, -0.2], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def squared_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return 0.5 * ((model(batch["x"]) - batch["labels"]) ** 2).mean()


def regression_batches() -> list[dict[str, torch.Tensor]]:
    x = np.array([[[1.0, 2.0], [0.5, -1.0]], [[2.0, 0.0], [-1.0, 1.5]], [[0.0, 1.0], [1.0, 1.0]]])
    y = np.array([[1.0, -0.5], [0.25, 2.0], [-1.0, 0.5]])
    return [{"x": torch.tensor(xs), "labels": torch.tensor(ys)} for xs, ys in zip(x, y)]


def test_fedprox_adds_mu_times_the_drift_to_the_gradient_by_hand() -> None:
    # Prepare: least squares, three SGD steps with mu = 0.7 from w0
    model, lr, mu = Regression(), 0.1, 0.7
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # Execute
    optimise(model, regression_batches(), optimizer, 1, 0, squared_loss, options=StepOptions(proximal_mu=mu))
    # Assert: w <- w - lr (X^T (X w - y) / n + mu (w - w0)), by hand in numpy
    w0 = np.array([0.3, -0.2])
    w = w0.copy()
    for batch in regression_batches():
        x, y = batch["x"].numpy(), batch["labels"].numpy()
        w = w - lr * (x.T @ (x @ w - y) / len(y) + mu * (w - w0))
    np.testing.assert_allclose(model.w.detach().numpy(), w, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # Opacus, on a model whose inputs need no gradient
def test_fedprox_under_opacus_is_the_same_term_on_the_privatised_gradient() -> None:
    """With no noise and a bound no gradient reaches, DP-SGD's gradient is the batch mean: the
    proximal run under Opacus equals the plain proximal run, and differs from DP without it; its
    schedule runs too (the rates seen under Opacus are the linear ones)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    def run(private: bool, mu: float) -> tuple[torch.Tensor, list[float]]:
        model = Probe()
        options = StepOptions(proximal_mu=mu, scheduler="linear")
        seen: list[float] = []
        if private:
            module: Any = GradSampleModule(model)
            optimizer: Any = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.5), noise_multiplier=0.0,
                                         max_grad_norm=1e6, expected_batch_size=4)
        else:
            module, optimizer = model, torch.optim.SGD(model.parameters(), lr=0.5)

        def loss(m: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            seen.append(optimizer.param_groups[0]["lr"])
            return cross_entropy_loss(m, batch)

        optimise(module, batches(5), optimizer, 1, 0, loss, options=options)
        return model.linear.weight.detach().clone(), seen

    # Execute
    (plain, _), (dp, lrs), (dp_without, _) = run(False, 2.0), run(True, 2.0), run(True, 0.0)
    # Assert
    torch.testing.assert_close(dp, plain, rtol=1e-5, atol=1e-6)
    assert float((dp - dp_without).abs().max()) > 1e-3
    assert lrs == pytest.approx([0.5 * (5 - t) / 5 for t in range(5)])


# --------------------------------------------------------------------------- gradient checkpointing
def test_gradient_checkpointing_gives_the_same_loss_and_gradients_and_recomputes() -> None:
    from fedlora.backbones import load_tokenizer
    from fedlora.causal_lm import INSTRUCTIONS, causal_lm_loss
    from fedlora.data import build_federated_data
    from fedlora.models import build_model
    from fedlora.training import make_loader

    # Prepare: tiny-llama without dropout, one batch of three instructions; count a decoder layer's forwards
    cfg = load_config(LLM_SMOKE, ["model.lora_dropout=0.0"])
    rows = build_federated_data(cfg.data).client(0).train.select(range(3))
    batch = next(iter(make_loader(rows, load_tokenizer("tiny-llama"), 3, 64, shuffle=False, rows=INSTRUCTIONS)))
    model = build_model(cfg.model, 8, 4, seed=0, device="cpu")
    model.train()
    inner = model.get_base_model().model.layers[0].self_attn  # inside a checkpointed layer's forward
    calls = []
    inner.register_forward_hook(lambda *_: calls.append(1))
    params = [p for p in model.parameters() if p.requires_grad]
    use_cache = model.get_base_model().config.use_cache
    results = {}
    for on in (False, True):
        calls.clear()
        # Execute
        checkpointing = training.Checkpointing(model, on)
        loss = causal_lm_loss(model, batch)
        grads = torch.autograd.grad(loss, params)
        active = model.get_base_model().is_activation_checkpointing
        checkpointing.close()
        results[on] = (float(loss.detach()), grads, len(calls), active)
    # Assert: the same loss and gradients; the layer ran again in the backward pass; off afterwards
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert (results[False][2], results[True][2]) == (1, 2)
    assert results[True][3] and not model.get_base_model().is_activation_checkpointing
    assert model.get_base_model().config.use_cache == use_cache
    assert not model.get_base_model().get_input_embeddings()._forward_hooks  # its input-gradient hook removed


# --------------------------------------------------------------------------- the config
@pytest.mark.parametrize(("config", "overrides", "message"), [
    (SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1.0", "train.grad_accumulation=2"],
     "train.grad_accumulation = 2 with privacy.dp = true: DP-SGD's Poisson sampling draws each logical batch whole"),
    (SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1.0", "train.max_grad_norm=1.0"],
     "train.max_grad_norm = 1 with privacy.dp = true: DP-SGD clips every example's gradient"),
    (LLM_SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1.0", "train.gradient_checkpointing=true"],
     "train.gradient_checkpointing with privacy.dp = true"),
    (SMOKE, ["train.gradient_checkpointing=true"], "train.gradient_checkpointing is for model.kind = 'causal_lm'"),
    (SMOKE, ["train.lr_scheduler=reduce_lr_on_plateau"], "invalid config 'train.lr_scheduler'"),
    (SMOKE, ["train.warmup_ratio=1.0"], "invalid config 'train.warmup_ratio'"),
    (SMOKE, ["train.grad_accumulation=0"], "invalid config 'train.grad_accumulation'"),
])
def test_what_a_knob_cannot_do_is_refused_in_one_line(config: Path, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(config, overrides)
    assert "\n" not in str(refused.value)


def test_dp_sgd_takes_the_schedule_and_fedprox() -> None:
    config = load_config(SMOKE, ["privacy.dp=true", "privacy.noise_multiplier=1.0", "train.lr_scheduler=cosine",
                                 "train.warmup_steps=2", "train.proximal_mu=0.01"])
    assert StepOptions.of(config.train).proximal_mu == 0.01


def test_a_record_without_the_knobs_is_a_complete_run_of_the_defaults(tmp_path: Path) -> None:
    from fedlora.app.jobs import is_complete

    # Prepare: a results.json written before the knobs and [server_optimizer] existed
    config = load_config(SMOKE, ["train.rounds=2"])
    legacy = config.model_dump(mode="json")
    for key in ("grad_accumulation", "lr_scheduler", "warmup_steps", "warmup_ratio", "max_grad_norm",
                "gradient_checkpointing", "proximal_mu"):
        del legacy["train"][key]
    del legacy["server_optimizer"]
    (tmp_path / "results.json").write_text(json.dumps({"config": legacy, "rounds": [{"round": 1}, {"round": 2}]}))
    # Execute / Assert
    assert is_complete(tmp_path, config)
    assert not is_complete(tmp_path, load_config(SMOKE, ["train.rounds=2", "train.proximal_mu=0.1"]))


# --------------------------------------------------------------------------- progress
class Recorder:
    def __init__(self, label: str, total: int, log: list[tuple[str, int, list[int]]]) -> None:
        self.steps: list[int] = []
        log.append((label, total, self.steps))

    def update(self, steps: int, loss: float) -> None:
        self.steps.append(steps)

    def close(self) -> None:
        self.steps.append(-1)


@pytest.mark.e2e
def test_a_clients_steps_reach_the_progress_with_its_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedlora.app.runner import run_inprocess

    # Prepare: every step loop reports to a recorder; batches of 4 accumulated 2 at a time, 3 steps a round
    log: list[tuple[str, int, list[int]]] = []
    monkeypatch.setattr(training, "REPORTER", lambda label, total: Recorder(label, total, log))
    config = load_config(SMOKE, ["train.rounds=1", "train.batch_size=4", "train.grad_accumulation=2",
                                 "train.max_steps=3", "train.lr_scheduler=linear", "train.max_grad_norm=1.0",
                                 "train.proximal_mu=0.01", "train.precision=fp32"])
    # Execute
    run_inprocess(config, tmp_path / "run")
    # Assert: one loop per client, labelled with it and the round, 3 optimiser steps, closed
    assert sorted(label for label, _, _ in log) == ["client 0, round 1", "client 1, round 1", "client 2, round 1"]
    assert all(total == 3 and steps == [1, 2, 3, -1] for _, total, steps in log)


def test_step_progress_is_off_when_piped_and_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(training.STEP_PROGRESS_ENV, raising=False)
    assert training.step_progress_mode() == "off"  # pytest captures stderr: not a terminal
    assert isinstance(training.step_reporter("x", 3), training.SilentReporter)
    monkeypatch.setenv(training.STEP_PROGRESS_ENV, "lines")
    assert isinstance(training.step_reporter("x", 3), training.LineReporter)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.delenv(training.STEP_PROGRESS_ENV)
    assert training.step_progress_mode() == "bar"


def test_lines_say_the_step_and_the_loss_and_a_short_loop_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fedlora.steps"):
        # Execute: one loop printing at every update, one that never reaches its interval
        talkative = training.LineReporter("client 1, round 2", 5, every=0.0)
        for step in (1, 2):
            talkative.update(step, 0.5 * step)
        talkative.close()
        quiet = training.LineReporter("client 2, round 2", 5)
        quiet.update(1, 1.0)
        quiet.close()
    # Assert
    lines = [r.getMessage().rsplit(",", 1)[0] for r in caplog.records]
    assert lines == ["client 1, round 2: step 1/5, loss 0.5000", "client 1, round 2: step 2/5, loss 1.0000",
                     "client 1, round 2: step 2/5, loss 1.0000"]


def test_the_bar_draws_on_stderr_and_goes_away(capsys: pytest.CaptureFixture[str]) -> None:
    # Execute: four steps, the bar redrawn at each (tqdm otherwise redraws at most twice a second)
    bar = training.BarReporter("client 0, round 1", 4)
    bar.bar.mininterval = 0.0
    for step in range(1, 5):
        bar.update(step, 1.25)
    counted = bar.bar.n
    bar.close()
    err = capsys.readouterr().err
    # Assert: drawn with its label, steps and loss, then erased (the last thing written is blank)
    assert counted == 4
    assert "client 0, round 1" in err and "4/4" in err and "loss 1.2500" in err
    assert err.rstrip("\r").rsplit("\r", 1)[-1].strip() == ""


def test_the_live_round_bar_carries_the_step_bars_while_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from fedlora.app.progress import RoundProgress

    # Execute: a live round bar; a step loop while it runs
    progress = RoundProgress(2, live=True)
    inside = training.REPORTER
    optimise(Probe(), batches(3), torch.optim.SGD(Probe().parameters(), lr=0.1), 1, 0, cross_entropy_loss,
             options=StepOptions(label="client 7, round 1"))
    steps_task_gone = len(progress._bar.tasks) == 1
    progress.close()
    # Assert: the step loop went to the round bar's own tasks, removed at its end; detached after
    assert inside is not None and training.REPORTER is None and steps_task_gone


def test_ray_workers_print_lines_only_when_the_driver_is_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    from fedlora.app.quiet import QuietFilter, worker_step_progress

    monkeypatch.delenv(training.STEP_PROGRESS_ENV, raising=False)
    assert worker_step_progress() == {training.STEP_PROGRESS_ENV: "off"}  # pytest: nobody watches
    monkeypatch.setattr(training, "interactive", lambda: True)
    assert worker_step_progress() == {training.STEP_PROGRESS_ENV: "lines"}
    monkeypatch.setenv(training.STEP_PROGRESS_ENV, "off")
    assert worker_step_progress() == {training.STEP_PROGRESS_ENV: "off"}
    # a worker's quiet console shows the step lines, not its other fedlora INFO lines
    record = logging.makeLogRecord({"name": "fedlora.steps", "levelno": logging.INFO, "pathname": "x"})
    other = logging.makeLogRecord({"name": "fedlora", "levelno": logging.INFO, "pathname": "x"})
    assert QuietFilter(worker=True).filter(record) and not QuietFilter(worker=True).filter(other)
