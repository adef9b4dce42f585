"""The round loop, once (strategies/loop.py), and fedlora's driver of it (fedlora/app/driver.py).

The loop is Flower's ``Strategy.start`` loop, resumable: checked here against a Flower strategy
that only records its hooks (no model). The driver's named steps are checked on a tiny run
(the smoke config's random BERT, in process): their order after each round, and a run resumed
after round k starting at k + 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from strategy_helpers import renumber_nodes

from fedlora.config import load_config
from fedlora.strategies.loop import run_rounds

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


class HookRecorder(Strategy):
    """A Flower strategy with no clients: every hook appends what it was called with to ``calls``;
    aggregate_train returns arrays numbered by round."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.received: list[float] = []  # configure_train's arrays, as the round number they carry

    def summary(self) -> None:
        self.calls.append(("summary", 0))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self.calls.append(("configure_train", server_round))
        self.received.append(float(arrays["t"].numpy()[0]) if "t" in arrays else -1.0)
        return []

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        import numpy as np

        self.calls.append(("aggregate_train", server_round))
        return ArrayRecord({"t": Array(np.array([server_round], dtype=np.float32))}), MetricRecord({"n": server_round})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        self.calls.append(("configure_evaluate", server_round))
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        self.calls.append(("aggregate_evaluate", server_round))
        return None


def no_exchange(grid: Grid, messages: list[Message], timeout: float | None) -> list[Message]:
    return []


def test_the_loop_runs_flowers_hooks_in_order_and_starts_with_round_zero() -> None:
    # Prepare
    strategy = HookRecorder()
    evaluated: list[int] = []

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        strategy.calls.append(("evaluate_fn", server_round))
        evaluated.append(server_round)
        return MetricRecord({"round": server_round})

    # Execute
    result = run_rounds(strategy, None, 1, 2, evaluate_fn=evaluate_fn, exchange=no_exchange)  # type: ignore[arg-type]

    # Assert: Flower's start order (summary, evaluate_fn(0), then per round the four hooks and evaluate_fn)
    hooks = ["configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate", "evaluate_fn"]
    assert strategy.calls == [("summary", 0), ("evaluate_fn", 0), *[(h, t) for t in (1, 2) for h in hooks]]
    assert strategy.received == [-1.0, 1.0]  # round 1 from an empty record, round 2 from what round 1 returned
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2] and sorted(result.train_metrics_clientapp) == [1, 2]


def test_a_resumed_loop_starts_at_k_plus_one_without_round_zero() -> None:
    # Prepare
    strategy = HookRecorder()

    # Execute: resumed after round 2 of 4
    run_rounds(strategy, None, 3, 4, evaluate_fn=lambda t, a: None, exchange=no_exchange)  # type: ignore[arg-type]

    # Assert: rounds 3 and 4 only, no summary, no round 0, round 3 from the strategy's own state
    assert [t for name, t in strategy.calls if name == "configure_train"] == [3, 4]
    assert ("summary", 0) not in strategy.calls
    assert strategy.received == [-1.0, 3.0]


def test_lora_strategy_start_is_the_same_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: Flower's own start must not run; the loop records its call
    from fedlora.strategies import loop
    from fedlora.strategies.registry import create_strategy

    def flowers_start(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("LoRAStrategy.start ran Flower's own loop")

    calls: list[tuple[int, int, float | None]] = []
    monkeypatch.setattr(Strategy, "start", flowers_start)
    monkeypatch.setattr(loop, "run_rounds", lambda strategy, grid, first, last, **kw: calls.append(
        (first, last, kw["timeout"])))
    config = load_config(SMOKE)
    strategy = create_strategy(config, lambda rank: {}, {"m": (4, 4)})

    # Execute
    strategy.start(grid=None, initial_arrays=ArrayRecord(), num_rounds=2, timeout=9.0)  # type: ignore[arg-type]

    # Assert
    assert calls == [(1, 2, 9.0)]


# ------------------------------------------------------------------ the driver, on a tiny run
class Crash(Exception):
    """Stands in for the server process dying."""


def recording_grid(config: Any, events: list[str], id_offset: int, crash_round: int = 0) -> Any:
    """An in-process grid of the smoke clients that appends 'train t' / 'evaluate t' to ``events``
    when a round's messages go out (and raises :class:`Crash` at ``crash_round``'s training)."""

    from fedlora.clients.app import app as client_app
    from fedlora.simulations.inprocess import InProcessGrid, node_configs

    class RecordingGrid(InProcessGrid):
        def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
            messages = list(messages)
            kinds = {m.metadata.message_type for m in messages}
            if messages and kinds <= {MessageType.TRAIN, MessageType.EVALUATE}:  # not a profile query
                (server_round,) = {int(m.content["config"]["server-round"]) for m in messages}
                if kinds == {MessageType.TRAIN} and server_round == crash_round:
                    raise Crash(crash_round)
                events.append(f"{'train' if MessageType.TRAIN in kinds else 'evaluate'} {server_round}")
            return super().send_and_receive(messages, timeout=timeout)

    return renumber_nodes(RecordingGrid(client_app, node_configs(config.data.num_clients)), id_offset)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """fedlora's ServerApp with a driver whose every named step appends its name (and round) to the list."""
    from fedlora.app import driver, server

    events: list[str] = []

    class RecordingDriver(driver.RoundDriver):
        def run(self, grid: Grid) -> None:
            events.append(f"run from {self.first}")
            super().run(grid)

        def zero_shot(self) -> None:
            events.append("zero_shot")
            super().zero_shot()

        def evaluate(self, server_round: int, record: Any) -> bool:
            events.append(f"evaluate {server_round}")
            return super().evaluate(server_round, record)

        def record(self, record: Any) -> None:
            events.append(f"record {record.round}")
            super().record(record)

        def checkpoint(self, server_round: int) -> None:
            events.append(f"checkpoint {server_round}")
            super().checkpoint(server_round)

        def track(self, record: Any) -> None:
            events.append(f"track {record.round}")
            super().track(record)

        def report(self, record: Any, by_clients: bool) -> None:
            events.append(f"report {record.round}")
            super().report(record, by_clients)

        def finish(self) -> None:
            events.append("finish")
            super().finish()

    monkeypatch.setattr(server, "RoundDriver", RecordingDriver)
    return events


STEPS = ["evaluate", "record", "checkpoint", "track", "report"]


@pytest.mark.e2e
def test_the_drivers_steps_follow_each_round_in_order_and_a_resume_starts_at_k_plus_one(
        tmp_path: Path, recorded: list[str]) -> None:
    from fedlora.app.server import run_server

    # Prepare: 3 rounds of the smoke federation, one training step each; the first try dies when
    # round 3's training goes out (after round 2's checkpoint)
    config = load_config(SMOKE, ["train.rounds=3", "train.max_steps=1", "output.save_adapters=false",
                                 "output.tensorboard=false"])
    out = tmp_path / "run"
    with pytest.raises(Crash):
        run_server(recording_grid(config, recorded, 1000, crash_round=3), config, out)
    first_try = list(recorded)
    recorded.clear()

    # Execute: resume with new node ids
    writer = run_server(recording_grid(config, recorded, 5000), config, out, resume=True)

    # Assert: round 0 before round 1, then per round the strategy's messages and the driver's
    # steps in order; no finish for the run that died
    per_round = [[f"train {t}", f"evaluate {t}", *[f"{step} {t}" for step in STEPS]] for t in (1, 2)]
    assert first_try == ["run from 1", "zero_shot", *per_round[0], *per_round[1]]
    # the resumed run starts at round 3, from the checkpoint of round 2: no round 0, no round 1 or 2 again
    assert recorded == ["run from 3", "train 3", "evaluate 3", *[f"{step} 3" for step in STEPS], "finish"]
    assert [r.round for r in writer.rounds] == [1, 2, 3]
    results = json.loads((out / "results.json").read_text())
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
