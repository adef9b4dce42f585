"""fedlora's Flower ServerApp: runs the configured strategy and writes the results contract.

The same app runs in simulation (:func:`fedlora.app.runner.run` builds it with the config in a
closure, since Flower's simulation runtime hands the ServerApp an empty run config) and in deployment
(``flwr run`` passes the config as the run-config entry ``experiment``, JSON, or ``config``, a
TOML path readable on the server, with overrides: ``set`` items and Flower-style dotted keys such as
``train.rounds=5``). Under Flower's runtime (``flwr run``, a deployment) the ServerApp writes its
round lines and a fedlora error through Flower's logger, which is what ``flwr log`` shows.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedlora import protocol
from fedlora.app.progress import RoundProgress
from fedlora.app.run_config import config_from_run_config, node_binding, run_app_dir
from fedlora.app.tracking import Tracker
from fedlora.config import ExperimentConfig
from fedlora.evaluation import GlobalEvaluator
from fedlora.results import ResultsWriter, RoundRecord
from fedlora.strategies.roster import wait_for_nodes

logger = logging.getLogger("fedlora")
flower_log = logging.getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` shows


# results.json strategy_info: who measured the round's global accuracy (ROUGE-L): "server" (the
# strategy's global model on the global test set) or "clients" (a method without a global model:
# each client's own model on it, as the clients reported it; the server cannot check that number)
GLOBAL_ACCURACY_FROM = "global_accuracy_from"


def progress_line(record: RoundRecord, rounds: int, causal: bool = False, by_clients: bool = False) -> str:
    """One round's line; ``by_clients``: the global score is the clients' report (no global model),
    shown as ``global (clients)``."""

    def pct(x: float) -> str:
        return "  -  " if math.isnan(x) else f"{x:.3f}"

    label = "global (clients)" if by_clients else "global"

    def beside(mean: float, worst: float) -> str:  # so that one client's weight cannot set the figure alone
        return "" if math.isnan(mean) else f" (mean {pct(mean)}, worst {pct(worst)})"

    if causal:
        return (
            f"round {record.round:>3}/{rounds}  {label} ROUGE-L {pct(record.global_rouge_l)}  "
            f"ppl {pct(record.global_perplexity)}  personalised ROUGE-L {pct(record.personalized_rouge_l)}"
            f"{beside(record.personalized_rouge_l_unweighted, record.personalized_rouge_l_worst)}  "
            f"loss {pct(record.train_loss)}  up {record.bytes_up / 1e6:.2f} MB  down {record.bytes_down / 1e6:.2f} MB  "
            f"clients {record.clients} failures {record.failures}  {record.seconds:.1f}s"
        )
    return (
        f"round {record.round:>3}/{rounds}  {label} {pct(record.global_accuracy)}  "
        f"personalised {pct(record.personalized_accuracy)}"
        f"{beside(record.personalized_accuracy_unweighted, record.personalized_accuracy_worst)}  "
        f"received {pct(record.received_accuracy)}  loss {pct(record.train_loss)}  "
        f"up {record.bytes_up / 1e6:.2f} MB  down {record.bytes_down / 1e6:.2f} MB  "
        f"clients {record.clients} failures {record.failures}  {record.seconds:.1f}s"
    )


def run_server(grid: Grid, config: ExperimentConfig, out_dir: str | Path, resume: bool = False,
               client_checkpoints: bool = True, flower_logger: bool = False,
               nodes: tuple[dict[int, int], dict[int, str]] | None = None) -> ResultsWriter:
    """Query, train and evaluate for ``config.train.rounds`` rounds; write results and a
    checkpoint (fedlora.checkpoint) each round. ``resume``: continue ``out_dir``'s run after its
    last complete round. ``client_checkpoints``: tell clients to keep their state under
    ``out_dir`` (simulation: one file system), and only there between messages, so that the
    engine holds no idle client's state in memory; in a deployment each silo names its own folder
    (node config ``checkpoint-dir``) and its SuperNode keeps the state in ``context.state``.
    ``flower_logger``: the round lines (and where the results are) go through Flower's logger at
    INFO, what ``flwr log`` shows (``flwr run``, deployments), not fedlora's console. ``nodes``: a
    deployment's binding of node ids to partitions and silo names (the operator's, from the keys the
    SuperLink authenticates): a node holds its bound partition only, and a silo that cannot take
    part refuses the run before its first round (:class:`~fedlora.strategies.roster.PreflightError`);
    without it the in-process engine's own binding (its node configs), or none (Flower's engine)."""
    # first the SuperNodes, one per client: too few within federation.connect_timeout stop the run in one
    # line (fedlora.strategies.roster.MissingClientsError), before the data, the models and any output
    wait_for_nodes(grid, config.data.num_clients, config.federation.connect_timeout)
    import torch

    from fedlora import checkpoint
    from fedlora.data import build_federated_data
    from fedlora.strategies.registry import create_strategy

    def say(line: str) -> None:  # fedlora's console, or what `flwr log` shows
        if flower_logger:
            flower_log(INFO, "%s", line)
        else:
            logger.info(line)

    torch.set_num_threads(max(1, int(config.federation.num_cpus)))
    out_dir = Path(out_dir)
    federated = build_federated_data(config.data)
    evaluator = GlobalEvaluator(config.model, config.train, federated, config.output.sample_generations)
    strategy = create_strategy(config, evaluator.initial_adapter, evaluator.module_shapes())
    evaluator.init = strategy.model_init()  # before the first initial_adapter() call (setup)
    strategy.paths.adapter_dir = str((out_dir / "adapters").resolve())
    info = strategy_info(strategy)
    bind_nodes(strategy.roster, grid, nodes)
    if not client_checkpoints:  # Flower's runtime (a deployment): a silo may hold its own data, no data.source
        strategy.paths.label_names = list(federated.label_names)
    if client_checkpoints:  # simulation: every client's state lives in its checkpoint file between messages
        strategy.paths.checkpoint_dir = str((checkpoint.checkpoint_dir(out_dir) / checkpoint.CLIENTS_DIR).resolve())
        strategy.paths.state_on_disk = True
    saved = checkpoint.load_server(out_dir, config) if resume else None  # verified: files, structure, finite arrays
    strategy.connect(grid)  # this run's clients (their node ids and profiles), before any output is written
    writer = ResultsWriter(config, out_dir, strategy_info=info)
    writer.precision = evaluator.precision
    if config.model.kind != "causal_lm":  # the classes by name, as the model's head indexes them
        writer.id2label = {str(i): name for i, name in enumerate(federated.label_names)}
    first = 1
    if saved is not None:  # then the state saved by partition
        missing = sorted(set(saved["partitions"]) - set(strategy.roster.partitions))
        if missing:
            raise checkpoint.CheckpointError(f"--resume {out_dir}: clients {missing} of the checkpoint did not "
                                             f"join this run; resume with every client of the run")
        state = checkpoint.check_strategy_state(saved["strategy"], strategy.state_dict(), f"--resume {out_dir}",
                                                strategy.RETIRED_STATE)
        strategy.load_state_dict(state)
        strategy.paths.resumed_from = first = saved["round"]
        if strategy.paths.checkpoint_dir:  # states the interrupted round wrote belong to no completed round
            checkpoint.drop_client_states_after(strategy.paths.checkpoint_dir, saved["round"])
        first += 1
        writer.restore(saved["rounds"])
        writer.privacy = saved.get("privacy")
        say(f"resuming {out_dir} after round {saved['round']} of {config.train.rounds}")

    def evaluate_fn(server_round: int, _arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None
        record = strategy.finish_round(server_round)
        payload = strategy.global_payload()
        if strategy.evaluates(server_round):
            writer.strategy_info[GLOBAL_ACCURACY_FROM] = "server" if payload is not None else "clients"
            if payload is not None:
                evaluator.evaluate_into(payload, record, out_dir)
        writer.privacy = strategy.privacy_report()
        writer.add(record)
        checkpoint.save_server(out_dir, server_round, config, strategy.state_dict(), writer.rounds, writer.privacy,
                               partitions=strategy.roster.partitions)
        tracker.round(record)
        progress.round_done(server_round, progress_line(record, config.train.rounds, causal,
                                                        by_clients=payload is None))
        return MetricRecord({protocol.GLOBAL_ACCURACY: record.global_accuracy})

    tracker = Tracker(config, out_dir, first)
    causal = config.model.kind == "causal_lm"
    if causal and first == 1:  # the zero-shot reference: the initial adapter (B = 0) is the base model
        zero_shot = RoundRecord(round=0)
        started, cpu_started = time.perf_counter(), time.process_time()
        evaluator.zero_shot_into(zero_shot, out_dir)
        zero_shot.seconds = time.perf_counter() - started
        zero_shot.cpu_seconds = time.process_time() - cpu_started
        writer.add(zero_shot)
        tracker.round(zero_shot)
        say(progress_line(zero_shot, config.train.rounds, causal))
    progress = RoundProgress(config.train.rounds, first, live=False if flower_logger else None,
                             emit=say if flower_logger else None)
    ok = False
    try:
        run_rounds(strategy, grid, first, config.train.rounds, evaluate_fn)
        progress.close()
        finish(writer, strategy, evaluator, out_dir)
        ok = True
        if flower_logger:
            say(f"results: {(out_dir / 'results.json').resolve()}")
    finally:
        progress.close()
        tracker.finish(ok)
    return writer


def bind_nodes(roster: Any, grid: Grid, nodes: tuple[dict[int, int], dict[int, str]] | None) -> None:
    """Which node holds which partition: a deployment's binding (strict: a silo that cannot take part
    refuses the run), else the engine's own where it has one (the in-process engine's node configs)."""
    if nodes is not None and nodes[0]:
        roster.bind(nodes[0], nodes[1], strict=True)
        return
    engine_binding = getattr(grid, "partition_binding", None)
    if callable(engine_binding):
        roster.bind(engine_binding(), source=engine_binding)


def run_rounds(strategy: Any, grid: Grid, first: int, last: int,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]) -> None:
    """Flower's ``Strategy.start`` loop for rounds ``first``..``last`` (``start`` always begins at
    round 1; a resumed run continues at ``k + 1``): configure_train -> send_and_receive ->
    aggregate_train -> configure_evaluate -> send_and_receive -> aggregate_evaluate -> evaluate_fn,
    the arrays aggregate_train returns passed on to the next hooks as ``start`` does (the first
    round, and a resumed run, start from an empty record: the strategy's own state)."""
    from fedlora.simulations.polling import send_and_receive  # the grid's, replies seen as they arrive

    arrays, timeout = ArrayRecord(), strategy.experiment.federation.round_timeout
    if first == 1:
        strategy.summary()
    for server_round in range(first, last + 1):
        logger.debug("[ROUND %s/%s]", server_round, last)
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
        replies = send_and_receive(grid, messages, timeout)
        aggregated, _ = strategy.aggregate_train(server_round, replies)
        if aggregated is not None:
            arrays = aggregated
        messages = list(strategy.configure_evaluate(server_round, arrays, ConfigRecord(), grid))
        replies = send_and_receive(grid, messages, timeout)
        strategy.aggregate_evaluate(server_round, replies)
        evaluate_fn(server_round, arrays)


def strategy_info(strategy: Any) -> dict[str, Any]:
    caps = strategy.capabilities
    return {
        "class": type(strategy).__name__,
        "personalized": caps.personalized,
        "uploads": caps.uploads,
        "downloads": caps.downloads,
        "paper": caps.paper,
        "options": strategy.options.model_dump(mode="json"),
    }


def finish(writer: ResultsWriter, strategy: Any, evaluator: GlobalEvaluator, out_dir: Path) -> None:
    """Save the global adapter (peft format), the profiles, the accuracy plot, and every adapter's
    model card and fedlora.json (:func:`fedlora.app.adapters.write_cards`)."""
    from fedlora.app.adapters import write_cards
    from fedlora.app.plotting import plot_accuracy
    from fedlora.models import save_adapter

    payload = strategy.global_payload()
    if payload is not None and writer.config.output.save_adapters:
        labels = None if writer.config.model.kind == "causal_lm" else evaluator.federated.label_names
        save_adapter(evaluator.model_for(payload), out_dir / "adapters" / "global", labels)
    writer.strategy_info["clients"] = {str(p): profile.model_dump() for p, profile in sorted(strategy.roster.profiles.items())}
    writer.strategy_info["refused"] = list(strategy.roster.refused.values())
    writer.strategy_info.update(strategy.save_artifacts(out_dir))
    writer.write()
    results = writer.to_dict()
    plot_accuracy(results, out_dir / "accuracy_vs_round.png")
    write_cards(out_dir, results)


def make_server_app(config: ExperimentConfig | None = None, out_dir: str | None = None, resume: bool = False) -> ServerApp:
    """A ServerApp for ``config`` (fedlora's simulation: it reports errors itself) or for the run
    config (``flwr run``, deployments; run-config ``resume = true`` continues the checkpoint in the
    output folder): there a fedlora error (a bad config, too few SuperNodes, no client) is one
    ERROR line on Flower's logger (:func:`report_error`) before the run fails."""
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        if config is not None:
            run_server(grid, config, out_dir or config.output.dir, resume=resume)
            return
        try:
            cfg = config_from_run_config(dict(context.run_config), run_app_dir(grid))
            again = resume or str(context.run_config.get("resume", "")).lower() in ("1", "true")
            run_server(grid, cfg, out_dir or cfg.output.dir, resume=again, client_checkpoints=False,
                       flower_logger=True, nodes=node_binding(context.run_config))
        except user_errors() as error:
            report_error(error)
            raise

    return server_app


def user_errors() -> tuple[type[BaseException], ...]:
    """What a user can fix: a config, data or checkpoint error, and a run the strategy cannot go on
    with (too few SuperNodes, no client accepted, too many failed rounds)."""
    from fedlora.data.sources import DataError
    from fedlora.errors import ConfigError  # CheckpointError, ModelError: subclasses
    from fedlora.strategies.accounting import RoundFailedError
    from fedlora.strategies.roster import MissingClientsError, MixedRanksError, NoClientError, PreflightError

    return (ConfigError, DataError, RoundFailedError, NoClientError, MixedRanksError, MissingClientsError,
            PreflightError)


REPORTED = "fedlora_reported"  # set on an exception report_error has logged


class ReportedErrorFilter(logging.Filter):
    """On Flower's logger, once :func:`report_error` has logged: drops Flower's own report of that
    error (the "ServerApp / Simulation raised an exception" traceback, then its "Exit Code" notice),
    so that ``flwr log`` shows it as fedlora's one line. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and getattr(error, REPORTED, False):
            return False
        return not str(record.msg).startswith("Exit Code:")


def report_error(error: BaseException) -> None:
    """``error`` as one ERROR line on Flower's logger; Flower's traceback of it is dropped from then
    on (:class:`ReportedErrorFilter`); the run still ends as failed, with the message as its details."""
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, ReportedErrorFilter) for f in flower.filters):
        flower.addFilter(ReportedErrorFilter())
    setattr(error, REPORTED, True)
    flower_log(ERROR, "fedlora: error: %s", " ".join(str(error).split()) or type(error).__name__)


app = make_server_app()
