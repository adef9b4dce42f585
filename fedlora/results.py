"""The results contract (docs/design.md): ``DIR/results.json``, rewritten atomically after every round.

``rounds`` holds one object per round with at least ``round``, ``global_accuracy``,
``personalized_accuracy``, ``train_loss``, ``bytes_up``, ``bytes_down``, ``clients``,
``failures``, ``seconds`` and ``cpu_seconds``; ``final`` repeats the last evaluated round plus
``bytes_total``. ``wall_seconds`` / ``cpu_seconds`` at the top level cover the whole run, a resumed
run's earlier rounds included; ``machine`` (:func:`machine`) is the machine of the process that
wrote the file last.
Accuracy is a fraction in [0, 1]; bytes are the exact sizes of the arrays that crossed the wire.

A causal-LM run (``model.kind = 'causal_lm'``) has no accuracy (those fields stay null); it
reports ``global_rouge_l`` (ROUGE-L F1 of the global model's greedy generations on the global
test instructions), ``global_loss`` / ``global_perplexity`` (per response token), the personalised
``personalized_rouge_l`` (example-weighted over the clients' local tests) and its
``_unweighted`` / ``_worst`` / ``_p10``, ``personalized_loss`` / ``personalized_perplexity``
(token-weighted), ``validation_loss`` (which picks ``best_round``) and, on evaluation rounds,
``received_token_accuracy`` / ``received_loss`` (each sampled client's model as received, before
local training, on its local test split, teacher-forced; token-weighted). Its ``rounds`` start with
round 0: the zero-shot model (the initial adapter, B = 0) on the global test set.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from fedlora import state
from fedlora.schema import ExperimentConfig

PACKAGES = ("fedlora", "flwr", "torch", "peft", "transformers", "datasets", "flwr-datasets", "opacus", "rouge-score")


@state.register
@dataclass
class RoundRecord:
    """Everything measured in one federated round."""

    round: int
    global_accuracy: float = math.nan  # strategy's global model on the held-out global test set
    personalized_accuracy: float = math.nan  # example-weighted mean of clients' local test acc.
    personalized_accuracy_unweighted: float = math.nan  # plain mean over clients
    personalized_accuracy_worst: float = math.nan
    personalized_accuracy_p10: float = math.nan
    validation_accuracy: float = math.nan  # example-weighted mean on the clients' validation parts
    received_accuracy: float = math.nan  # sampled clients' received models on their local test, before training
    received_accuracy_unweighted: float = math.nan  # same, plain mean over clients
    received_token_accuracy: float = math.nan  # causal LM: the same received models, teacher-forced next-token accuracy
    received_loss: float = math.nan  # causal LM: their NLL per response token (both token-weighted over clients)
    train_loss: float = math.nan
    # causal LMs (model.kind = 'causal_lm'); NaN for classification
    global_rouge_l: float = math.nan  # global model's greedy generations on the global test set, ROUGE-L F1
    global_loss: float = math.nan  # global model's NLL per response token on the global test set
    global_perplexity: float = math.nan  # exp(global_loss)
    personalized_rouge_l: float = math.nan  # example-weighted mean of clients' local-test ROUGE-L
    personalized_rouge_l_unweighted: float = math.nan  # plain mean over clients
    personalized_rouge_l_worst: float = math.nan
    personalized_rouge_l_p10: float = math.nan
    personalized_loss: float = math.nan  # token-weighted NLL per response token over the clients' local tests
    personalized_perplexity: float = math.nan  # exp(personalized_loss)
    validation_loss: float = math.nan  # token-weighted NLL per response token on the clients' validation parts
    bytes_up: int = 0  # training uploads this round: the valid uploads' arrays (payload bytes)
    bytes_down: int = 0  # training downloads this round: the arrays sent (payload bytes)
    bytes_eval_down: int = 0  # arrays sent with evaluation messages (not training traffic)
    wire_bytes_up: int = 0  # every training reply as serialised (rejected and failed ones too)
    wire_bytes_down: int = 0  # every training message as serialised (arrays, config, metadata)
    wire_bytes_eval: int = 0  # evaluation messages and their replies as serialised
    sampled: int = 0  # clients sent a training message
    clients: int = 0  # successful training replies
    failures: int = 0  # sampled clients not aggregated: error replies, no reply (timeout), rejected updates
    rejected: int = 0  # replies refused by validation (strategies/replies.py), training and evaluation
    rejections: list[str] = field(default_factory=list)  # "client <k> (node <id>): <reason>" per rejection
    refused: list[int] = field(default_factory=list)  # partition ids refused (bad profile/update)
    # valid updates the anomaly rule flagged (strategies/anomaly.py: "client <k> (node <id>): <why>"),
    # aggregated (faults.anomaly_action = 'log') or also counted in rejected ('reject')
    anomalies: list[str] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the round (train + evaluation)
    # CPU time the server's process spent in the round, every thread: in the in-process engine that
    # includes each client's training and evaluation (what a run costs, however loaded the machine);
    # under Ray or in deployment the clients run elsewhere, so it is the server's share only
    cpu_seconds: float = 0.0
    client_train_seconds: float = 0.0  # summed local training time of the clients
    train_examples: int = 0  # examples processed by local training (with repetition)
    aggregation_seconds: float = 0.0  # server-side aggregation time
    per_client: dict[str, dict[str, float]] = field(default_factory=dict)  # partition id -> evaluation metrics
    per_client_train: dict[str, dict[str, Any]] = field(default_factory=dict)  # partition id -> its training reply
    extra: dict[str, Any] = field(default_factory=dict)  # strategy-specific (e.g. FedTreeLoRA cuts)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


@functools.lru_cache(maxsize=1)
def _cpu() -> tuple[tuple[str, Any], ...]:
    """The CPU part of :func:`machine`, read once per process (``/proc/cpuinfo`` does not change
    while it runs, and a results file is rewritten every round)."""
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    try:  # the first processor's block
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        first = ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    if fields.get("model name"):
        info["cpu"] = fields["model name"]
    if fields.get("vendor_id"):
        info["cpu_vendor"] = fields["vendor_id"]
    return tuple(info.items())


def machine() -> dict[str, Any]:
    """The machine this process runs on: the CPU's model and vendor (``/proc/cpuinfo``, where there
    is one), its logical cores, and the CUDA device when this process has initialised one. A record
    then says where its times were measured (CPU seconds of one run on two machines are not the
    same cost) and on which vendor's kernels its numbers were computed."""
    info = dict(_cpu())
    torch = sys.modules.get("torch")  # never imported here: only a process that already uses it
    if torch is not None and torch.cuda.is_initialized():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _clean(value: Any) -> Any:
    """JSON-safe: NaN -> None, numpy scalars -> Python."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ResultsWriter:
    """Collects round records and rewrites ``results.json`` after each one."""

    def __init__(self, config: ExperimentConfig, out_dir: str | Path, strategy_info: dict[str, Any] | None = None,
                 precision: str = "", id2label: dict[str, str] | None = None):
        self.config = config
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rounds: list[RoundRecord] = []
        self.strategy_info = strategy_info or {}
        self.privacy: dict[str, float] | None = None
        self.id2label = id2label or {}  # classification: class index -> class name (written as "id2label")
        # train.precision as resolved on the server's machine (in simulation, every client's): "fp32" / "bf16"
        self.precision = precision
        self.started = time.time()
        self.cpu_started = time.process_time()
        # a resumed run: the wall and CPU seconds of the rounds restored from its checkpoint
        self.earlier_seconds = 0.0
        self.earlier_cpu_seconds = 0.0

    @property
    def path(self) -> Path:
        return self.out_dir / "results.json"

    def restore(self, rounds: list[RoundRecord], privacy: dict[str, float] | None = None) -> None:
        """Continue a checkpointed run: its completed rounds, whose times count towards the run's,
        and the privacy spent in them."""
        self.rounds = list(rounds)
        self.privacy = privacy
        self.earlier_seconds = sum(r.seconds for r in self.rounds)
        self.earlier_cpu_seconds = sum(r.cpu_seconds for r in self.rounds)

    def add(self, record: RoundRecord) -> None:
        self.rounds.append(record)
        self.write()

    def final(self) -> dict[str, Any]:
        evaluated = [r for r in self.rounds if not (math.isnan(r.global_accuracy) and math.isnan(r.global_rouge_l))]
        evaluated = evaluated or self.rounds
        if not evaluated:
            return {}
        last = asdict(evaluated[-1])
        last["bytes_total"] = sum(r.bytes_up + r.bytes_down for r in self.rounds)
        last["wire_bytes_total"] = sum(r.wire_bytes_up + r.wire_bytes_down for r in self.rounds)
        last["bytes_up_total"] = sum(r.bytes_up for r in self.rounds)
        last["bytes_down_total"] = sum(r.bytes_down for r in self.rounds)
        last["failures_total"] = sum(r.failures for r in self.rounds)
        best = self.best_on_validation()
        if best is not None:
            last["best_round"] = best.round
            last["best_global_accuracy"] = best.global_accuracy
            last["best_personalized_accuracy"] = best.personalized_accuracy
            if not math.isnan(best.validation_loss):
                last["best_global_rouge_l"] = best.global_rouge_l
                last["best_personalized_rouge_l"] = best.personalized_rouge_l
        return last

    def best_on_validation(self) -> RoundRecord | None:
        """The round with the highest validation accuracy (a causal LM: the lowest validation loss);
        never chosen on test data."""
        scored = [r for r in self.rounds if not math.isnan(r.validation_accuracy)]
        if scored:
            return max(scored, key=lambda r: r.validation_accuracy)
        by_loss = [r for r in self.rounds if not math.isnan(r.validation_loss)]
        return min(by_loss, key=lambda r: r.validation_loss) if by_loss else None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "strategy": self.config.strategy.name,
            "config": self.config.model_dump(mode="json"),
            "config_hash": self.config.hash(),
            "versions": package_versions(),
            "machine": machine(),
            "strategy_info": self.strategy_info,
            **({"id2label": self.id2label} if self.id2label else {}),
            **({"precision": self.precision} if self.precision else {}),
            "rounds": [asdict(r) for r in self.rounds],
            "final": self.final(),
            # the whole run: this process's time plus, for a resumed run, its restored rounds' (the
            # setup before round 1 of an interrupted attempt is not counted)
            "wall_seconds": time.time() - self.started + self.earlier_seconds,
            "cpu_seconds": time.process_time() - self.cpu_started + self.earlier_cpu_seconds,
        }
        if self.privacy is not None:
            data["privacy"] = self.privacy
        cleaned: dict[str, Any] = _clean(data)
        return cleaned

    def write(self) -> None:
        """Atomic rewrite (write to a temporary file, then rename)."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, self.path)


def load_results(path: str | Path) -> dict[str, Any]:
    """Read a results.json (or the results.json inside a folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    results: dict[str, Any] = json.loads(path.read_text())
    return results


#: RoundRecord fields that are not one number per round: left out of :attr:`RunResults.per_round`
#: (the per-client entries are :attr:`RunResults.per_client`; ``extra``'s numbers are ``extra.<key>``)
NOT_SCALAR = ("per_client", "per_client_train", "extra", "rejections", "refused", "anomalies")


class RunResults(dict[str, Any]):
    """One run's results: the results.json dict itself (``results["final"]["global_accuracy"]``, as
    the contract in docs/design.md says), with its tables as pandas DataFrames for notebooks:
    :attr:`per_round` (a row per round) and :attr:`per_client` (a row per round and client), and
    :attr:`final` / :attr:`config` for the rest. ``fedlora.run`` returns one;
    :meth:`load` reads a finished (or running) run's folder. A notebook shows its final scores."""

    def __init__(self, results: dict[str, Any], out_dir: str | Path | None = None) -> None:
        super().__init__(results)
        self.out_dir = Path(out_dir) if out_dir is not None else None

    @classmethod
    def load(cls, path: str | Path) -> RunResults:
        """The results of the run in folder ``path`` (or of the results.json file ``path``)."""
        path = Path(path)
        return cls(load_results(path), path if path.is_dir() else path.parent)

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluated round plus the run's totals (results.json ``final``)."""
        final: dict[str, Any] = self.get("final") or {}
        return final

    @property
    def config(self) -> ExperimentConfig:
        """The run's resolved config (options added since the run was recorded: their old values)."""
        from fedlora.config import build_config
        from fedlora.schema import with_record_defaults

        return build_config(with_record_defaults(self.get("config") or {}))

    @property
    def per_round(self) -> Any:
        """A pandas DataFrame indexed by round: every one-number field of the rounds (NaN where a
        round did not measure it) and the numeric entries of their ``extra`` as ``extra.<key>``."""
        import pandas as pd

        rows = []
        for record in self.get("rounds") or []:
            row = {key: (math.nan if value is None else value) for key, value in record.items() if key not in NOT_SCALAR}
            extra = record.get("extra") or {}
            row |= {f"extra.{key}": value for key, value in extra.items()
                    if isinstance(value, (int, float)) and not isinstance(value, bool)}
            rows.append(row)
        return pd.DataFrame(rows).set_index("round") if rows else pd.DataFrame()

    @property
    def per_client(self) -> Any:
        """A pandas DataFrame with a row per round and client (``round``, ``client``: its partition
        id): the client's evaluation metrics (``accuracy``, ``loss``, ``num_examples``,
        ``val_accuracy``, ...) and its training reply as ``train.<key>`` (``train.loss``,
        ``train.examples``, ``train.update_norm``, ...); NaN where a round did not ask it."""
        import pandas as pd

        rows = []
        for record in self.get("rounds") or []:
            evaluated, trained = record.get("per_client") or {}, record.get("per_client_train") or {}
            for client in sorted(set(evaluated) | set(trained), key=int):
                row: dict[str, Any] = {"round": record["round"], "client": int(client)}
                row |= {key.replace("-", "_"): value for key, value in (evaluated.get(client) or {}).items()}
                row |= {f"train.{key.removeprefix('train_').replace('-', '_')}": value
                        for key, value in (trained.get(client) or {}).items()}
                rows.append(row)
        return pd.DataFrame(rows)

    def _repr_html_(self) -> str:
        import html

        final = self.final
        keys = [k for k in ("global_accuracy", "personalized_accuracy", "received_accuracy", "global_rouge_l",
                            "personalized_rouge_l", "global_perplexity") if isinstance(final.get(k), (int, float))]
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{final[k]:.4f}</td></tr>" for k in keys)
        where = f" in {html.escape(str(self.out_dir))}" if self.out_dir is not None else ""
        return (f"<p>{html.escape(str(self.get('strategy', '')))}: {len(self.get('rounds') or [])} rounds{where}; "
                f"final round {final.get('round', 'n/a')}</p><table>{cells}</table>"
                "<p><code>.per_round</code>, <code>.per_client</code>: the tables as pandas DataFrames</p>")
