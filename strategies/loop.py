"""The round loop, once: Flower's ``Strategy.start`` loop, resumable.

:func:`run_rounds` is the loop of Flower 1.39's ``Strategy.start`` (configure_train ->
send_and_receive -> aggregate_train -> configure_evaluate -> send_and_receive ->
aggregate_evaluate -> ``evaluate_fn``, the arrays ``aggregate_train`` returns passed on to the
next hooks, a :class:`~flwr.serverapp.strategy.Result` of every round's metrics), with two
differences that a resumed run needs: it runs rounds ``first``..``last`` (Flower's ``start``
always begins at round 1; a run resumed after round k continues at k + 1, from the strategy's
restored state, so from an empty ``ArrayRecord``), and who carries the messages is a parameter
(``exchange``: the grid's own ``send_and_receive`` unless the caller has a faster one for its grid,
as fedlora's ServerApp does for Flower's simulation grid). Before round 1, and only then, the
strategy's summary is logged and ``evaluate_fn`` is called for round 0, as ``start`` does.

Both callers use it: :meth:`fedlora.strategies.base.LoRAStrategy.start` (a Flower user's
ServerApp) and fedlora's ServerApp (:class:`fedlora.app.driver.RoundDriver`), whose
``evaluate_fn`` is the driver's after-round step (evaluate, record, checkpoint, track, report).
The loop speaks only Flower's public ``Strategy`` hooks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import INFO, getLogger

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

flower = getLogger("flwr")  # Flower's logger, by its name, as Flower's own start logs
log = flower.log

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]  # Flower's evaluate_fn: (round, arrays) -> metrics
Exchange = Callable[[Grid, list[Message], float | None], Iterable[Message]]  # push messages, wait for the replies


def grid_exchange(grid: Grid, messages: list[Message], timeout: float | None) -> Iterable[Message]:
    """The grid's own ``send_and_receive`` (what Flower's ``start`` calls)."""
    return grid.send_and_receive(messages=messages, timeout=timeout)


def run_rounds(strategy: Strategy, grid: Grid, first: int, last: int, *, arrays: ArrayRecord | None = None,
               timeout: float | None = 3600, train_config: ConfigRecord | None = None,
               evaluate_config: ConfigRecord | None = None, evaluate_fn: EvaluateFn | None = None,
               exchange: Exchange = grid_exchange, level: int = INFO) -> Result:
    """Rounds ``first``..``last`` of ``strategy`` on ``grid`` (see the module docstring); ``arrays``:
    what round ``first`` starts from (empty: the strategy's own state). ``level``: the level of
    Flower's lines about the rounds (fedlora's ServerApp keeps them at DEBUG: it prints its own
    line per round)."""
    arrays = ArrayRecord() if arrays is None else arrays
    train_config = ConfigRecord() if train_config is None else train_config
    evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
    result, started = Result(), time.time()
    if first == 1:
        start_round_zero(strategy, last, arrays, evaluate_fn, result, level)
    for server_round in range(first, last + 1):
        log(level, "[ROUND %s/%s]", server_round, last)
        messages = list(strategy.configure_train(server_round, arrays, train_config, grid))
        aggregated, metrics = strategy.aggregate_train(server_round, exchange(grid, messages, timeout))
        if aggregated is not None:
            result.arrays = arrays = aggregated
        if metrics is not None:
            log(level, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.train_metrics_clientapp[server_round] = metrics
        messages = list(strategy.configure_evaluate(server_round, arrays, evaluate_config, grid))
        metrics = strategy.aggregate_evaluate(server_round, exchange(grid, messages, timeout))
        if metrics is not None:
            log(level, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics
        if evaluate_fn is not None:
            evaluated = evaluate_fn(server_round, arrays)
            log(level, "\t└──> Global evaluation MetricRecord: %s", evaluated)
            if evaluated is not None:
                result.evaluate_metrics_serverapp[server_round] = evaluated
    log(level, "Strategy execution finished in %.2fs", time.time() - started)
    if flower.isEnabledFor(level):  # Flower's own summary of the run's metrics, as start logs it
        log(level, "Final results:")
        for line in str(result).splitlines():
            log(level, "\t%s", line)
    return result


def start_round_zero(strategy: Strategy, last: int, arrays: ArrayRecord, evaluate_fn: EvaluateFn | None,
                     result: Result, level: int) -> None:
    """Before round 1: the strategy's summary (Flower's logger, INFO) and ``evaluate_fn`` for round 0."""
    log(level, "Starting %s strategy:", type(strategy).__name__)
    log(level, "\t├── Number of rounds: %d", last)
    strategy.summary()
    if evaluate_fn is not None:
        evaluated = evaluate_fn(0, arrays)
        log(level, "Initial global evaluation results: %s", evaluated)
        if evaluated is not None:
            result.evaluate_metrics_serverapp[0] = evaluated
