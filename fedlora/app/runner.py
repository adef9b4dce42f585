"""Run an experiment on Flower's simulation engine (Ray backend): ``fedlora.run(config)``.

Each client is a virtual SuperNode running ``fedlora.clients.app:app`` with ``num_cpus`` /
``num_gpus`` from ``[federation]``; the ServerApp is built in a closure that carries the config.
Ray's temporary folder and ``FLWR_HOME`` live inside the run directory (or a short folder
under /tmp when the run directory's path is too long for Ray's socket names).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from fedlora.app.folders import Claim, claim, same_folder
from fedlora.app.quiet import LOG_FILE, output, run_log
from fedlora.config import ConfigError, ExperimentConfig, apply_overrides, build_config, load_config
from fedlora.results import ResultsWriter, RunResults
from fedlora.schema import ConfigSource, Settings, overrides_from

logger = logging.getLogger("fedlora")

CLIENT_APP = "fedlora.clients.app:app"
MAX_RAY_DIR = 42  # Ray appends up to 64 characters (/session_<date>_<time>_<us>_<pid>/sockets/plasma_store); AF_UNIX allows 107


class RunError(RuntimeError):
    """A run that could not produce meaningful results (printed as one line by the CLI)."""


def prepare_environment(out_dir: Path) -> None:
    """Telemetry off, no runtime dependency install, a project-local FLWR_HOME, and Ray's workers
    (the clients: the run's actual work) at normal priority.

    Ray starts its workers at ``nice 15`` unless ``RAY_worker_niceness`` says otherwise; on a
    machine with any other load they then barely run (a 24 s smoke run took 308 s next to four
    busy processes, 63 s at ``nice 0``). Set ``RAY_worker_niceness`` yourself to keep Ray's
    choice or pick another; fedlora only fills it in when it is unset."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    os.environ.setdefault("FLWR_HOME", str((out_dir / ".flwr").resolve()))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ray_temp_dir(out_dir: Path) -> str:
    candidate = (out_dir / ".ray").resolve()
    if len(str(candidate)) <= MAX_RAY_DIR:
        candidate.mkdir(parents=True, exist_ok=True)
        return str(candidate)
    return tempfile.mkdtemp(prefix="fedlora-ray-")


def backend_config(config: ExperimentConfig, out_dir: Path) -> dict[str, Any]:
    """Flower's Ray backend: per-client resources, and either a local Ray (its temp folder in the
    run folder) or the running cluster at ``federation.ray_address`` (which owns its resources)."""
    fed = config.federation
    init_args: dict[str, Any] = {"log_to_driver": True, "logging_level": logging.WARNING}
    if fed.ray_address:
        init_args["address"] = fed.ray_address
    else:
        init_args |= {"_temp_dir": ray_temp_dir(out_dir), "num_cpus": os.cpu_count() or 1, "include_dashboard": False}
    return {"client_resources": {"num_cpus": fed.num_cpus, "num_gpus": fed.num_gpus}, "init_args": init_args}


def check_ray_resources(config: ExperimentConfig) -> None:
    """``federation.num_gpus`` a local Ray cannot give: a GPU fraction per simulated client on a
    machine where torch sees no CUDA GPU, or more GPUs per client than it has. Ray would start and
    place no client at all (Flower's "ActorPool is empty" after the engine started); a cluster at
    ``federation.ray_address`` owns its resources and is not checked here."""
    fed = config.federation
    if fed.num_gpus <= 0 or fed.ray_address:
        return
    import torch

    gpus = torch.cuda.device_count()
    if fed.num_gpus > gpus:
        have = "no CUDA GPU" if gpus == 0 else f"{gpus} CUDA GPU{'s' if gpus > 1 else ''}"
        raise ConfigError(f"federation.num_gpus = {fed.num_gpus:g} asks each simulated client for that much of a GPU, "
                          f"but this machine has {have}; set federation.num_gpus = 0 (CPU) or at most {gpus}, or "
                          "run on a Ray cluster with GPUs (--ray-address)")


def resolve(config: ConfigSource, overrides: Settings = None) -> ExperimentConfig:
    """Accept a config object, a TOML path or a mapping of sections (notebooks), apply overrides
    (strings or a mapping); the caller's object is never changed."""
    settings = overrides_from(overrides)
    if isinstance(config, ExperimentConfig):
        if not settings:
            return config
        config = config.model_dump(mode="json")
    if isinstance(config, Mapping):
        return build_config(apply_overrides(copy.deepcopy(dict(config)), settings))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config must be an ExperimentConfig, a TOML file's path or a mapping of its sections, got "
                          f"{type(config).__name__}")
    return load_config(Path(config), settings)


def check_inputs(config: ExperimentConfig, resume: Path | None = None) -> None:
    """Fail fast, before Ray starts and before anything is written: a missing, corrupt or tampered
    checkpoint of another config in ``resume`` (the run to continue), a missing model, unreadable
    data, target modules the backbone does not have, ranks or a ``max_length`` it cannot take, a
    tracking backend that is not installed or a folder of its that cannot be written."""
    from fedlora.app.tracking import check_tracking
    from fedlora.data import build_federated_data
    from fedlora.models import check_model

    if resume is not None:
        from fedlora.checkpoint import load_server
        from fedlora.strategies.registry import strategy_class

        strategy_class(config.strategy.name)  # imports the strategies: their state types decode
        load_server(resume, config)
    federated = build_federated_data(config.data)
    check_model(config.model, config.train, config.clients, len(federated.label_names))
    check_tracking(config, Path(config.output.dir))


@contextlib.contextmanager
def run_folder(out: Path, fresh: bool = True) -> Iterator[None]:
    """Create ``out`` for a run; if the run fails before writing any results, remove what this
    run created: the folder, or (an empty folder that existed) its new contents. A resumed run
    (``fresh`` False) and any results already written are kept."""
    existed = out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if fresh and not (out / "results.json").is_file():
            if existed:
                for entry in out.iterdir():
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink(missing_ok=True)
            else:
                shutil.rmtree(out, ignore_errors=True)
        raise


def protocol_errors() -> tuple[type[BaseException], ...]:
    """What a strategy raises for a run that cannot go on (printed as one line by the CLI)."""
    from fedlora.strategies.accounting import RoundFailedError
    from fedlora.strategies.roster import MissingClientsError, MixedRanksError, NoClientError

    return (RoundFailedError, NoClientError, MixedRanksError, MissingClientsError)


def run(
    config: ConfigSource,
    overrides: Settings = None,
    out_dir: str | os.PathLike[str] | None = None,
    verbose: bool = False,
    resume: str | os.PathLike[str] | None = None,
    engine: Literal["ray", "inprocess"] = "ray",
    overwrite: bool = False,
) -> RunResults:
    """Run one experiment in Flower's simulation engine and return its results
    (:class:`~fedlora.results.RunResults`: the results.json dict, with its per-round and
    per-client tables as pandas frames).

    ``out_dir`` (default ``output.dir``) must be new or empty (:mod:`fedlora.app.folders`):
    ``resume``: the output folder of an interrupted run; continue it after its last complete
    round (same config; ``train.rounds`` may grow); ``overwrite``: move an earlier run in
    ``out_dir`` aside (``DIR.old-<time>``, never deleted) and start afresh. ``engine``: ``ray``
    (Flower's simulation engine) or ``inprocess`` (the same apps in this process,
    simulations/inprocess.py). Every check (config, folder, checkpoint, model, data) runs before
    anything is created or moved. Quiet unless ``verbose`` (fedlora.app.quiet): one line per
    round, then the final scores and where the results are; everything else goes to
    ``<out>/run.log``."""
    config = resolve(config, overrides)
    if resume and out_dir and not same_folder(Path(resume), Path(out_dir)):
        raise ConfigError(f"--resume {resume} continues the run in {resume} and writes there, but --out names "
                          f"{out_dir}: drop --out, or copy {resume} to {out_dir} first and --resume {out_dir}")
    out = Path(resume or out_dir or config.output.dir)
    folder = claim(out, what="run", resume=bool(resume), overwrite=overwrite, resume_hint=f"--resume {out}")
    with output(verbose):
        results = execute(config, out, resume=bool(resume), engine=engine, verbose=verbose, folder=folder)
        for line in final_lines(results):
            logger.info(line)
    return RunResults(results, out)


def execute(config: ExperimentConfig, out: Path, *, resume: bool = False, engine: str = "ray", verbose: bool = False,
            folder: Claim | None = None) -> dict[str, Any]:
    """Run the resolved ``config`` into the folder ``out`` on ``engine`` and return its results dict:
    the one path every run takes (:func:`run`, and each run of a comparison or tuning,
    :func:`fedlora.app.jobs.run_jobs`). The caller has claimed ``out`` (``folder``: its claim, taken
    here once the checks passed; a comparison claims its whole folder and passes none). ``resume``:
    continue the checkpointed run in ``out`` (checked first: a missing, corrupt or tampered
    checkpoint or another config is one line). Everything logged goes to ``out/run.log`` too; a
    run that fails before writing results leaves no folder behind (:func:`run_folder`)."""
    config.output.dir = str(out)
    if engine != "inprocess":
        check_ray_resources(config)
    check_inputs(config, out if resume else None)
    if folder is not None:
        folder.take()
    with run_folder(out, fresh=not resume), run_log(out / LOG_FILE):
        prepare_environment(out)
        if engine == "inprocess":
            return _run_inprocess(config, out, resume, verbose)
        return _run_ray(config, out, resume, verbose)


def final_scores(results: dict[str, Any]) -> str:
    """The final scores: accuracy, or for a causal LM ROUGE-L (against round 0, zero-shot)."""
    final = results["final"]

    def beside(key: str) -> str:  # the unweighted mean and the worst client beside the weighted figure
        mean, worst = final.get(f"{key}_unweighted"), final.get(f"{key}_worst")
        return "" if mean is None else f" (mean {_fmt(mean)}, worst {_fmt(worst)})"

    # a method without a global model: the global score is the clients' report (fedlora.app.server)
    by = " (clients)" if results.get("strategy_info", {}).get("global_accuracy_from") == "clients" else ""
    if results["config"]["model"].get("kind") == "causal_lm":
        zero_shot = results["rounds"][0].get("global_rouge_l") if results["rounds"] else None
        return (f"final global{by} ROUGE-L {_fmt(final.get('global_rouge_l'))} (zero-shot {_fmt(zero_shot)}), "
                f"personalised {_fmt(final.get('personalized_rouge_l'))}{beside('personalized_rouge_l')}, "
                f"perplexity {_fmt(final.get('global_perplexity'))}")
    return (f"final global{by} accuracy {_fmt(final.get('global_accuracy'))}, personalised "
            f"{_fmt(final.get('personalized_accuracy'))}{beside('personalized_accuracy')}")


def final_lines(results: dict[str, Any]) -> list[str]:
    """What a finished run says: its final scores, bytes and time; where its files are."""
    out = results["config"]["output"]["dir"]
    return [
        f"{final_scores(results)}, {results['final'].get('bytes_total', 0) / 1e6:.2f} MB in {results['wall_seconds']:.0f}s",
        f"results: {out}/ (results.json, accuracy_vs_round.png, {LOG_FILE})",
    ]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _run_ray(config: ExperimentConfig, out: Path, resume: bool, verbose: bool) -> dict[str, Any]:
    """Flower's simulation engine (Ray) on ``config``; its results dict.

    Through Flower's public ``flwr.simulation.run_simulation`` with the app objects. Flower 1.39
    deprecates it (one warning in Flower's log, so in the run's log file) in favour of ``flwr run``
    against a SuperLink, which takes the apps by name and the settings from the SuperLink's
    federation config only (no Ray cluster address, no temp folder, no config object); the
    function itself calls the same runtime entry as that path. It starts Ray itself first
    (Flower's backend then uses it and shuts it down): the worker setup hook carries fedlora's
    quiet console into every actor (fedlora.app.quiet)."""
    from flwr.simulation import run_simulation

    from fedlora.app.server import make_server_app
    from fedlora.results import load_results
    from fedlora.simulations.polling import polling_pending_nodes

    module, attr = CLIENT_APP.split(":")
    client_app = getattr(importlib.import_module(module), attr)
    backend = backend_config(config, out)
    start_ray(backend["init_args"], out / LOG_FILE, verbose, config.federation.ray_start_timeout)
    try:
        with polling_pending_nodes():  # Flower's engine sweeps only the nodes with a message waiting
            run_simulation(
                server_app=make_server_app(config, str(out), resume=bool(resume)),
                client_app=client_app,
                num_supernodes=config.data.num_clients,
                backend_config=backend,
                verbose_logging=verbose,
            )
    except RuntimeError as error:  # Flower wraps the ServerApp's exception: report its cause
        raise RunError(f"{root_cause(error)}{results_so_far(out)}") from None
    finally:
        stop_ray()
    results_path = out / "results.json"
    if not results_path.is_file():
        raise RunError(f"the simulation ended without writing {results_path}; rerun with --verbose")
    results = load_results(results_path)
    if not any(r["clients"] for r in results["rounds"]):
        raise RunError("every client update failed in every round; rerun with --verbose to see the client errors")
    return results


def start_ray(init_args: dict[str, Any], log_path: Path, verbose: bool, start_timeout: float = 300.0) -> None:
    """``ray.init`` as Flower's Ray backend would call it (its PYTHONPATH in the job's runtime
    environment, no dashboard), plus fedlora's worker setup hook (fedlora.app.quiet). A local Ray
    gets ``start_timeout`` seconds and a second attempt to start (``federation.ray_start_timeout``,
    :mod:`fedlora.app.ray_start`); one that does not start is a one-line :class:`RunError`."""
    import ray

    from fedlora.app.quiet import ray_runtime_env
    from fedlora.app.ray_start import RayStartError, start_local_ray

    pythonpath = os.pathsep.join(sys.path)  # the workers import this driver's modules (fedlora.clients.app)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"

    def init() -> None:
        ray.init(runtime_env=ray_runtime_env(log_path, verbose, {"PYTHONPATH": pythonpath}),
                 **{"include_dashboard": False, **init_args})

    if "address" in init_args or ray.is_initialized():  # a running cluster, or a Ray this process started
        init()  # itself (ray.init refuses it as before): nothing of ours to start, retry or clean up
        return
    try:
        start_local_ray(init, start_timeout)
    except RayStartError as error:
        raise RunError(str(error)) from None


def stop_ray() -> None:
    """Shut Ray down if it is still up (Flower's backend stops it when it got that far)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def run_inprocess(config: ExperimentConfig, out_dir: str | Path, configs: list[dict[str, Any]] | None = None,
                  resume: bool = False) -> ResultsWriter:
    """Run the real ServerApp logic against in-process ClientApps (simulations/inprocess.py, no
    Ray); returns the ResultsWriter (``resume``: continue the checkpointed run in ``out_dir``)."""
    from fedlora.app.server import run_server
    from fedlora.clients.app import app as client_app
    from fedlora.simulations.inprocess import InProcessGrid, node_configs

    grid = InProcessGrid(client_app, configs or node_configs(config.data.num_clients))
    return run_server(grid, config, out_dir, resume=resume)


def _run_inprocess(config: ExperimentConfig, out: Path, resume: bool, verbose: bool) -> dict[str, Any]:
    from fedlora.results import load_results

    try:
        writer = run_inprocess(config, out, resume=resume)
    except protocol_errors() as error:
        raise RunError(f"{error}{results_so_far(out)}") from None
    if not any(r.clients for r in writer.rounds):
        raise RunError("every client update failed in every round; rerun with --verbose to see the client errors")
    return load_results(out / "results.json")


def results_so_far(out: Path) -> str:
    """' (results so far: OUT/results.json)' when some rounds were written, else ''."""
    path = out / "results.json"
    return f" (results so far: {path})" if path.is_file() else ""


def root_cause(error: BaseException) -> str:
    """The innermost exception of a chain, as one line."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def quiet_flower(verbose: bool) -> None:
    """Flower logs every message at INFO; keep our progress lines readable unless verbose (for
    callers outside :func:`fedlora.app.quiet.output`, e.g. benchmarks/scale.py)."""
    if not verbose:
        logging.getLogger("flwr").setLevel(logging.WARNING)
