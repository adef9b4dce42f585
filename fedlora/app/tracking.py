"""Experiment tracking where people look: TensorBoard event files and MLflow runs.

:class:`Tracker` receives every finished round (:meth:`Tracker.round`) and the finished run
(:meth:`Tracker.finish`) from the server loop, and forwards them to

- **TensorBoard** (``output.tensorboard``, on by default): one ``SummaryWriter`` on
  ``output.tensorboard_dir`` (default ``<output.dir>/tensorboard``). Scalars are grouped by tag
  prefix (``accuracy/``, ``loss/``, ``bytes/``, ``seconds/``, ``clients/``, ``client/<k>/``, and
  ``extra/<key>`` for every numeric entry of the round's ``extra``: the method's mechanism, e.g.
  FedPissa's relative correction), step = the round, and the resolved config is a text entry. A resumed run purges the events after the
  round it resumes from, so a crash never leaves two values for one round.
- **MLflow** (``output.mlflow_uri`` set): the resolved config flattened to params plus
  ``config_hash``, the same per-round metrics (step = the round), and at the end ``results.json``,
  the plots and the adapters as artifacts. A resumed run continues the same MLflow run (its id is
  kept in ``<output.dir>/mlflow_run.json``). For a ``sqlite:///`` store, artifacts go to a folder
  ``mlartifacts`` beside the database file, not into the working directory.

Both are fed from :class:`fedlora.results.RoundRecord`: the values are the ones in
``results.json``; NaN (a metric not measured that round) is skipped, never logged as 0.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedlora import protocol
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


def flat_params(config: ExperimentConfig) -> dict[str, str]:
    """The resolved config as dotted keys (``train.lr``) -> string values, plus ``config_hash``."""
    params: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            params[prefix] = json.dumps(value) if isinstance(value, (list, dict)) else str(value)

    walk("", config.model_dump(mode="json"))
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
        if config.output.mlflow_uri:
            self._start_mlflow(first_round)

    def _start_mlflow(self, first_round: int) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            from fedlora.errors import ConfigError

            raise ConfigError(
                "output.mlflow_uri is set but MLflow is not installed: pip install 'fedlora[tracking]'"
            ) from exc
        uri = self.config.output.mlflow_uri
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

    def finish(self, ok: bool = True) -> None:
        """Close the event file; upload results, plots and adapters to MLflow and end its run
        (``FAILED`` when ``ok`` is false, so a later resume can finish it)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
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


def artifact_location(uri: str) -> str | None:
    """A new experiment's artifact folder: beside the database for ``sqlite:///PATH``; otherwise
    MLflow's (a tracking server chooses its own)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        return (Path(uri[len(prefix) :]).resolve().parent / "mlartifacts").as_uri()
    return None
