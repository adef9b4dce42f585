"""Experiment tracking where people look: TensorBoard event files, MLflow runs and W&B runs.

Every backend is switched the same way: ``output.<backend> = true`` turns it on and its
``output.<backend>_*`` keys say where and under which names (``tensorboard`` is on by default,
``mlflow`` and ``wandb`` are off). :class:`Tracker` receives every finished round
(:meth:`Tracker.round`) and the finished run (:meth:`Tracker.finish`) from the server loop, and
forwards them to

- **TensorBoard** (``output.tensorboard``, on by default): one ``SummaryWriter`` on
  ``output.tensorboard_dir`` (default ``<output.dir>/tensorboard``). Scalars are grouped by tag
  prefix (``accuracy/``, ``loss/``, ``bytes/``, ``seconds/``, ``clients/``, ``client/<k>/``, and
  ``extra/<key>`` for every numeric entry of the round's ``extra``: the method's mechanism, e.g.
  FedPissa's relative correction), step = the round, and the resolved config is a text entry. A resumed run purges the events after the
  round it resumes from, so a crash never leaves two values for one round.
- **MLflow** (``output.mlflow``; a config that sets ``output.mlflow_uri`` alone has it on): the
  resolved config flattened to params plus
  ``config_hash``, the same per-round metrics (step = the round), and at the end ``results.json``,
  the plots and the adapters as artifacts. A resumed run continues the same MLflow run (its id is
  kept in ``<output.dir>/mlflow_run.json``). For a ``sqlite:///`` store, artifacts go to a folder
  ``mlartifacts`` beside the database file, not into the working directory.
- **Weights & Biases** (``output.wandb``; ``output.wandb_mode`` offline by default: the run is
  written under ``output.wandb_dir``, default ``<output.dir>``, and nothing leaves the machine
  until ``wandb sync``): the resolved config and ``config_hash`` as the run's config, the same
  per-round metrics (step = the round), the final metrics (``final/<key>``) as its summary, and at
  the end ``results.json`` and the plots as run files and every adapter folder as a ``model``
  artifact. A resumed run continues the same W&B run id (kept in ``<output.dir>/wandb_run.json``);
  offline, the resumed part is a second run folder of that id, merged by ``wandb sync``. W&B's own
  console output is off: fedlora's lines stay the only ones.

All are fed from :class:`fedlora.results.RoundRecord`: the values are the ones in
``results.json``; NaN (a metric not measured that round) is skipped, never logged as 0.

Across the runs of a comparison, :func:`write_mean_curves` adds a mean-over-seeds curve per label
and :func:`write_hparams` one TensorBoard HParams view: every run a session whose hyperparameters
are the label, the seed and each config key that differs between the runs, whose metrics are its
final scores.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedlora import protocol
from fedlora.app.adapters import adapter_folders
from fedlora.app.runs import train_seed
from fedlora.results import RoundRecord
from fedlora.schema import ExperimentConfig

logger = logging.getLogger("fedlora")

#: RoundRecord field -> metric name (TensorBoard tag; MLflow key with "/" -> "_" is not needed:
#: MLflow accepts "/" in metric names).
ROUND_METRICS: dict[str, str] = {
    "global_accuracy": "accuracy/global",
    "personalized_accuracy": "accuracy/personalised",
    "personalized_accuracy_unweighted": "accuracy/personalised_unweighted",
    "personalized_accuracy_worst": "accuracy/personalised_worst",
    "received_accuracy": "accuracy/received",
    "validation_accuracy": "accuracy/validation",
    "train_loss": "loss/train",
    # causal LMs (model.kind = causal_lm); NaN, so absent, for classification
    "global_rouge_l": "rouge_l/global",
    "personalized_rouge_l": "rouge_l/personalised",
    "personalized_rouge_l_unweighted": "rouge_l/personalised_unweighted",
    "global_loss": "loss/global",
    "global_perplexity": "perplexity/global",
    "personalized_loss": "loss/personalised",
    "personalized_perplexity": "perplexity/personalised",
    "validation_loss": "loss/validation",
    "received_token_accuracy": "accuracy/received_token",
    "received_loss": "loss/received",
    "bytes_up": "bytes/up",
    "bytes_down": "bytes/down",
    "wire_bytes_up": "bytes/wire_up",
    "wire_bytes_down": "bytes/wire_down",
    "seconds": "seconds/round",
    "client_train_seconds": "seconds/client_train",
    "aggregation_seconds": "seconds/aggregation",
    "clients": "clients/aggregated",
    "failures": "clients/failures",
}
MLFLOW_RUN_FILE = "mlflow_run.json"
WANDB_RUN_FILE = "wandb_run.json"


EXTRA_TAG = "extra/"


def extra_metrics(extra: Any) -> dict[str, float]:
    """``extra/<key>`` -> value for the numeric entries of a round's ``extra`` (flat keys only:
    strings, booleans, lists and nested dicts are left out, as are NaN and infinities)."""
    from fedlora.app.runs import numeric_extra

    return {f"{EXTRA_TAG}{key}": value for key, value in numeric_extra(extra).items()}


def round_metrics(record: RoundRecord) -> Iterator[tuple[str, float]]:
    """``(name, value)`` for every measured metric of ``record``: the round's metrics, the numeric
    entries of its ``extra`` (``extra/<key>``), then each client's evaluation accuracy
    (``client/<partition>/accuracy``; causal LMs: ``rouge_l``). NaN values are left out."""
    for field, name in ROUND_METRICS.items():
        value = float(getattr(record, field))
        if math.isfinite(value):
            yield name, value
    yield from extra_metrics(record.extra).items()
    for partition, metrics in sorted(record.per_client.items(), key=lambda kv: int(kv[0])):
        for key in (protocol.ACCURACY, protocol.ROUGE_L):
            value = float(metrics.get(key, math.nan))
            if math.isfinite(value):
                yield f"client/{partition}/{key.replace('-', '_')}", value


def flatten(mapping: dict[str, Any]) -> dict[str, Any]:
    """A nested mapping (a resolved config) as dotted keys (``train.lr``) -> its leaf values."""
    leaves: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            leaves[prefix] = value

    walk("", mapping)
    return leaves


def flat_params(config: ExperimentConfig) -> dict[str, str]:
    """The resolved config as dotted keys (``train.lr``) -> string values, plus ``config_hash``."""
    params = {key: json.dumps(value) if isinstance(value, (list, dict)) else str(value)
              for key, value in flatten(config.model_dump(mode="json")).items()}
    params["config_hash"] = config.hash()
    return params


def tensorboard_dir(config: ExperimentConfig, out_dir: Path) -> Path:
    return Path(config.output.tensorboard_dir) if config.output.tensorboard_dir else out_dir / "tensorboard"


def _wait_to_sort_last(folder: Path) -> None:
    """Wait, at most a second, until a new event file in ``folder`` sorts after every file there.

    TensorBoard reads a folder's event files in name order, and a resumed run's purge only drops
    the events read before it. A file's name starts with its creation second, then host, process
    id and a per-process counter compared as text (``...9`` sorts after ``...10``), so a writer
    opened in the same second as the last one (a resume in the same process) could be read first
    and purge nothing."""
    import time

    seconds = [
        int(name.split(".")[3])
        for name in (p.name for p in folder.glob("events.out.tfevents.*"))
        if name.split(".")[3].isdigit()
    ]
    if seconds:
        while int(time.time()) <= max(seconds):
            time.sleep(0.05)


class Tracker:
    """TensorBoard and/or MLflow for one run (see the module docstring); does nothing when both
    are off. ``first_round`` > 1 means a resumed run."""

    def __init__(self, config: ExperimentConfig, out_dir: Path, first_round: int = 1) -> None:
        self.config, self.out_dir = config, out_dir
        self._tb: Any = None
        self._mlflow: Any = None
        self._run_id = ""
        if config.output.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            folder = tensorboard_dir(config, out_dir)
            if first_round > 1:
                _wait_to_sort_last(folder)
            self._tb = SummaryWriter(str(folder), purge_step=first_round if first_round > 1 else None)
            if first_round == 1:
                self._tb.add_text("config", f"```\n{config.model_dump_json(indent=2)}\n```", 0)
        self._wandb: Any = None
        check_backends(config)
        if config.output.mlflow:
            self._start_mlflow(first_round)
        if config.output.wandb:
            self._start_wandb(first_round)

    def _start_mlflow(self, first_round: int) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        uri = self.config.output.mlflow_uri or mlflow.get_tracking_uri()
        client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(self.config.output.mlflow_experiment)
        if experiment is None:
            experiment_id = client.create_experiment(
                self.config.output.mlflow_experiment, artifact_location=artifact_location(uri)
            )
        else:
            experiment_id = experiment.experiment_id
        saved = self.out_dir / MLFLOW_RUN_FILE
        if first_round > 1 and saved.is_file():
            self._run_id = str(json.loads(saved.read_text())["run_id"])
            client.update_run(self._run_id, status="RUNNING")
        else:
            name = (
                self.config.output.mlflow_run_name
                or f"{self.config.strategy.name} seed{self.config.train.seed}"
            )
            run = client.create_run(
                experiment_id,
                run_name=name,
                tags={"strategy": self.config.strategy.name, "seed": str(self.config.train.seed)},
            )
            self._run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param(k, v[:6000]) for k, v in flat_params(self.config).items()]
            for start in range(0, len(params), 100):  # MLflow's batch limit
                client.log_batch(self._run_id, params=params[start : start + 100])
            saved.write_text(json.dumps({"run_id": self._run_id, "tracking_uri": uri}))
        self._mlflow = client
        logger.info(
            "mlflow: run %s in experiment %r at %s", self._run_id, self.config.output.mlflow_experiment, uri
        )

    def _start_wandb(self, first_round: int) -> None:
        """A W&B run, offline unless ``output.wandb_mode`` says online; a resumed run (its id in
        ``wandb_run.json``) continues it."""
        import wandb

        out = self.config.output
        saved = self.out_dir / WANDB_RUN_FILE
        resume_id = str(json.loads(saved.read_text())["run_id"]) if first_round > 1 and saved.is_file() else None
        folder = Path(out.wandb_dir) if out.wandb_dir else self.out_dir
        folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, quiet=True, console="off", x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, save_code=False, disable_job_creation=True)
        self._wandb = wandb.init(
            project=out.wandb_project, dir=str(folder), mode=out.wandb_mode, group=out.wandb_group or None,
            name=out.wandb_run_name or f"{self.config.strategy.name} seed{self.config.train.seed}",
            config={**self.config.model_dump(mode="json"), "config_hash": self.config.hash()},
            tags=[self.config.strategy.name], id=resume_id, resume="allow" if resume_id else None,
            reinit="create_new", settings=settings,
        )
        if resume_id is None:
            saved.write_text(json.dumps({"run_id": self._wandb.id, "project": out.wandb_project,
                                         "mode": out.wandb_mode, "dir": str(Path(self._wandb.dir).parent)}))
        logger.info("wandb: run %s (%s) in %s", self._wandb.id, out.wandb_mode, Path(self._wandb.dir).parent)

    def round(self, record: RoundRecord) -> None:
        metrics = list(round_metrics(record))
        if self._tb is not None:
            for name, value in metrics:
                self._tb.add_scalar(name, value, record.round)
            self._tb.flush()
        if self._mlflow is not None:
            import time

            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            batch = [Metric(name, value, now, record.round) for name, value in metrics]
            for start in range(0, len(batch), 1000):
                self._mlflow.log_batch(self._run_id, metrics=batch[start : start + 1000])
        if self._wandb is not None and metrics:
            self._wandb.log(dict(metrics), step=record.round)

    def finish(self, ok: bool = True) -> None:
        """Close the event file; upload results, plots and adapters to MLflow and W&B and end their
        runs (``FAILED`` / a non-zero exit code when ``ok`` is false, so a later resume can finish it)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._finish_wandb(ok)
        if self._mlflow is None:
            return
        if ok:
            for path in sorted(self.out_dir.glob("*.png")) + [self.out_dir / "results.json"]:
                if path.is_file():
                    self._mlflow.log_artifact(self._run_id, str(path))
            adapters = self.out_dir / "adapters"
            if adapters.is_dir():
                self._mlflow.log_artifacts(self._run_id, str(adapters), artifact_path="adapters")
        self._mlflow.set_terminated(self._run_id, status="FINISHED" if ok else "FAILED")
        self._mlflow = None

    def _finish_wandb(self, ok: bool) -> None:
        """The final metrics as the summary, results.json and the plots as run files, each adapter
        folder as a ``model`` artifact (files added one by one: W&B prints a line per folder)."""
        import shutil

        import wandb

        run, self._wandb = self._wandb, None
        try:
            if ok:
                results = self.out_dir / "results.json"
                final = json.loads(results.read_text()).get("final", {}) if results.is_file() else {}
                run.summary.update({f"final/{key}": value for key, value in final.items()
                                    if isinstance(value, (int, float)) and not isinstance(value, bool)})
                for path in [results, *sorted(self.out_dir.glob("*.png"))]:
                    if path.is_file():
                        shutil.copy2(path, run.dir)  # inside the run folder: no symlink, no warning
                        run.save(str(Path(run.dir) / path.name), base_path=run.dir, policy="now")
                for folder in adapter_folders(self.out_dir):
                    artifact = wandb.Artifact(f"adapter-{folder.name}-{run.id}", type="model",
                                              metadata={"strategy": self.config.strategy.name,
                                                        "config_hash": self.config.hash()})
                    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
                        artifact.add_file(str(file), name=str(file.relative_to(folder)))
                    run.log_artifact(artifact)
        finally:
            run.finish(exit_code=0 if ok else 1)


def check_backends(config: ExperimentConfig) -> None:
    """ConfigError (one line) for a tracking backend switched on whose package is not installed."""
    import importlib.util

    from fedlora.errors import ConfigError

    wanted = (("mlflow", config.output.mlflow, "tracking"), ("wandb", config.output.wandb, "wandb"))
    for package, on, extra in wanted:
        if on and importlib.util.find_spec(package) is None:
            raise ConfigError(f"output.{package} is on but {package} is not installed: "
                              f"pip install 'fedlora[{extra}]'")


def check_tracking(config: ExperimentConfig, out_dir: Path) -> None:
    """Before a run: its tracking backends are installed (:func:`check_backends`) and the folders they
    write, TensorBoard's and W&B's, can be written (ConfigError, one line)."""
    from fedlora.app.folders import check_writable

    check_backends(config)
    output = config.output
    folders = {"output.tensorboard_dir": tensorboard_dir(config, out_dir)} if output.tensorboard else {}
    if output.wandb and output.wandb_dir:
        folders["output.wandb_dir"] = Path(output.wandb_dir)
    for key, folder in folders.items():
        check_writable(folder, key)


def write_mean_curves(folder: Path, runs: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """For each label of ``runs`` (label -> results.json dicts, one per seed) an event file under
    ``folder/<label>/mean`` with the mean over seeds of every round metric and numeric ``extra``
    entry (rounds every seed measured). Earlier mean files there are replaced. Returns the folders
    written."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    written = []
    for label, results_list in runs.items():
        target = folder / label / "mean"
        shutil.rmtree(target, ignore_errors=True)
        per_round: dict[int, dict[str, list[float]]] = {}
        for results in results_list:
            for row in results.get("rounds") or []:
                entries: dict[str, Any] = {name: row.get(field) for field, name in ROUND_METRICS.items()}
                entries.update(extra_metrics(row.get("extra")))
                for name, value in entries.items():
                    if (
                        isinstance(value, (int, float))
                        and not isinstance(value, bool)
                        and math.isfinite(value)
                    ):
                        per_round.setdefault(int(row["round"]), {}).setdefault(name, []).append(float(value))
        with SummaryWriter(str(target)) as writer:
            for step, metrics in sorted(per_round.items()):
                for name, values in metrics.items():
                    if len(values) == len(results_list):
                        writer.add_scalar(name, sum(values) / len(values), step)
        written.append(target)
    return written


#: results.json ``final`` keys shown as the metrics of the HParams view (those some run measured)
HPARAM_METRICS: tuple[str, ...] = (
    "global_accuracy", "personalized_accuracy", "personalized_accuracy_unweighted", "personalized_accuracy_worst",
    "received_accuracy", "best_global_accuracy", "best_personalized_accuracy", "global_rouge_l",
    "personalized_rouge_l", "global_perplexity", "bytes_total",
)
HPARAMS_SUFFIX = ".hparams"  # fedlora's HParams event files (replaced on every write; the curves are kept)
FINAL_TAG = "final/"


def _hparam_value(value: Any) -> bool | int | float | str:
    """A config value as the HParams plugin takes it (a list or a table as its JSON text)."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return "" if value is None else json.dumps(value, sort_keys=True)


def _run_key(label: str, results: dict[str, Any]) -> tuple[str, str]:
    """(label, seed folder) of a run as :func:`fedlora.app.runs.load_runs` reads it."""
    return label, str(results.get("_seed_dir") or f"seed{train_seed(results)}")


def session_hparams(runs: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], dict[str, Any]]:
    """(label, seed folder) -> the run's hyperparameters: ``label``, ``seed`` (train.seed) and every
    other config key (``output`` left out) whose value is not the same in every run."""
    flat: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}
    for label, results_list in runs.items():
        for results in results_list:
            leaves = {key: _hparam_value(value) for key, value in flatten(results.get("config") or {}).items()
                      if not key.startswith("output.") and key != "train.seed"}
            flat[_run_key(label, results)] = (leaves, train_seed(results))
    keys = sorted({key for leaves, _ in flat.values() for key in leaves})
    varying = [key for key in keys if len({json.dumps(leaves.get(key)) for leaves, _ in flat.values()}) > 1]
    return {run: {"label": run[0], "seed": seed, **{key: leaves.get(key, "") for key in varying}}
            for run, (leaves, seed) in flat.items()}


def write_hparams(folder: Path, runs: dict[str, list[dict[str, Any]]]) -> list[Path]:
    """One TensorBoard HParams view over ``runs`` (label -> results.json dicts, as
    :func:`fedlora.app.runs.load_runs` reads them, each with its ``_seed_dir``), written under
    ``folder`` (a comparison's ``OUT/tensorboard``): each run is a session in its own curves' folder
    ``folder/<label>/<seed folder>`` (hyperparameters: :func:`session_hparams`; metrics: its results'
    ``final`` values of :data:`HPARAM_METRICS` as ``final/<key>`` scalars at its last round), and the
    experiment (the hyperparameters with their values, the metrics) in ``folder``. Earlier HParams files
    are replaced. Returns the session folders."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2
    from tensorboard.plugins.hparams import summary_v2 as hp
    from torch.utils.tensorboard.writer import FileWriter

    hparams = session_hparams(runs)
    finals = {_run_key(label, r): r for label, results_list in runs.items() for r in results_list}
    measured = [key for key in HPARAM_METRICS
                if any(_finite(r.get("final", {}).get(key)) for r in finals.values())]
    end_summary = Summary()
    end_summary.value.add(tag=metadata.SESSION_END_INFO_TAG, tensor=metadata.NULL_TENSOR,
                          metadata=metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(
                              session_end_info=plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS))))
    written = []
    for (label, seed_dir), values in hparams.items():
        target = folder / label / seed_dir
        _drop_hparams_files(target)
        results = finals[(label, seed_dir)]
        step = max([int(r["round"]) for r in results.get("rounds") or []] or [0])
        writer = FileWriter(str(target), filename_suffix=HPARAMS_SUFFIX)
        writer.add_summary(hp.hparams_pb(values, trial_id=f"{label}/{seed_dir}"), step)
        for key in measured:
            value = results.get("final", {}).get(key)
            if _finite(value):
                writer.add_summary(_scalar(f"{FINAL_TAG}{key}", float(value)), step)
        writer.add_summary(end_summary, step)
        writer.close()
        written.append(target)
    _drop_hparams_files(folder)
    domains = {key: sorted({v[key] for v in hparams.values()}, key=str) for key in
               dict.fromkeys(k for v in hparams.values() for k in v)}
    infos = [hp.HParam(key, hp.Discrete(values) if _one_type(values) else None) for key, values in domains.items()]
    writer = FileWriter(str(folder), filename_suffix=HPARAMS_SUFFIX)
    writer.add_summary(hp.hparams_config_pb(infos, [hp.Metric(f"{FINAL_TAG}{key}", display_name=key)
                                                  for key in measured]))
    writer.close()
    return written


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _one_type(values: list[Any]) -> bool:
    """Whether ``values`` can be one HParams discrete domain (all strings, all numbers or all bools)."""
    kinds = {bool if isinstance(v, bool) else float if isinstance(v, (int, float)) else type(v) for v in values}
    return len(kinds) == 1


def _scalar(tag: str, value: float) -> Any:
    from torch.utils.tensorboard.summary import scalar

    return scalar(tag, value)


def _drop_hparams_files(folder: Path) -> None:
    for path in folder.glob(f"events.out.tfevents.*{HPARAMS_SUFFIX}"):
        path.unlink()


def artifact_location(uri: str) -> str | None:
    """A new experiment's artifact folder: beside the database for ``sqlite:///PATH``; otherwise
    MLflow's (a tracking server chooses its own)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return (Path(uri[len(prefix) :]).resolve().parent / "mlartifacts").as_uri()
    return None
