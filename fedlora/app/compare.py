"""Strategy comparison: run strategies x seeds on the same partitions and summarise them.

    table = fedlora.compare("configs/smoke.toml", ["fedit", "flexlora"], seeds=(0, 1),
                            engine="inprocess")
    table            # a notebook renders the mean +- std table with its legend

:func:`compare` joins two halves that other tools reuse (``fedlora tune``, the benchmarks):

- :mod:`fedlora.app.jobs` runs a list of :class:`~fedlora.app.jobs.Job` (strategy, seed,
  overrides, label), each into ``OUT/<label>/seed<k>/`` through the runner's one path, skipping
  jobs whose ``results.json`` is already complete (:func:`~fedlora.app.jobs.run_jobs`);
- :mod:`fedlora.app.summary` reads every ``OUT/*/seed*/results.json`` and builds the
  :class:`~fedlora.app.summary.ComparisonTable` (mean +- std over seeds per label), written as
  ``summary.csv`` / ``summary.md`` (:func:`~fedlora.app.summary.summarize`).

Same partitions by default: a job's seed overrides ``train.seed`` only, ``data.seed`` stays the
config's; with ``fresh_partitions`` (``--fresh-partitions``) every seed is also a fresh partition
(``data.seed = <config's data.seed> + seed``), shared by every label of that seed
(:mod:`fedlora.app.jobs`).

Paired statistics (``paired=BASELINE``, ``--paired BASELINE``): every other label minus the
baseline, matched by seed, with a bootstrap interval, a paired t-test and Holm's correction
(:mod:`fedlora.app.paired`), written to ``paired.csv`` and appended to ``summary.md``; in Python
``table.paired("fedit")``. Numeric entries of a round's ``extra`` (the methods' mechanisms) get
their final values as ``extra.<key>`` columns in ``summary.csv``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from fedlora.app.jobs import Engine, Job, check_engine, claim_output, default_out_dir, resolve_base, run_jobs
from fedlora.app.paired import PairingError
from fedlora.app.runs import load_runs
from fedlora.app.summary import ComparisonTable, summarize
from fedlora.schema import ConfigSource, Settings, overrides_from


def compare(
    config: ConfigSource,
    strategies: Sequence[str],
    seeds: Sequence[int] = (0,),
    out_dir: str | os.PathLike[str] | None = None,
    overrides: Settings = (),
    engine: Engine = "ray",
    plots: bool = True,
    verbose: bool = False,
    workers: int = 1,
    fresh_partitions: bool = False,
    paired: str | None = None,
    primary: str | None = None,
    primary_metric: str = "personalized_accuracy",
    resume: bool = False,
    overwrite: bool = False,
    strategy_overrides: Mapping[str, Settings] | None = None,
) -> ComparisonTable:
    """Run every strategy x seed, then summarise and plot.

    Parameters
    ----------
    config : ExperimentConfig, TOML path or mapping
        The base experiment; ``overrides`` apply to every run: ``section.key=value`` strings or a
        mapping (``{"train.lr": 1e-3}``, ``{"train": {"lr": 1e-3}}``).
    strategies : sequence of str
        Registered strategy names; a run folder is ``OUT/<strategy>/seed<k>/``.
    seeds : sequence of int, default (0,)
        Values of ``train.seed``; ``data.seed`` stays the config's (identical partitions) unless
        ``fresh_partitions``.
    out_dir : path, optional
        Comparison folder (default ``<output.dir>/compare``); gets ``summary.csv``,
        ``summary.md`` and the PNG plots.
    engine : {"ray", "inprocess"}, default "ray"
        ``ray``: Flower's simulation engine (:func:`fedlora.app.runner.run`); ``inprocess``: the same
        ServerApp / ClientApp code without Ray (:func:`fedlora.app.runner.run_inprocess`).
    workers : int, default 1
        Runs at a time, each in its own process (in-process engine only; they share a GPU).
    fresh_partitions : bool, default False
        Every seed a fresh partition: ``data.seed = <config's data.seed> + seed`` (all strategies
        of one seed share it, so the paired differences stay paired).
    paired : str, optional
        Baseline of the paired statistics (:meth:`ComparisonTable.paired`): ``paired.csv`` and a
        section of ``summary.md``. Must be one of ``strategies``.
    primary, primary_metric : str, optional
        The declared primary comparison (``primary`` - ``paired`` on ``primary_metric``): reported
        uncorrected, outside the Holm family.
    strategy_overrides : mapping, optional
        Strategy name -> overrides for that strategy's runs only (e.g. its own options:
        ``{"fedtreelora": ["strategy.warmup_rounds=1"]}`` or ``{"fedtreelora": {"strategy.warmup_rounds": 1}}``),
        applied after ``overrides``.

    resume : bool, default False
        Continue the comparison in ``out_dir`` (:func:`run_jobs`): runs whose results.json holds
        every round of the same config are not run again, interrupted ones resume from their
        checkpoint. Without it, an ``out_dir`` that holds an earlier comparison is refused.
    overwrite : bool, default False
        Move an earlier comparison in ``out_dir`` aside (``OUT.old-<time>``; nothing is deleted)
        and start afresh.
    """
    from fedlora.config import ConfigError

    check_engine(engine)
    if not strategies:
        raise ConfigError("compare needs at least one strategy, e.g. --strategies fedit,flexlora")
    check_paired(strategies, paired, primary, primary_metric)
    base = resolve_base(config, overrides)
    out = Path(out_dir) if out_dir is not None else default_out_dir(base)
    folder = claim_output(out, "comparison", resume, overwrite)
    own = {name: tuple(overrides_from(settings)) for name, settings in (strategy_overrides or {}).items()}
    jobs = [Job(strategy, int(seed), own.get(strategy, ()), fresh_partition=fresh_partitions)
            for strategy in strategies for seed in seeds]
    run_jobs(base, jobs, out, engine=engine, verbose=verbose, workers=workers, folder=folder)
    labels = list(dict.fromkeys(strategies))
    table = summarize(out, labels=labels, seeds=[int(s) for s in seeds])
    if paired is not None:
        comparison = table.paired(paired, primary=primary, primary_metric=primary_metric)
        comparison.write(out)
        with (out / "summary.md").open("a") as summary:
            summary.write("\n" + comparison.to_markdown())
        table.paired_table = comparison
    if base.output.tensorboard:
        from fedlora.app.tracking import write_hparams, write_mean_curves

        finished = load_runs(out, table.strategies, seeds)
        write_mean_curves(out / "tensorboard", finished)
        write_hparams(out / "tensorboard", finished)
    if plots:
        from fedlora.app.plotting import plot_comparison, plot_mechanisms

        runs = load_runs(out, table.strategies, seeds)
        plot_comparison(out, runs, base.data)
        plot_mechanisms(out, runs)
    return table



def check_paired(strategies: Sequence[str], paired: str | None, primary: str | None, primary_metric: str) -> None:
    """Refuse, before anything runs, a paired baseline or primary that is not among the labels."""
    from fedlora.app.paired import METRIC_NAMES

    if paired is None:
        if primary is not None:
            raise PairingError("--primary needs --paired BASELINE (the primary comparison is PRIMARY - BASELINE)")
        return
    if paired not in strategies:
        raise PairingError(f"--paired: baseline {paired!r} is not among the strategies ({', '.join(strategies)})")
    if primary is not None and (primary not in strategies or primary == paired):
        raise PairingError(f"--primary: {primary!r} must be one of the other strategies "
                           f"({', '.join(s for s in strategies if s != paired)})")
    if primary_metric not in METRIC_NAMES:
        raise PairingError(f"--primary-metric: unknown metric {primary_metric!r}; known: {', '.join(METRIC_NAMES)}")
