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
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedlora.app.driver import RoundDriver
from fedlora.app.progress import RoundProgress
from fedlora.app.run_config import config_from_run_config, node_binding, run_app_dir
from fedlora.app.tracking import Tracker
from fedlora.config import ExperimentConfig
from fedlora.evaluation import GlobalEvaluator
from fedlora.results import ResultsWriter
from fedlora.strategies.messages import RunPaths
from fedlora.strategies.roster import wait_for_nodes

logger = logging.getLogger("fedlora")
flower_log = logging.getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` shows


def run_server(grid: Grid, config: ExperimentConfig, out_dir: str | Path, resume: bool = False,
               client_checkpoints: bool = True, flower_logger: bool = False,
               nodes: tuple[dict[int, int], dict[int, str]] | None = None) -> ResultsWriter:
    """Query, train and evaluate for ``config.train.rounds`` rounds; write results and a
    checkpoint (fedlora.checkpoint) each round (:class:`~fedlora.app.driver.RoundDriver`). ``resume``:
    continue ``out_dir``'s run after its last complete round. ``client_checkpoints``: tell clients
    to keep their state under ``out_dir`` (simulation: one file system), and only there between
    messages, so that the engine holds no idle client's state in memory; in a deployment each silo
    names its own folder (node config ``checkpoint-dir``) and its SuperNode keeps the state in
    ``context.state``. ``flower_logger``: the round lines (and where the results are) go through
    Flower's logger at INFO, what ``flwr log`` shows (``flwr run``, deployments), not fedlora's
    console. ``nodes``: a deployment's binding of node ids to partitions and silo names (the
    operator's, from the keys the SuperLink authenticates): a node holds its bound partition only,
    and a silo that cannot take part refuses the run before its first round
    (:class:`~fedlora.strategies.roster.PreflightError`); without it the in-process engine's own
    binding (its node configs), or none (Flower's engine)."""
    # first the SuperNodes, one per client: too few within federation.connect_timeout stop the run in one
    # line (fedlora.strategies.roster.MissingClientsError), before the data, the models and any output
    wait_for_nodes(grid, config.data.num_clients, config.federation.connect_timeout)
    import torch

    from fedlora import checkpoint
    from fedlora.data import build_federated_data
    from fedlora.strategies.registry import strategy_class

    def say(line: str) -> None:  # fedlora's console, or what `flwr log` shows
        if flower_logger:
            flower_log(INFO, "%s", line)
        else:
            logger.info(line)

    torch.set_num_threads(max(1, int(config.federation.num_cpus)))
    out_dir = Path(out_dir)
    federated = build_federated_data(config.data)
    saved = checkpoint.load_server(out_dir, config) if resume else None  # verified: files, structure, finite arrays
    paths = run_paths(out_dir, federated.label_names, client_checkpoints, saved["round"] if saved else 0)
    # the strategy builds the server's models itself (the seeded initial adapter, at its own LoRA init)
    strategy = strategy_class(config.strategy.name)(config, paths=paths)
    evaluator = GlobalEvaluator(config.model, config.train, federated, config.output.sample_generations,
                                init=strategy.model_init())
    bind_nodes(strategy.roster, grid, nodes)
    strategy.connect(grid)  # this run's clients (their node ids and profiles), before any output is written
    # a classifier's classes by name, as the model's head indexes them
    id2label = {} if config.model.kind == "causal_lm" else {str(i): n for i, n in enumerate(federated.label_names)}
    writer = ResultsWriter(config, out_dir, strategy_info=strategy_info(strategy), precision=evaluator.precision,
                           id2label=id2label)
    if saved is not None:
        restore(saved, strategy, writer, out_dir)
        say(f"resuming {out_dir} after round {saved['round']} of {config.train.rounds}")
    first = saved["round"] + 1 if saved is not None else 1
    tracker = Tracker(config, out_dir, first)
    progress = RoundProgress(config.train.rounds, first, live=False if flower_logger else None,
                             emit=say if flower_logger else None)
    RoundDriver(config, out_dir, strategy, evaluator, writer, tracker, progress, first).run(grid)
    if flower_logger:
        say(f"results: {(out_dir / 'results.json').resolve()}")
    return writer


def run_paths(out_dir: Path, label_names: list[str], client_checkpoints: bool, resumed_from: int) -> RunPaths:
    """Where the run's clients keep their files, as every message tells them: personalised adapters
    under ``out_dir/adapters``; in simulation (``client_checkpoints``) their state under the run's
    checkpoint, and only there between messages; in a deployment, where a silo may hold its own
    data and no ``data.source``, the server's class names instead. ``resumed_from``: the round a
    resumed run continues after (0: a new run)."""
    from fedlora import checkpoint

    clients_dir = (checkpoint.checkpoint_dir(out_dir) / checkpoint.CLIENTS_DIR).resolve()
    return RunPaths(adapter_dir=str((out_dir / "adapters").resolve()),
                    checkpoint_dir=str(clients_dir) if client_checkpoints else "",
                    state_on_disk=client_checkpoints, resumed_from=resumed_from,
                    label_names=() if client_checkpoints else tuple(label_names))


def restore(saved: dict[str, Any], strategy: Any, writer: ResultsWriter, out_dir: Path) -> None:
    """A resumed run: the strategy's state and the results of the checkpoint's rounds; every client
    of the checkpoint must have joined, and states the interrupted round wrote are dropped."""
    from fedlora import checkpoint

    missing = sorted(set(saved["partitions"]) - set(strategy.roster.partitions))
    if missing:
        raise checkpoint.CheckpointError(f"--resume {out_dir}: clients {missing} of the checkpoint did not "
                                         f"join this run; resume with every client of the run")
    state = checkpoint.check_strategy_state(saved["strategy"], strategy.state_dict(), f"--resume {out_dir}",
                                            strategy.RETIRED_STATE)
    strategy.load_state_dict(state)
    if strategy.paths.checkpoint_dir:  # states the interrupted round wrote belong to no completed round
        checkpoint.drop_client_states_after(strategy.paths.checkpoint_dir, saved["round"])
    writer.restore(saved["rounds"], saved.get("privacy"))


def bind_nodes(roster: Any, grid: Grid, nodes: tuple[dict[int, int], dict[int, str]] | None) -> None:
    """Which node holds which partition: a deployment's binding (strict: a silo that cannot take part
    refuses the run), else the engine's own where it has one (the in-process engine's node configs)."""
    if nodes is not None and nodes[0]:
        roster.bind(nodes[0], nodes[1], strict=True)
        return
    engine_binding = getattr(grid, "partition_binding", None)
    if callable(engine_binding):
        roster.bind(engine_binding(), source=engine_binding)


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
