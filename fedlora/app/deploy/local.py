"""``fedlora deploy local``: run experiments on a fresh local federation, from the input checks to their results.

What it does, in order (Flower 1.39; docs/deployment.md, "Flower 1.39 behaviour", has the details):

1. checks the output folder, the inputs and, with ``resume``, the checkpoints before any process starts;
2. certificates (``fedlora.app.deploy.certs``) in ``DIR/certs`` unless ``insecure``;
3. ``flower-superlink`` with TLS and SuperNode authentication, the Fleet API (gRPC) on an
   explicit 127.0.0.1 port, the Control API on another, runtime dependency install disabled;
4. ``flwr supernode register`` for every SuperNode public key (Control API);
5. N ``flower-supernode`` processes, each with its own node config (``partition-id``,
   ``num-partitions``, ``rank``, ``budget-*`` from the experiment's ``[clients]``);
6. ``flwr run <repo> fedlora-local --run-config DIR/run_config.toml``: the ServerApp gets the
   resolved experiment (JSON) with ``output.dir = DIR`` and writes ``DIR/results.json``;
7. waits until the run is finished, then stops every process it started (process groups, then
   any descendant left), also on an error, Ctrl-C or SIGTERM (then within seconds: SIGTERM to
   all at once, SIGKILL after ``processes.INTERRUPT_GRACE``; the rounds written are kept);
   writes ``DIR/deployment.json``.

Steps 2-6 are :class:`fedlora.app.deploy.federation.LocalDeployment`'s, which drives Flower's
commands through :mod:`fedlora.app.deploy.flwr_cli` and supervises their processes with
:mod:`fedlora.app.deploy.processes`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedlora import protocol
from fedlora.app.deploy.federation import LocalDeployment
from fedlora.app.deploy.flwr_cli import HOST, DeployError
from fedlora.app.deploy.processes import terminate_on_signals
from fedlora.config import ConfigError, ExperimentConfig

logger = logging.getLogger("fedlora")


def node_configs(config: ExperimentConfig, num_nodes: int) -> list[dict[str, Any]]:
    """Each SuperNode's node config: what a silo declares (partition, rank, budgets).

    Label noise is not declared: it is part of the experiment (``[data]``) the client receives.
    """
    from fedlora.profile import configured_budgets, configured_rank

    configs = []
    for partition_id in range(num_nodes):
        values: dict[str, Any] = {
            protocol.NODE_PARTITION_ID: partition_id,
            protocol.NODE_NUM_PARTITIONS: num_nodes,
            protocol.NODE_RANK: configured_rank(config.clients, config.model.lora_rank, partition_id, num_nodes),
        }
        budgets = configured_budgets(config.clients, partition_id, num_nodes)
        values |= {f"{protocol.NODE_BUDGET_PREFIX}{key}": float(value) for key, value in budgets.items()}
        configs.append(values)
    return configs


def app_dir() -> Path:
    """The repository root: its pyproject.toml declares the Flower app (server + client)."""
    root = Path(__file__).resolve().parents[3]  # fedlora/app/deploy/local.py -> the repository
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or "[tool.flwr.app.components]" not in pyproject.read_text(encoding="utf-8"):
        raise ConfigError(
            f"fedlora's Flower app not found at {root} (pyproject.toml with [tool.flwr.app.components]); "
            "install fedlora editable from its repository: pip install -e ."
        )
    return root


def write_run_config(config: ExperimentConfig, path: Path, resume: bool = False,
                     nodes: dict[str, dict[str, Any]] | None = None) -> Path:
    """A ``--run-config`` file: ``experiment`` holds the resolved config (JSON); ``resume = true``
    continues the checkpoint in its output folder; ``nodes`` binds node ids to partitions
    (``{"<node id>": {"partition": k, "silo": "name"}}``, fedlora.app.run_config.node_binding)."""
    # JSON string escapes (\" \\ \n \uXXXX) are valid TOML basic-string escapes.
    text = f"experiment = {json.dumps(config.to_json())}\nresume = {str(resume).lower()}\n"
    if nodes:
        text += f"nodes = {json.dumps(json.dumps(nodes))}\n"
    path.write_text(text, encoding="utf-8")
    return path


FEDERATION_FILES = ("certs", "flwr", "logs", "deployment.json")  # + run_config*.toml: one federation's records


def earlier_federation_aside(out: Path) -> Path | None:
    """Move what an earlier federation left in ``out`` (certificates, Flower homes, logs, run
    records; not the runs' results and checkpoints) into ``out/deployment.old-<time>/``, so that a
    new federation can start there and nothing of the old one is lost; that folder (None: nothing)."""
    import time as time_module

    from fedlora.app.folders import OLD_SUFFIX

    entries = [out / name for name in FEDERATION_FILES if (out / name).exists()]
    entries += sorted(out.glob("run_config*.toml")) + sorted(out.glob("*/deployment.json"))
    if not entries:
        return None
    target = out / f"deployment{OLD_SUFFIX}{time_module.strftime('%Y%m%d-%H%M%S')}"
    count = 1
    while target.exists():
        count += 1
        target = out / f"deployment{OLD_SUFFIX}{time_module.strftime('%Y%m%d-%H%M%S')}-{count}"
    for entry in entries:
        destination = target / entry.relative_to(out)
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.rename(entry, destination)
    logger.warning("--resume: the earlier federation's certificates, logs and records in %s were moved to %s",
                   out, target)
    return target


def show_progress(line: str) -> None:
    """A progress line of the ServerApp, as it arrives (a run followed one at a time): fedlora's
    console (stdout), where ``fedlora run`` prints its round lines."""
    logger.info("%s", line)


def deploy_local(
    config: ExperimentConfig | str | Path | dict,
    num_nodes: int | None = None,
    out_dir: str | Path | None = None,
    overrides: list[str] | None = None,
    insecure: bool = False,
    timeout: float = 3600.0,
    on_ready: Callable[[LocalDeployment], None] | None = None,
    overwrite: bool = False,
    resume: bool = False,
    clientapp: str = "warm",
) -> dict[str, Any]:
    """Run ``config`` on a local SuperLink + ``num_nodes`` SuperNodes; the results dict.

    ``on_ready(deployment)`` is called after the run finished, while every process is still up
    (the tests use it for probes against the live SuperLink). ``overwrite``, ``resume``,
    ``clientapp``: see :func:`deploy_runs`.
    """
    from fedlora.app.runner import resolve

    resolved = resolve(config, overrides)
    return deploy_runs({"": resolved}, num_nodes, out_dir, insecure, timeout, on_ready, overwrite=overwrite,
                       resume=resume, clientapp=clientapp)[""]


def deploy_runs(
    configs: dict[str, ExperimentConfig],
    num_nodes: int | None = None,
    out_dir: str | Path | None = None,
    insecure: bool = False,
    timeout: float = 3600.0,
    on_ready: Callable[[LocalDeployment], None] | None = None,
    side_by_side: int = 0,
    overwrite: bool = False,
    resume: bool = False,
    clientapp: str = "warm",
) -> dict[str, dict[str, Any]]:
    """Run several experiments on ONE local federation (a SuperLink and ``num_nodes`` SuperNodes
    started once), one after the other or, with ``side_by_side = K`` (K > 0), up to K at a time
    (Flower runs them concurrently: their message latencies overlap; a run is submitted once its
    predecessor's ServerApp has started, because Flower declares a task dead whose process has not
    reported within 30 s of being handed it, and many ServerApps importing at once on a small
    machine got there); label -> its results dict. Run
    ``label`` writes into ``OUT/<label>`` (``OUT`` itself for the label ''). The silos' node
    configs come from the first experiment, so the experiments must share their data and
    clients sections. ``OUT`` must be new or empty: an earlier deployment there (its results,
    certificates, logs) is refused, or with ``overwrite`` moved aside (``OUT.old-<time>``; nothing
    is deleted) once every check passed. ``resume``: continue the interrupted runs in ``OUT`` from
    their checkpoints (verified before any process starts) on a new federation; the earlier
    federation's certificates, Flower homes, logs and run records are moved into
    ``OUT/deployment.old-<time>/`` first. The silos' kept state is their own (node config
    ``checkpoint-dir``; without it a resumed silo starts from the global model it receives).
    ``clientapp``: ``'warm'`` (default) runs every SuperNode in ``--isolation process`` beside
    fedlora's SuperExec (:mod:`fedlora.app.deploy.warm`: each message's ClientApp process is forked
    from a parent that imported the heavy libraries once); ``'cold'``: Flower's own SuperExec starts
    a fresh ``flwr-clientapp`` per message."""
    if clientapp not in ("warm", "cold"):
        raise ConfigError(f"clientapp must be 'warm' or 'cold', got {clientapp!r}")
    from fedlora.app.folders import claim
    from fedlora.app.runner import check_inputs
    from fedlora.results import load_results

    first = next(iter(configs.values()))
    nodes = first.data.num_clients if num_nodes is None else num_nodes
    for label, config in configs.items():
        if nodes != config.data.num_clients:
            raise ConfigError(
                f"--nodes {nodes} differs from data.num_clients={config.data.num_clients}; every SuperNode "
                f"holds one partition: use --nodes {config.data.num_clients} or --set data.num_clients={nodes}"
                + (f" --set clients.ranks=[...] ({nodes} ranks)" if config.clients.ranks else "")
            )
        if config.data != first.data or config.clients != first.clients:
            raise ConfigError(f"run '{label}' has other [data] / [clients] than the first: one federation serves both")
    out = Path(out_dir or first.output.dir).resolve()
    claimed = claim(out, what="deployment", overwrite=overwrite, resume=resume)
    for label, config in configs.items():
        config.output.dir = str(out / label if label else out)
    app = app_dir()
    if resume:
        from fedlora.checkpoint import load_server
        from fedlora.strategies.registry import strategy_class

        for config in configs.values():
            strategy_class(config.strategy.name)  # its state types decode
            load_server(config.output.dir, config)  # a missing, corrupt or tampered checkpoint: one line
    for config in configs.values():
        check_inputs(config)  # one-line errors for a missing model or unreadable data, before any process
    claimed.take()
    if resume:
        earlier_federation_aside(out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    evidence: dict[str, dict[str, Any]] = {}
    with terminate_on_signals(), LocalDeployment(out, nodes, insecure=insecure, clientapp=clientapp,
                                                 on_progress=show_progress) as deployment:
        deployment.start_superlink()
        logger.info("SuperLink up: Control API https://%s:%d (loopback only), Fleet API %s:%d",
                    HOST, deployment.ports.control, HOST, deployment.ports.fleet)
        keys: list[Path | None] = [None] * nodes
        binding: dict[str, dict[str, Any]] = {}  # node id -> its partition: the registered keys' (TLS + auth)
        if not insecure:
            node_keys = list(deployment.require_certs().node_keys)
            ids = deployment.register(node_keys)
            keys = list(node_keys)
            binding = {str(node): {"partition": k, "silo": f"supernode-{k}"} for k, node in enumerate(ids)}
        deployment.start_supernodes(node_configs(first, nodes), keys)
        logger.info("%d SuperNodes accepted; submitting %d run(s)", nodes, len(configs))
        submitted: dict[str, int] = {}
        finished: dict[str, dict[str, Any]] = {}
        for label, config in configs.items():
            run_config = write_run_config(config, out / f"run_config{'-' + label if label else ''}.toml", resume=resume,
                                          nodes=binding)
            if side_by_side:
                deployment.wait_runs(list(submitted.values()), timeout, until_running=side_by_side - 1)
            submitted[label] = deployment.submit(app, run_config)
            if not side_by_side:
                finished[label] = deployment.wait_run(submitted[label], timeout)
        if side_by_side:
            rows = deployment.wait_runs(list(submitted.values()), timeout)
            finished = {label: rows[run_id] for label, run_id in submitted.items()}
        for label, config in configs.items():
            run_id, run = submitted[label], finished[label]
            server_log = deployment.logs / f"serverapp-{run_id}.log"
            if run.get("status") != "finished:completed":
                details = " ".join(str(run.get("status-details", "")).split())
                raise DeployError(f"run {run_id} ({label or config.strategy.name}) ended {run.get('status')}: "
                                  f"{details} (log: {server_log})")
            evidence[label] = {
                "run_id": run_id,
                "nodes": nodes,
                "clientapp": clientapp,
                "tls": not insecure,
                "supernode_auth": not insecure,
                "fleet_grpc_tls_logged": deployment.fleet_is_grpc_over_tls(),
                "ports": {"control": deployment.ports.control, "fleet": deployment.ports.fleet},
                "flower_run": {k: run.get(k) for k in ("status", "elapsed", "network-traffic", "compute-time")},
            }
        if on_ready is not None:
            on_ready(deployment)
    timings = {**deployment.timings, "total_seconds": round(time.monotonic() - started, 2)}
    results_by_label = {}
    for label, config in configs.items():
        folder = Path(config.output.dir)
        results_path = folder / "results.json"
        if not results_path.is_file():
            raise DeployError(f"run {evidence[label]['run_id']} finished without writing {results_path} "
                              f"(logs: {deployment.logs})")
        (folder / "deployment.json").write_text(json.dumps({**evidence[label], "timings": timings}, indent=2),
                                                encoding="utf-8")
        results = load_results(results_path)
        results["deployment"] = {**evidence[label], "timings": timings}
        results_by_label[label] = results
    return results_by_label
