"""The Flower protocol shared by every fedlora strategy.

:class:`LoRAStrategy` implements Flower's Message-API ``Strategy`` hooks once (sampling, one
message per client, reply checking, byte accounting, personalised evaluation); a method subclass
only says what goes down to a client (:meth:`download`), what it expects back
(:meth:`expected_upload`), how uploads are aggregated (:meth:`aggregate`) and what its global
model is (:meth:`global_payload`). Its options and capabilities come from its home
(``fedlora/methods/<name>.py``, ``method = METHOD``). Every hook speaks partition ids; node ids
stay in :class:`~strategies.roster.ClientRoster`. Every message is built fresh per client, so
per-client payloads (mixed ranks, personalised factors) never share a RecordDict.

The parts that are not the protocol live beside it: who takes part (``roster.py``), the defence
against bad updates (``validation.py``), the privacy ledger (``ledger.py``).
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from fedlora import protocol
from fedlora.lora import (
    A_SUFFIX,
    B_SUFFIX,
    Payload,
    from_array_record,
    head_only,
    normalise,
    payload_bytes,
    to_array_record,
    weighted_average,
)
from fedlora.methods import Capabilities, Method
from fedlora.profile import ClientProfile
from fedlora.protocol import Phase, number, wire_size
from fedlora.results import RoundRecord
from fedlora.schema import ExperimentConfig
from strategies.ledger import PrivacyLedger
from strategies.roster import ClientRoster
from strategies.validation import check_upload, norm_outliers

InitialAdapter = Callable[[int], Payload]  # rank -> the common, seeded initial adapter


class RoundFailedError(RuntimeError):
    """Too many consecutive rounds without enough valid updates (faults.max_failed_rounds)."""


@dataclass
class ClientUpload:
    """One valid training reply."""

    partition_id: int
    payload: Payload
    num_examples: int
    metrics: dict[str, float]


@dataclass
class RunPaths:
    """Where the ServerApp keeps a run's files (set once before the first round)."""

    adapter_dir: str = ""  # personalised adapters are saved there by the clients
    checkpoint_dir: str = ""  # clients keep their state there (simulation: one file system)
    state_on_disk: bool = False  # simulation: clients keep their state only there between messages
    resumed_from: int = 0  # > 0: a resumed run, clients restore their state of this round


class LoRAStrategy(Strategy):
    """Base class of fedlora's aggregation strategies (see the module docstring).

    Parameters
    ----------
    experiment : ExperimentConfig
        The resolved experiment; ``experiment.strategy`` holds this method's options.
    initial_adapter : Callable[[int], Payload]
        Returns the common seeded initial adapter (LoRA factors + head) at a given rank.
    module_shapes : dict[str, tuple[int, int]]
        (d_out, d_in) of every adapted module, used to check ranks and upload shapes.
    """

    method: ClassVar[Method]  # the method's home declaration (name, options, capabilities)
    name: ClassVar[str] = ""  # set from ``method`` by __init_subclass__
    capabilities: ClassVar[Capabilities]

    # Attributes rebuilt on every run (from the config, the models and the query), never checkpointed.
    NOT_STATE: ClassVar[frozenset[str]] = frozenset({
        "experiment", "options", "initial_adapter", "module_shapes", "roster", "paths", "_experiment_json",
    })

    def __init__(
        self,
        experiment: ExperimentConfig,
        initial_adapter: InitialAdapter,
        module_shapes: dict[str, tuple[int, int]],
    ) -> None:
        self.experiment = experiment
        self.options = self.method.parse(experiment)
        self.initial_adapter = initial_adapter
        self.module_shapes = module_shapes
        self.roster = ClientRoster()
        self.paths = RunPaths()
        self.ledger = PrivacyLedger()
        self.records: dict[int, RoundRecord] = {}
        self.started: dict[int, float] = {}
        self.rng = np.random.default_rng(experiment.train.seed)  # the client sampler
        self.failed_rounds = 0  # consecutive rounds with too few valid updates
        self.common_rank = 0  # > 0: a same-rank method runs every client at this rank
        self._experiment_json = experiment.to_json()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "method" in cls.__dict__:
            cls.name = cls.method.name
            cls.capabilities = cls.method.capabilities

    # ---------------------------------------------------------------- method interface
    def check_profile(self, profile: ClientProfile) -> str:
        """Why a client cannot take part ('' if it can)."""
        max_rank = min(min(shape) for shape in self.module_shapes.values())
        if not 1 <= profile.rank <= max_rank:
            return f"unsupported rank {profile.rank} (must be in [1, {max_rank}] for this model)"
        return ""

    def setup(self) -> None:
        """Called once after the profiles are known (e.g. to build per-client state)."""

    def rank_of(self, partition: int) -> int:
        """The LoRA rank client ``partition`` trains at (sent as ``lora-rank`` in every message)."""
        return self.roster.rank(partition)

    @abstractmethod
    def download(self, partition: int, server_round: int, phase: Phase) -> Payload:
        """Arrays sent to client ``partition`` for ``phase`` in ``server_round``."""

    def client_config(self, partition: int, server_round: int, phase: Phase) -> dict[str, Any]:
        """Extra config entries for client ``partition`` (Flower scalars), built right after its download."""
        return {}

    def observe_reply(self, partition: int, metrics: Mapping[str, float]) -> None:
        """See a training reply's metrics before its upload is checked against
        :meth:`expected_upload` (e.g. HetLoRA's self-pruned rank); default: nothing."""

    def expected_upload(self, partition: int, server_round: int) -> dict[str, tuple[int, ...]]:
        """Key -> shape of the arrays client ``partition`` must upload (default: A, B and the head)."""
        return self.lora_shapes(self.rank_of(partition), send_A=True, send_B=True)

    @abstractmethod
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        """Fold the round's valid uploads into the strategy's state."""

    @abstractmethod
    def global_payload(self) -> Payload | None:
        """The method's single global adapter, evaluated on the global test set (None: none)."""

    def sample_train(self, server_round: int) -> list[int]:
        """The partitions that train in ``server_round`` (default: a seeded fraction_train sample)."""
        return self.sample(self.experiment.federation.fraction_train)

    def min_uploads(self) -> int:
        """Fewest valid uploads a round needs to aggregate (``federation.min_clients``)."""
        return self.experiment.federation.min_clients

    def round_extra(self, server_round: int) -> dict[str, Any]:
        """Strategy-specific facts to store in the round's results (e.g. FedTreeLoRA's cuts)."""
        return {}

    def model_init(self) -> str | None:
        """The LoRA init the server's models use when the method overrides ``model.init`` (e.g.
        FedPissa's ``strategy.init``; its client trainer builds with the same); None: model.init."""
        return None

    def save_artifacts(self, out_dir: Path) -> dict[str, Any]:
        """Write method-specific files (e.g. plots) into the run's output folder at the end of a
        run; return facts to merge into the results' strategy info. Default: nothing."""
        return {}

    # ---------------------------------------------------------------- state (checkpoints)
    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy learned: ``vars(self)`` minus :attr:`NOT_STATE` (per-client
        entries are keyed by partition id, so a resumed run's new node ids do not matter)."""
        return {key: value for key, value in vars(self).items() if key not in self.NOT_STATE and not callable(value)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after this run's query."""
        for key, value in state.items():
            setattr(self, key, value)

    # ---------------------------------------------------------------- helpers for subclasses
    def lora_shapes(self, rank: int, send_A: bool, send_B: bool, head: bool = True) -> dict[str, tuple[int, ...]]:
        """Shapes of a rank-``rank`` adapter (optionally only A or only B, with or without head)."""
        shapes: dict[str, tuple[int, ...]] = {}
        for module, (d_out, d_in) in self.module_shapes.items():
            if send_A:
                shapes[module + A_SUFFIX] = (rank, d_in)
            if send_B:
                shapes[module + B_SUFFIX] = (d_out, rank)
        if head and self.sends_head:
            shapes.update({k: tuple(v.shape) for k, v in self.head_initial.items()})
        return shapes

    @property
    def sends_head(self) -> bool:
        """Whether a classification head travels (a causal LM has none: its LM head stays frozen)."""
        return self.experiment.model.head == "global" and self.experiment.model.kind == "classification"

    @property
    def head_initial(self) -> Payload:
        return head_only(self.initial_adapter(self.experiment.model.lora_rank))

    def initial_head(self) -> Payload:
        """The head a method starts from: the seeded initial head when it is global, else nothing."""
        return dict(self.head_initial) if self.sends_head else {}

    def averaged_head(self, uploads: list[ClientUpload], weights: Any, previous: Payload) -> Payload:
        """FedAvg of the uploads' head arrays when the head is global (``previous`` otherwise)."""
        if not self.sends_head:
            return previous
        return weighted_average([head_only(u.payload) for u in uploads], weights)

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        """p_k = n_k / sum n over this round's uploads."""
        return normalise([u.num_examples for u in uploads])

    def sample(self, fraction: float) -> list[int]:
        """Seeded sample of accepted partitions (Flower's sample_nodes uses the global RNG)."""
        partitions = self.roster.partitions
        size = min(len(partitions), max(self.experiment.federation.min_clients, round(fraction * len(partitions))))
        chosen = self.rng.choice(len(partitions), size=size, replace=False)
        return [partitions[i] for i in sorted(chosen)]

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` is an evaluation round (every k rounds, and the last)."""
        every = self.experiment.federation.evaluate_every
        return server_round % every == 0 or server_round >= self.experiment.train.rounds

    # ---------------------------------------------------------------- Flower hooks
    def connect(self, grid: Grid) -> None:
        """Query the clients' profiles once, settle one rank for a same-rank method, set up."""
        if self.roster:
            return
        self.roster.query(grid, self._experiment_json, self.experiment.data.num_clients,
                          self.experiment.federation.round_timeout, self.check_profile)
        if not self.capabilities.mixed_ranks:
            refuse = self.experiment.clients.mixed_rank_policy == "refuse"
            self.common_rank = self.roster.settle_common_rank(refuse, self.name)
        self.setup()

    def summary(self) -> None:
        log(INFO, "\t├── %s (%s)", type(self).__name__, self.capabilities.paper)
        for key, value in self.options.model_dump().items():
            log(INFO, "\t├── %s: %s", key, value)

    def configure_train(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Query profiles once, sample clients, build one message per client."""
        self.connect(grid)
        self.roster.refresh(grid, self._experiment_json, self.experiment.federation.round_timeout)
        record = self.record(server_round)
        record.refused = sorted(self.roster.refused_partitions)
        partitions = self.sample_train(server_round)
        messages = []
        for partition in partitions:
            payload = self.download(partition, server_round, "train")
            record.bytes_down += payload_bytes(payload)
            messages.append(self._message(partition, server_round, payload, "train"))
            record.wire_bytes_down += wire_size(messages[-1])
        record.sampled = len(messages)
        log(INFO, "configure_train: round %d, %d of %d clients", server_round, len(partitions), len(self.roster.profiles))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, MetricRecord | None]:
        """Check replies, count bytes and failures, aggregate the valid uploads."""
        record = self.record(server_round)
        replies = list(replies)
        record.wire_bytes_up += sum(wire_size(reply) for reply in replies)
        missing = max(record.sampled - len(replies), 0)  # no reply before federation.round_timeout
        if missing:
            record.failures += missing
            log(WARNING, "aggregate_train: %d of %d sampled clients did not reply within federation.round_timeout",
                missing, record.sampled)
        self.ledger.note(replies, record)
        uploads = self._valid_uploads(replies, server_round, record)
        record.clients = len(uploads)
        record.bytes_up = sum(payload_bytes(u.payload) for u in uploads)
        if uploads:
            _note_received(uploads, record)
            record.train_loss = float(np.average([u.metrics.get(protocol.TRAIN_LOSS, math.nan) for u in uploads],
                                                 weights=self.weights(uploads)))
            record.client_train_seconds = float(sum(u.metrics.get(protocol.TRAIN_SECONDS, 0.0) for u in uploads))
            record.train_examples = int(sum(u.metrics.get(protocol.TRAIN_EXAMPLES, 0.0) for u in uploads))
        log(INFO, "aggregate_train: %d replies, %d failures", len(uploads), record.failures)
        if len(uploads) < self.min_uploads():
            self.failed_rounds += 1
            message = f"round {server_round}: {len(uploads)} valid updates < federation.min_clients={self.min_uploads()}"
            if self.failed_rounds >= self.experiment.faults.max_failed_rounds:
                raise RoundFailedError(f"{message}, {self.failed_rounds} rounds in a row "
                                       f"(faults.max_failed_rounds); stopping the run")
            log(WARNING, "aggregate_train: %s: state unchanged, the next round retries", message)
            return None, None
        self.failed_rounds = 0
        started = time.perf_counter()
        self.aggregate(server_round, uploads)
        record.aggregation_seconds = time.perf_counter() - started
        record.extra.update(self.round_extra(server_round))
        metrics = MetricRecord({"train-loss": record.train_loss, "clients": len(uploads)})
        return None, metrics  # state lives in the strategy; global_payload() exposes the model

    def configure_evaluate(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Personalised evaluation: each sampled client tests its own model on its local split."""
        fraction = self.experiment.federation.fraction_evaluate
        if fraction == 0.0 or not self.roster or not self.evaluates(server_round):
            return []
        record = self.record(server_round)
        messages = []
        for partition in self.sample(fraction):
            payload = self.download(partition, server_round + 1, "evaluate")
            record.bytes_eval_down += payload_bytes(payload)
            messages.append(self._message(partition, server_round, payload, "evaluate"))
            record.wire_bytes_eval += wire_size(messages[-1])
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted and unweighted means, worst client and 10th percentile."""
        record = self.record(server_round)
        rows = []
        replies = list(replies)
        record.wire_bytes_eval += sum(wire_size(reply) for reply in replies)
        for msg in replies:
            if msg.has_error():
                log(WARNING, "aggregate_evaluate: node %d failed: %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            metrics = {k: number(v) for k, v in msg.content.metric_records["metrics"].items()}
            rows.append(metrics)
            record.per_client[str(int(metrics[protocol.PARTITION_ID]))] = {k: float(v) for k, v in metrics.items()}
        if not rows:
            return None
        if self.experiment.model.kind == "causal_lm":
            return self._aggregate_generation(record, rows)
        accuracy = np.array([r["accuracy"] for r in rows])
        examples = np.array([r[protocol.NUM_EXAMPLES] for r in rows], dtype=float)
        record.personalized_accuracy = float(np.average(accuracy, weights=examples))
        record.personalized_accuracy_unweighted = float(accuracy.mean())
        record.personalized_accuracy_worst = float(accuracy.min())
        record.personalized_accuracy_p10 = float(np.percentile(accuracy, 10))
        if all("val-accuracy" in r for r in rows):
            val_examples = np.array([max(r.get("val-examples", 1.0), 1.0) for r in rows])
            record.validation_accuracy = float(np.average([r["val-accuracy"] for r in rows], weights=val_examples))
        if all("global-accuracy" in r for r in rows) and self.global_payload() is None:
            record.global_accuracy = float(np.average([r["global-accuracy"] for r in rows], weights=examples))
        return MetricRecord({"personalized-accuracy": record.personalized_accuracy})

    def _aggregate_generation(self, record: RoundRecord, rows: list[dict[str, float]]) -> MetricRecord:
        """A causal LM's personalised evaluation: ROUGE-L example-weighted (by the examples each
        client scored) and unweighted, worst, p10; loss and perplexity token-weighted."""
        rouge = np.array([r["rouge-l"] for r in rows])
        scored = np.array([max(r.get("rouge-examples", 1.0), 1.0) for r in rows])
        record.personalized_rouge_l = float(np.average(rouge, weights=scored))
        record.personalized_rouge_l_unweighted = float(rouge.mean())
        record.personalized_rouge_l_worst = float(rouge.min())
        record.personalized_rouge_l_p10 = float(np.percentile(rouge, 10))
        record.personalized_loss = _token_mean(rows, "loss", "tokens")
        record.personalized_perplexity = math.exp(min(record.personalized_loss, 700.0))
        if all("val-loss" in r for r in rows):
            record.validation_loss = _token_mean(rows, "val-loss", "val-tokens")
        if all("global-rouge-l" in r for r in rows) and self.global_payload() is None:
            examples = np.array([max(r.get(protocol.NUM_EXAMPLES, 1.0), 1.0) for r in rows])
            record.global_rouge_l = float(np.average([r["global-rouge-l"] for r in rows], weights=examples))
            record.global_loss = float(np.average([r["global-loss"] for r in rows], weights=examples))
            record.global_perplexity = math.exp(min(record.global_loss, 700.0))
        return MetricRecord({"personalized-rouge-l": record.personalized_rouge_l})

    # ---------------------------------------------------------------- results
    def record(self, server_round: int) -> RoundRecord:
        """The round's record (created, and its clock started, on first use)."""
        if server_round not in self.records:
            self.records[server_round] = RoundRecord(round=server_round)
            self.started[server_round] = time.perf_counter()
        return self.records[server_round]

    def finish_round(self, server_round: int) -> RoundRecord:
        """The round's record, with its wall time; called by the ServerApp after evaluation."""
        record = self.record(server_round)
        record.seconds = time.perf_counter() - self.started[server_round]
        return record

    def privacy_report(self) -> dict[str, Any] | None:
        return self.ledger.report(self.experiment.privacy)

    # ---------------------------------------------------------------- internals
    def _message(self, partition: int, server_round: int, payload: Payload, phase: Phase) -> Message:
        config = ConfigRecord({
            protocol.SERVER_ROUND: server_round,
            protocol.EXPERIMENT: self._experiment_json,
            protocol.RANK: self.rank_of(partition),
            **self.client_config(partition, server_round, phase),
        })
        if self.paths.checkpoint_dir:
            config[protocol.CHECKPOINT_DIR] = self.paths.checkpoint_dir
            if self.paths.state_on_disk:
                config[protocol.STATE_ON_DISK] = True
        if self.paths.resumed_from:
            config[protocol.RESUME_ROUND] = self.paths.resumed_from
        if phase == "train" and self.evaluates(server_round):
            config[protocol.EVAL_RECEIVED] = True
        if phase == "evaluate":
            config[protocol.EVAL_GLOBAL] = self.global_payload() is None
            if self.paths.adapter_dir and self.capabilities.personalized and server_round >= self.experiment.train.rounds:
                config[protocol.SAVE_ADAPTER_DIR] = self.paths.adapter_dir
        message_type = MessageType.TRAIN if phase == "train" else MessageType.EVALUATE
        content = RecordDict({"arrays": to_array_record(payload), "config": config})
        return Message(content=content, dst_node_id=self.roster.node_of[partition], message_type=message_type)

    def _valid_uploads(self, replies: Iterable[Message], server_round: int, record: RoundRecord) -> list[ClientUpload]:
        uploads = []
        for msg in replies:
            if msg.has_error():
                record.failures += 1
                log(WARNING, "aggregate_train: node %d failed: %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            partition = self.roster.partition_of(msg.metadata.src_node_id)
            payload = from_array_record(msg.content.array_records["arrays"])
            metrics = {k: number(v) for k, v in msg.content.metric_records["metrics"].items()}
            self.observe_reply(partition, metrics)
            problem = check_upload(payload, self.expected_upload(partition, server_round))
            if problem:
                _reject(record, partition, problem)
                continue
            uploads.append(ClientUpload(partition, payload, int(metrics[protocol.NUM_EXAMPLES]), metrics))
            worker = msg.content.config_records.get(protocol.WORKER)
            record.per_client_train[str(partition)] = {
                "train_loss": metrics.get(protocol.TRAIN_LOSS), "train_seconds": metrics.get(protocol.TRAIN_SECONDS),
                "examples": metrics.get(protocol.TRAIN_EXAMPLES), **({k: str(v) for k, v in worker.items()} if worker else {}),
            }
        uploads.sort(key=lambda u: u.partition_id)
        outliers = norm_outliers([u.payload for u in uploads], self.experiment.faults)
        for index, reason in outliers.items():
            _reject(record, uploads[index].partition_id, reason)
        return [u for i, u in enumerate(uploads) if i not in outliers]


def _token_mean(rows: list[dict[str, float]], key: str, tokens: str) -> float:
    """The token-weighted mean of a per-token loss over clients (nan when no client has tokens)."""
    weights = np.array([r.get(tokens, 0.0) for r in rows], dtype=float)
    if weights.sum() <= 0:
        return math.nan
    return float(np.average([r[key] for r in rows], weights=weights))


def _reject(record: RoundRecord, partition: int, reason: str) -> None:
    record.failures += 1
    record.rejected += 1
    record.rejections.append(f"client {partition}: {reason}")
    log(WARNING, "aggregate_train: rejecting update of client %d: %s", partition, reason)


def _note_received(uploads: list[ClientUpload], record: RoundRecord) -> None:
    """Received accuracy: each sampled client's model as it received it (the download overlaid on
    its kept state; FedHera's tail scaled by lambda), on its local test split, before local
    training (FedHera's official metric; evaluation rounds only). A causal LM's is teacher-forced:
    token accuracy and loss per response token, token-weighted over the clients."""
    scored = [u.metrics for u in uploads if protocol.RECEIVED_TOKEN_ACCURACY in u.metrics]
    if scored:
        tokens = np.array([r[protocol.RECEIVED_TOKENS] for r in scored])
        record.received_token_accuracy = float(np.average([r[protocol.RECEIVED_TOKEN_ACCURACY] for r in scored], weights=tokens))
        record.received_loss = float(np.average([r[protocol.RECEIVED_LOSS] for r in scored], weights=tokens))
    rows = [u.metrics for u in uploads if protocol.RECEIVED_ACCURACY in u.metrics]
    if not rows:
        return
    accuracy = np.array([r[protocol.RECEIVED_ACCURACY] for r in rows])
    examples = np.array([max(r.get(protocol.RECEIVED_EXAMPLES, 1.0), 1.0) for r in rows])
    record.received_accuracy = float(np.average(accuracy, weights=examples))
    record.received_accuracy_unweighted = float(accuracy.mean())
