"""The running half of a comparison: a list of :class:`Job` into ``OUT/<label>/seed<k>/``.

:func:`run_jobs` builds and checks every job's config first (:func:`job_config`: the base config, the
job's overrides, its seed), then runs each job that is not already complete (:func:`is_complete`)
through the runner's one path (:func:`fedlora.app.runner.execute`) on the chosen engine: Flower's
simulation engine (``ray``) or the same apps in process (``inprocess``), one job at a time or, in
process, ``workers`` at a time in fresh processes. An interrupted job resumes from its checkpoint;
a folder that cannot be resumed is moved aside (:func:`resumable`). ``fedlora compare``
(:mod:`fedlora.app.compare`), ``fedlora tune`` and the benchmarks build on it; the tables are
:mod:`fedlora.app.summary`.

Same partitions by default: a job's seed overrides ``train.seed`` (LoRA init, batch order, client
sampling) only; ``data.seed`` stays the config's, so every strategy and every seed trains on
identical client partitions, validation / test splits and global test set. A job with
``fresh_partition`` also sets ``data.seed = <config's data.seed> + seed``: every label of one seed
still shares that seed's partition, so differences stay paired. Strategy options in the base
config's ``[strategy]`` section are kept for a strategy only when its options model declares them;
per-strategy options go into a job's ``overrides``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fedlora.app.runs import SEED_DIR_PREFIX
from fedlora.schema import ConfigSource, Settings, comparable_config

if TYPE_CHECKING:
    from concurrent.futures import ProcessPoolExecutor

    from fedlora.app.folders import Claim
    from fedlora.config import ExperimentConfig

logger = logging.getLogger("fedlora")

Engine = Literal["ray", "inprocess"]
ENGINES: tuple[str, ...] = ("ray", "inprocess")


@dataclass(frozen=True)
class Job:
    """One run of a comparison: ``strategy`` with ``train.seed = seed`` and extra overrides.

    ``label`` names the run's folder and table row (default: the strategy name); give two jobs
    of one strategy different labels to compare settings (e.g. a tuning grid).
    """

    strategy: str
    seed: int = 0
    overrides: tuple[str, ...] = ()
    label: str = ""
    fresh_partition: bool = False  # data.seed = the config's data.seed + seed (else the config's)

    @property
    def name(self) -> str:
        return self.label or self.strategy

    def run_dir(self, out_dir: str | Path) -> Path:
        return Path(out_dir) / self.name / f"{SEED_DIR_PREFIX}{self.seed}"


def claim_output(out: Path, what: str, resume: bool, overwrite: bool) -> Claim:
    """The comparison (or tuning) folder ``out``, checked (fedlora.app.folders): an earlier one is
    refused unless ``resume`` (continue it) or ``overwrite`` (moved aside when the runs start)."""
    from fedlora.app.folders import claim

    return claim(out, what=what, resume=resume, overwrite=overwrite)


def resolve_base(config: ConfigSource, overrides: Settings = ()) -> ExperimentConfig:
    from fedlora.app.runner import resolve

    return resolve(config, overrides)


def job_config(base: ExperimentConfig, job: Job, run_dir: Path) -> ExperimentConfig:
    """The resolved config of one job (raises ConfigError for a bad strategy or override)."""
    from fedlora.config import apply_overrides, build_config
    from fedlora.methods import method

    declared = set(method(job.strategy).options.model_fields)  # ConfigError listing the known names
    raw = base.model_dump(mode="json")
    raw["strategy"] = {k: v for k, v in raw["strategy"].items() if k in declared} | {"name": job.strategy}
    seeds = [f"train.seed={job.seed}"]
    if job.fresh_partition:  # a fresh partition per seed, the same for every label of that seed
        seeds.append(f"data.seed={base.data.seed + job.seed}")
    raw = apply_overrides(raw, [*job.overrides, *seeds])
    raw["output"]["dir"] = str(run_dir)
    # TensorBoard: OUT/tensorboard/<label>/seed<k>, so `tensorboard --logdir OUT/tensorboard`
    # overlays the strategies in each chart (tracking.write_mean_curves adds <label>/mean)
    raw["output"]["tensorboard_dir"] = str(run_dir.parent.parent / "tensorboard" / job.name / run_dir.name)
    raw["output"]["mlflow_run_name"] = raw["output"].get("mlflow_run_name") or f"{job.name} seed{job.seed}"
    raw["output"]["wandb_run_name"] = raw["output"].get("wandb_run_name") or f"{job.name} seed{job.seed}"
    raw["output"]["wandb_group"] = raw["output"].get("wandb_group") or run_dir.parent.parent.resolve().name
    return build_config(raw)


def is_complete(run_dir: Path, config: ExperimentConfig, report: bool = False) -> bool:
    """True when ``run_dir/results.json`` holds every round of this exact config (``report``: say
    so when the folder holds a run of another config; the caller that acts on it reports, once)."""
    path = run_dir / "results.json"
    if not path.is_file():
        return False
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if comparable_config(results.get("config") or {}) != comparable_config(config.model_dump(mode="json")):
        if report:
            logger.warning("compare: %s was produced by a different config: continued from its checkpoint where "
                           "the config allows it (more train.rounds, a later lr decay), else run again", run_dir)
        return False
    rounds = [r.get("round") for r in results.get("rounds") or [] if r.get("round") != 0]  # 0: causal LM zero-shot
    return rounds == list(range(1, config.train.rounds + 1))


def run_one(config: ExperimentConfig, run_dir: Path, engine: Engine, verbose: bool = False,
            resume: bool = False) -> None:
    """Run one job into ``run_dir`` on ``engine`` through the runner's path
    (:func:`fedlora.app.runner.execute`; ``resume``: continue its checkpoint). A run that cannot
    produce results is a RunError naming its folder."""
    from fedlora.app.runner import RunError, execute

    try:
        execute(config, run_dir, resume=resume, engine=engine, verbose=verbose)
    except RunError as error:
        raise RunError(f"{run_dir}: {error}") from None


def check_engine(engine: str) -> None:
    from fedlora.config import ConfigError

    if engine not in ENGINES:
        raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")


def run_jobs(
    config: ExperimentConfig | str | Path | dict,
    jobs: Iterable[Job],
    out_dir: str | Path,
    engine: Engine = "ray",
    overrides: Sequence[str] = (),
    verbose: bool = False,
    workers: int = 1,
    folder: Claim | None = None,
    on_done: Callable[[Job, Path], None] | None = None,
) -> list[Path]:
    """Run every job into ``OUT/<label>/seed<k>/``; returns the folders. What is there is never lost
    (this is what ``--resume`` does): a complete run (results.json with every round of this exact
    config) is skipped, an interrupted one resumes from its checkpoint, and a run folder that cannot
    be resumed (no usable checkpoint, another config) is moved aside (``seed<k>.old-<time>``, with
    its TensorBoard folder) and run again.

    Every job's config is built and validated, and its inputs checked (model, data, limits),
    before the first run starts (and before ``folder``, the claimed output folder, moves an
    earlier comparison aside), so a bad strategy name, override or data file fails at once. ``workers > 1`` runs that many jobs at a time, each in its own
    process (in-process engine only: each Ray run starts its own cluster); on a CUDA machine the
    workers share the GPU. A worker's log goes to ``<run dir>/run.log``. ``on_done(job, run_dir)``
    is called as soon as each run finishes (not for skipped complete runs), e.g. to keep it as a
    record before the other runs end.
    """
    check_engine(engine)
    if workers < 1:
        from fedlora.config import ConfigError

        raise ConfigError(f"workers must be >= 1, got {workers}")
    if workers > 1 and engine != "inprocess":
        from fedlora.config import ConfigError

        raise ConfigError("parallel workers need the in-process engine (--engine inprocess); Ray already "
                          "runs the clients of one experiment in parallel")
    from fedlora.app.quiet import output
    from fedlora.app.runner import check_inputs

    with output(verbose):  # the checks build models too: their load reports stay in the logs
        base = resolve_base(config, overrides)
        out = Path(out_dir)
        planned = [(job, job.run_dir(out)) for job in jobs]
        configs = [job_config(base, job, run_dir) for job, run_dir in planned]
        for cfg in configs:
            check_inputs(cfg)
        if folder is not None:
            folder.take()
        todo = []
        for index, ((job, run_dir), cfg) in enumerate(zip(planned, configs, strict=True), start=1):
            if is_complete(run_dir, cfg, report=True):
                logger.info("compare: [%d/%d] %s seed %d: complete, skipped", index, len(planned), job.name, job.seed)
            else:
                todo.append((index, job, run_dir, cfg, resumable(run_dir, cfg)))
        if workers == 1:
            for index, job, run_dir, cfg, resume in todo:
                logger.info("compare: [%d/%d] %s seed %d -> %s (%s%s)", index, len(planned), job.name, job.seed,
                            run_dir, engine, ", resumed" if resume else "")
                started = time.perf_counter()
                run_one(cfg, run_dir, engine, verbose, resume)
                logger.info("compare: %s seed %d done in %.1fs", job.name, job.seed, time.perf_counter() - started)
                if on_done is not None:
                    on_done(job, run_dir)
        else:
            _run_parallel(todo, len(planned), workers, on_done)
    return [run_dir for _, run_dir in planned]


def resumable(run_dir: Path, config: ExperimentConfig) -> bool:
    """Whether the incomplete run in ``run_dir`` continues from its checkpoint (True) or starts
    afresh (False); a folder holding anything that cannot be resumed is moved aside first."""
    from fedlora.app.folders import holds_something, move_aside
    from fedlora.checkpoint import load_server
    from fedlora.config import ConfigError
    from fedlora.strategies.registry import strategy_class

    if not holds_something(run_dir):
        return False
    try:
        strategy_class(config.strategy.name)  # its state types decode
        load_server(run_dir, config)
        return True
    except ConfigError as error:
        logger.warning("compare: %s cannot be resumed (%s)", run_dir, error)
    move_aside(run_dir, "run", "compare")
    tensorboard = Path(config.output.tensorboard_dir)
    if config.output.tensorboard_dir and holds_something(tensorboard):
        move_aside(tensorboard, "run's TensorBoard events", "compare")
    return False


PARENT_POLL_SECONDS = 1.0  # how often a worker checks that the process that started it is alive


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` fresh processes (spawned: no inherited torch or Ray state) that end
    with the process that made it, however it ends. Without this, a command stopped by a signal
    (``kill``, a closed session) leaves its workers running: they take the jobs already queued to
    them, one after another, into the run folders a restarted command then works in at the same
    time, and nothing keeps what they finish. A worker whose parent is gone exits within
    :data:`PARENT_POLL_SECONDS`; its run resumes from its last checkpoint next time."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_exit_with_parent, initargs=(os.getpid(),))


def _exit_with_parent(parent: int) -> None:
    """In a worker: a daemon thread that ends the process once ``parent`` is no longer its parent."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="fedlora-exit-with-parent", daemon=True).start()


def _run_parallel(todo: list[tuple[int, Job, Path, ExperimentConfig, bool]], total: int, workers: int,
                  on_done: Callable[[Job, Path], None] | None = None) -> None:
    """``todo`` on a :func:`worker_pool` of ``workers`` processes."""
    from concurrent.futures import as_completed

    from fedlora.app.runner import RunError

    with worker_pool(workers) as pool:
        futures = {}
        for index, job, run_dir, cfg, resume in todo:
            logger.info("compare: [%d/%d] %s seed %d -> %s (worker%s)", index, total, job.name, job.seed, run_dir,
                        ", resumed" if resume else "")
            futures[pool.submit(_worker_run, cfg.to_json(), str(run_dir), resume)] = (job, run_dir)
        failed = []
        try:
            for future in as_completed(futures):
                job, run_dir = futures[future]
                error = future.exception()
                if error is not None:
                    failed.append(f"{job.name} seed {job.seed}: {error}")
                    logger.warning("compare: %s seed %d failed: %s", job.name, job.seed, error)
                else:
                    logger.info("compare: %s seed %d done in %.1fs", job.name, job.seed, future.result())
                    if on_done is not None:
                        on_done(job, run_dir)
        except BaseException:  # interrupted (Ctrl-C) or on_done failed: start no queued job
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if failed:
        raise RunError(f"{len(failed)} run(s) failed: {'; '.join(failed)}")


def _worker_run(config_json: str, run_dir: str, resume: bool = False) -> float:
    """One job in a worker process: the in-process engine, its log in ``run_dir/run.log``
    (appended to when the job resumes)."""
    from fedlora.app import progress
    from fedlora.app.quiet import output
    from fedlora.config import config_from_json
    from fedlora.training import STEP_PROGRESS_ENV

    progress.LIVE = False  # workers share the terminal: plain lines, into run.log (run_one writes it)
    os.environ[STEP_PROGRESS_ENV] = "off"  # and no step bars (fedlora.training.step_reporter)
    started = time.perf_counter()
    with output(console=False):  # a worker runs several jobs: each log only in its own run.log
        run_one(config_from_json(config_json), Path(run_dir), "inprocess", resume=resume)
    return time.perf_counter() - started


def default_out_dir(base: ExperimentConfig) -> Path:
    return Path(base.output.dir) / "compare"
