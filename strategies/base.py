"""The Flower protocol shared by every fedlora strategy.

:class:`LoRAStrategy` implements Flower's Message-API ``Strategy`` hooks once (query, sampling,
per-node messages, reply checking, byte accounting, personalised evaluation); a method subclass
only says what goes down to a client (:meth:`download`), what it expects back
(:meth:`expected_upload`), how uploads are aggregated (:meth:`aggregate`) and what its global
model is (:meth:`global_payload`). Every message is built fresh per node, so per-client payloads
(mixed ranks, personalised factors) never share a RecordDict.

Wire format: a training message carries ``arrays`` (the payload as an ArrayRecord) and ``config``
(``server-round``, ``experiment`` = the resolved config as JSON, plus method keys from
:meth:`client_config`); the reply carries ``arrays`` (the upload) and ``metrics`` with at least
``num-examples``, ``train-loss``, ``partition-id`` and ``train-seconds``.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log
from pydantic import BaseModel, ConfigDict

from fedlora.config import ExperimentConfig
from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload, from_array_record, payload_bytes, to_array_record
from fedlora.profile import ClientProfile
from fedlora.results import RoundRecord

InitialAdapter = Callable[[int], Payload]  # rank -> the common, seeded initial adapter
EVAL_RECEIVED = "eval-received"  # train config: evaluate the received model before local training
RECEIVED_ACCURACY = "received-accuracy"  # train reply metrics: that accuracy, and its test examples
RECEIVED_EXAMPLES = "received-examples"


class RoundFailedError(RuntimeError):
    """Too many consecutive rounds without enough valid updates (faults.max_failed_rounds)."""


class StrategyOptions(BaseModel):
    """Options common to every strategy (none yet); subclasses add theirs."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class ClientUpload:
    """One valid training reply."""

    node_id: int
    partition_id: int
    payload: Payload
    num_examples: int
    metrics: dict[str, float]


@dataclass
class Capabilities:
    """What a strategy declares about itself (rendered into the README's capability matrix)."""

    personalized: bool
    uploads: str
    downloads: str
    mixed_ranks: bool = False
    partial_participation: bool = True
    dp_compatible: bool = True
    deployment_tested: bool = False  # exercised over real gRPC SuperLink/SuperNodes in tests
    paper: str = ""


@dataclass
class _RoundBook:
    record: RoundRecord
    started: float = field(default_factory=time.perf_counter)


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

    name: ClassVar[str] = ""
    Options: ClassVar[type[StrategyOptions]] = StrategyOptions
    capabilities: ClassVar[Capabilities]

    def __init__(
        self,
        experiment: ExperimentConfig,
        initial_adapter: InitialAdapter,
        module_shapes: dict[str, tuple[int, int]],
    ) -> None:
        self.experiment = experiment
        self.options = self.Options(**experiment.strategy.options())
        self.initial_adapter = initial_adapter
        self.module_shapes = module_shapes
        self.profiles: dict[int, ClientProfile] = {}  # node id -> profile (accepted nodes only)
        self.refused: dict[int, str] = {}  # node id -> reason
        self.books: dict[int, _RoundBook] = {}
        self.rng = np.random.default_rng(experiment.train.seed)
        self._experiment_json = experiment.to_json()
        self.adapter_dir = ""  # set by the ServerApp: personalised adapters are saved there
        self.failed_rounds = 0  # consecutive rounds with too few valid updates
        self.common_rank = 0  # > 0: a same-rank method runs every client at this rank
        self.checkpoint_dir = ""  # set by the ServerApp: clients write their kept state there
        self.resumed_from = 0  # > 0: resumed after this round; clients restore their state
        self.dp_epsilon: dict[int, float] = {}  # partition id -> its DP epsilon so far (privacy.dp)

    # ---------------------------------------------------------------- method interface
    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        """Reject experiments this method cannot run (raise ConfigError); default: accept."""

    def setup(self) -> None:
        """Called once after the profiles are known (e.g. to build per-client state)."""

    @abstractmethod
    def download(self, node_id: int, server_round: int) -> Payload:
        """Arrays sent to ``node_id`` for training (and evaluation) in ``server_round``."""

    def observe_reply(self, node_id: int, metrics: Mapping[str, float]) -> None:
        """See a training reply's metrics before its upload is checked against
        :meth:`expected_upload` (e.g. HetLoRA's self-pruned rank); default: nothing."""

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        """Key -> shape of the arrays ``node_id`` must upload (default: A, B and the head)."""
        return self.lora_shapes(self.profiles[node_id].rank, send_A=True, send_B=True)

    @abstractmethod
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        """Fold the round's valid uploads into the strategy's state."""

    @abstractmethod
    def global_payload(self) -> Payload | None:
        """The method's single global adapter, evaluated on the global test set (None: none)."""

    def client_config(self, node_id: int, server_round: int) -> dict[str, Any]:
        """Extra config entries for ``node_id`` (e.g. its rank); values must be Flower scalars."""
        return {}

    def sample_train(self, server_round: int) -> list[int]:
        """The nodes that train in ``server_round`` (default: a seeded fraction_train sample)."""
        return self._sample(self.experiment.federation.fraction_train)

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

    # ---------------------------------------------------------------- privacy
    def _note_privacy(self, replies: list[Message], record: RoundRecord) -> None:
        """Each replying client's accountant epsilon (it spent it even if its update is rejected)."""
        spent = {}
        for msg in replies:
            if msg.has_error() or "metrics" not in msg.content:
                continue
            metrics = msg.content["metrics"]
            if "dp-epsilon" in metrics and "partition-id" in metrics:
                spent[int(metrics["partition-id"])] = float(metrics["dp-epsilon"])
        if spent:
            self.dp_epsilon.update(spent)
            record.extra["dp_epsilon"] = {str(k): v for k, v in sorted(spent.items())}

    def privacy_report(self) -> dict[str, Any] | None:
        """``{"epsilon": max over clients, "delta", "per_client"}`` when privacy.dp is on."""
        privacy = self.experiment.privacy
        if not privacy.dp:
            return None
        return {"epsilon": max(self.dp_epsilon.values(), default=0.0), "delta": privacy.delta,
                "per_client": {str(k): v for k, v in sorted(self.dp_epsilon.items())},
                "noise_multiplier": privacy.noise_multiplier, "target_epsilon": privacy.target_epsilon,
                "max_grad_norm": privacy.max_grad_norm}

    # ---------------------------------------------------------------- checkpoint / resume
    # Attributes rebuilt on every run (from the config, the models and the profile query).
    NOT_STATE: ClassVar[frozenset[str]] = frozenset({
        "experiment", "options", "initial_adapter", "module_shapes", "profiles", "refused",
        "_experiment_json", "adapter_dir", "checkpoint_dir", "resumed_from",
    })

    def state_dict(self) -> dict[str, Any]:
        """Everything the strategy learned, picklable and independent of Flower's node ids (which
        are random per run): ``vars(self)`` minus :attr:`NOT_STATE`, with every dict keyed by node
        id (or by ``(node id, ...)`` tuples) re-keyed by partition id."""
        to_partition = {node: p.partition_id for node, p in self.profiles.items()}
        return {key: _rekey(value, to_partition) for key, value in vars(self).items()
                if key not in self.NOT_STATE and not callable(value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after this run's profile query (partition ids -> node ids)."""
        to_node = {p.partition_id: node for node, p in self.profiles.items()}
        missing = sorted(set(_partitions_in(state)) - set(to_node))
        if missing:
            raise RuntimeError(f"resume: clients {missing} of the checkpoint did not join this run")
        for key, value in state.items():
            setattr(self, key, _rekey_back(value, to_node))

    def run_rounds(self, grid: Grid, first: int, last: int, evaluate_fn: Callable[[int, Any], Any] | None = None) -> None:
        """Flower's ``Strategy.start`` loop for rounds ``first``..``last`` (start always begins at
        round 1; a resumed run continues at ``k + 1``): configure_train -> send_and_receive ->
        aggregate_train -> configure_evaluate -> send_and_receive -> aggregate_evaluate ->
        evaluate_fn."""
        from flwr.app import ArrayRecord

        arrays, timeout = ArrayRecord(), self.experiment.federation.round_timeout
        if first == 1:
            self.summary()
        for server_round in range(first, last + 1):
            log(INFO, "[ROUND %s/%s]", server_round, last)
            replies = grid.send_and_receive(
                messages=self.configure_train(server_round, arrays, ConfigRecord(), grid), timeout=timeout
            )
            self.aggregate_train(server_round, replies)
            replies = grid.send_and_receive(
                messages=self.configure_evaluate(server_round, arrays, ConfigRecord(), grid), timeout=timeout
            )
            self.aggregate_evaluate(server_round, replies)
            if evaluate_fn is not None:
                evaluate_fn(server_round, arrays)

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
        return self.experiment.model.head == "global"

    @property
    def head_initial(self) -> Payload:
        from fedlora.lora import head_only

        return head_only(self.initial_adapter(self.experiment.model.lora_rank))

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        """p_k = n_k / sum n over this round's uploads."""
        from fedlora.lora import normalise

        return normalise([u.num_examples for u in uploads])

    def partition_of(self, node_id: int) -> int:
        return self.profiles[node_id].partition_id

    # ---------------------------------------------------------------- Flower hooks
    def summary(self) -> None:
        log(INFO, "\t├── %s (%s)", type(self).__name__, self.capabilities.paper)
        for key, value in self.options.model_dump().items():
            log(INFO, "\t├── %s: %s", key, value)

    def configure_train(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Query profiles once, sample clients, build one message per node."""
        self._ensure_profiles(grid)
        book = self.books.setdefault(server_round, _RoundBook(RoundRecord(round=server_round)))
        book.record.refused = sorted(self.refused_partitions())
        nodes = self.sample_train(server_round)
        messages = []
        for node_id in nodes:
            payload = self.download(node_id, server_round)
            book.record.bytes_down += payload_bytes(payload)
            messages.append(self._message(node_id, server_round, payload, MessageType.TRAIN))
        log(INFO, "configure_train: round %d, %d of %d clients", server_round, len(nodes), len(self.profiles))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[Any, MetricRecord | None]:
        """Check replies, count bytes and failures, aggregate the valid uploads."""
        book = self.books[server_round]
        replies = list(replies)
        self._note_privacy(replies, book.record)
        uploads = self._valid_uploads(replies, book.record)
        book.record.clients = len(uploads)
        book.record.bytes_up = sum(payload_bytes(u.payload) for u in uploads)
        if uploads:
            self._note_received(uploads, book.record)
            book.record.train_loss = float(np.average([u.metrics.get("train-loss", math.nan) for u in uploads], weights=self.weights(uploads)))
            book.record.client_train_seconds = float(sum(u.metrics.get("train-seconds", 0.0) for u in uploads))
            book.record.train_examples = int(sum(u.metrics.get("train-examples", 0.0) for u in uploads))
        log(INFO, "aggregate_train: %d replies, %d failures", len(uploads), book.record.failures)
        if len(uploads) < self.min_uploads():
            self.failed_rounds += 1
            message = (f"round {server_round}: {len(uploads)} valid updates < federation.min_clients="
                       f"{self.min_uploads()}")
            if self.failed_rounds >= self.experiment.faults.max_failed_rounds:
                raise RoundFailedError(f"{message}, {self.failed_rounds} rounds in a row "
                                       f"(faults.max_failed_rounds); stopping the run")
            log(WARNING, "aggregate_train: %s: state unchanged, the next round retries", message)
            return None, None
        self.failed_rounds = 0
        started = time.perf_counter()
        self.aggregate(server_round, uploads)
        book.record.aggregation_seconds = time.perf_counter() - started
        book.record.extra.update(self.round_extra(server_round))
        metrics = MetricRecord({"train-loss": book.record.train_loss, "clients": len(uploads)})
        return None, metrics  # state lives in the strategy; global_payload() exposes the model

    def configure_evaluate(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Personalised evaluation: each sampled client tests its own model on its local split."""
        fraction = self.experiment.federation.fraction_evaluate
        if fraction == 0.0 or not self.profiles or not self.evaluates(server_round):
            return []
        book = self.books.setdefault(server_round, _RoundBook(RoundRecord(round=server_round)))
        messages = []
        for node_id in self._sample(fraction):
            payload = self.download(node_id, server_round + 1)
            book.record.bytes_eval_down += payload_bytes(payload)
            messages.append(self._message(node_id, server_round, payload, MessageType.EVALUATE))
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted and unweighted means, worst client and 10th percentile."""
        record = self.books[server_round].record
        rows = []
        for msg in replies:
            if msg.has_error():
                log(WARNING, "aggregate_evaluate: node %d failed: %s", msg.metadata.src_node_id, msg.error.reason)
                continue
            metrics = dict(msg.content["metrics"])
            rows.append(metrics)
            record.per_client[str(int(metrics["partition-id"]))] = {k: float(v) for k, v in metrics.items()}
        if not rows:
            return None
        accuracy = np.array([r["accuracy"] for r in rows])
        examples = np.array([r["num-examples"] for r in rows], dtype=float)
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

    # ---------------------------------------------------------------- results
    @staticmethod
    def _note_received(uploads: list[ClientUpload], record: RoundRecord) -> None:
        """Received accuracy: each sampled client's model as it received it (the download overlaid
        on its kept state; FedHera's tail scaled by lambda), on its local test split, before local
        training (FedHera's official metric; evaluation rounds only)."""
        rows = [u.metrics for u in uploads if RECEIVED_ACCURACY in u.metrics]
        if not rows:
            return
        accuracy = np.array([r[RECEIVED_ACCURACY] for r in rows])
        examples = np.array([max(r.get(RECEIVED_EXAMPLES, 1.0), 1.0) for r in rows])
        record.received_accuracy = float(np.average(accuracy, weights=examples))
        record.received_accuracy_unweighted = float(accuracy.mean())

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` is an evaluation round (every k rounds, and the last)."""
        every = self.experiment.federation.evaluate_every
        return server_round % every == 0 or server_round >= self.experiment.train.rounds

    def finish_round(self, server_round: int) -> RoundRecord:
        """The round's record, with its wall time; called by the ServerApp after evaluation."""
        book = self.books.setdefault(server_round, _RoundBook(RoundRecord(round=server_round)))
        book.record.seconds = time.perf_counter() - book.started
        return book.record

    def refused_partitions(self) -> list[int]:
        return [int(reason.split(":", 1)[0]) for reason in self.refused.values() if reason[:1].isdigit()]

    # ---------------------------------------------------------------- internals
    def _message(self, node_id: int, server_round: int, payload: Payload, message_type: str) -> Message:
        config = ConfigRecord(
            {"server-round": server_round, "experiment": self._experiment_json, **self.client_config(node_id, server_round)}
        )
        if self.common_rank:
            config["common-rank"] = self.common_rank
        if self.checkpoint_dir:
            config["checkpoint-dir"] = self.checkpoint_dir
        if self.resumed_from:
            config["resume-round"] = self.resumed_from
        if message_type == MessageType.TRAIN and self.evaluates(server_round):
            config[EVAL_RECEIVED] = True
        if message_type == MessageType.EVALUATE:
            config["eval-global"] = self.global_payload() is None
            if self.adapter_dir and self.capabilities.personalized and server_round >= self.experiment.train.rounds:
                config["save-adapter-dir"] = self.adapter_dir
        content = RecordDict({"arrays": to_array_record(payload), "config": config})
        return Message(content=content, dst_node_id=node_id, message_type=message_type)

    def _sample(self, fraction: float) -> list[int]:
        """Seeded sample of accepted nodes (Flower's sample_nodes uses the global RNG)."""
        nodes = sorted(self.profiles, key=self.partition_of)
        size = min(len(nodes), max(self.experiment.federation.min_clients, round(fraction * len(nodes))))
        chosen = self.rng.choice(len(nodes), size=size, replace=False)
        return [nodes[i] for i in sorted(chosen)]

    def _ensure_profiles(self, grid: Grid) -> None:
        if self.profiles:
            return
        expected = self.experiment.data.num_clients
        deadline = time.monotonic() + self.experiment.federation.round_timeout
        while len(node_ids := list(grid.get_node_ids())) < expected and time.monotonic() < deadline:
            log(INFO, "Waiting for clients: %d of %d connected", len(node_ids), expected)
            time.sleep(1.0)
        queries = [
            Message(
                content=RecordDict({"config": ConfigRecord({"experiment": self._experiment_json})}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
            )
            for node_id in node_ids
        ]
        for reply in grid.send_and_receive(queries, timeout=self.experiment.federation.round_timeout):
            node_id = reply.metadata.src_node_id
            if reply.has_error():
                self.refused[node_id] = f"query failed: {reply.error.reason}"
                log(WARNING, "query: node %d failed: %s", node_id, reply.error.reason)
                continue
            profile = ClientProfile.model_validate_json(str(reply.content["profile"]["json"]))
            problem = self.check_profile(profile)
            if problem:
                self.refused[node_id] = f"{profile.partition_id}: {problem}"
                log(WARNING, "query: refusing client %d: %s", profile.partition_id, problem)
                continue
            self.profiles[node_id] = profile
        if not self.profiles:
            raise RuntimeError("no client accepted: " + "; ".join(self.refused.values()))
        self._settle_ranks()
        self.setup()

    def _settle_ranks(self) -> None:
        """A same-rank method (``capabilities.mixed_ranks`` False) with mixed declared ranks trains
        every client at the smallest declared rank (``clients.mixed_rank_policy = smallest``), told
        to the client as ``common-rank``, or stops (``refuse``)."""
        ranks = sorted({p.rank for p in self.profiles.values()})
        if self.capabilities.mixed_ranks or len(ranks) < 2:
            return
        if self.experiment.clients.mixed_rank_policy == "refuse":
            raise RuntimeError(
                f"strategy '{self.name}' needs one LoRA rank for every client, clients declared "
                f"{ranks}; use flexlora, hetlora, flora or fedhera, or clients.mixed_rank_policy=smallest"
            )
        self.common_rank = ranks[0]
        for profile in self.profiles.values():
            profile.rank = self.common_rank
        log(WARNING, "query: '%s' needs one rank, clients declared %s: every client trains at rank %d "
            "(clients.mixed_rank_policy=smallest)", self.name, ranks, self.common_rank)

    def check_profile(self, profile: ClientProfile) -> str:
        """Why a client cannot take part ('' if it can)."""
        max_rank = min(min(shape) for shape in self.module_shapes.values())
        if not 1 <= profile.rank <= max_rank:
            return f"unsupported rank {profile.rank} (must be in [1, {max_rank}] for this model)"
        return ""

    def _valid_uploads(self, replies: Iterable[Message], record: RoundRecord) -> list[ClientUpload]:
        uploads = []
        for msg in replies:
            node_id = msg.metadata.src_node_id
            if msg.has_error():
                record.failures += 1
                log(WARNING, "aggregate_train: node %d failed: %s", node_id, msg.error.reason)
                continue
            payload = from_array_record(msg.content["arrays"])
            metrics = {k: float(v) for k, v in dict(msg.content["metrics"]).items()}
            self.observe_reply(node_id, metrics)
            problem = check_upload(payload, self.expected_upload(node_id))
            if problem:
                self._reject(record, self.partition_of(node_id), problem)
                continue
            uploads.append(ClientUpload(node_id, self.partition_of(node_id), payload, int(metrics["num-examples"]), metrics))
        return self._drop_norm_outliers(sorted(uploads, key=lambda u: u.partition_id), record)

    def _reject(self, record: RoundRecord, partition_id: int, reason: str) -> None:
        record.failures += 1
        record.rejected += 1
        record.rejections.append(f"client {partition_id}: {reason}")
        log(WARNING, "aggregate_train: rejecting update of client %d: %s", partition_id, reason)

    def _drop_norm_outliers(self, uploads: list[ClientUpload], record: RoundRecord) -> list[ClientUpload]:
        """Refuse updates whose norm is absurd: above faults.max_update_norm, or above
        faults.norm_outlier_factor x the round's median norm (with >= 3 updates)."""
        faults = self.experiment.faults
        norms = [update_norm(u.payload) for u in uploads]
        limit = faults.max_update_norm or math.inf
        if faults.norm_outlier_factor and len(uploads) >= 3:
            limit = min(limit, faults.norm_outlier_factor * float(np.median(norms)))
        kept = []
        for upload, norm in zip(uploads, norms):
            if norm > limit:
                self._reject(record, upload.partition_id, f"update norm {norm:.3g} above the bound {limit:.3g}")
            else:
                kept.append(upload)
        return kept


def update_norm(payload: Payload) -> float:
    """L2 norm of all arrays of an upload together."""
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in payload.values()))


def check_upload(payload: Payload, expected: dict[str, tuple[int, ...]]) -> str:
    """Why an upload is malformed ('' if it is not): keys, shapes, NaN / Inf."""
    missing = sorted(set(expected) - set(payload))
    unexpected = sorted(set(payload) - set(expected))
    if missing or unexpected:
        return f"missing keys {missing[:3]} / unexpected keys {unexpected[:3]}"
    for key, shape in expected.items():
        if tuple(payload[key].shape) != tuple(shape):
            return f"{key} has shape {tuple(payload[key].shape)}, expected {tuple(shape)}"
        if not np.all(np.isfinite(payload[key])):
            return f"{key} contains NaN or Inf"
    return ""


@dataclass(frozen=True)
class _ByPartition:
    """A dict that was keyed by node id, stored keyed by partition id (checkpoints)."""

    items: tuple[tuple[Any, Any], ...]


def _node_of(key: Any) -> Any:
    return key[0] if isinstance(key, tuple) and key else key


def _rekey(value: Any, to_partition: dict[int, int]) -> Any:
    """A non-empty dict whose keys (or keys' first items) are all node ids -> _ByPartition."""
    if isinstance(value, dict) and value and all(
        isinstance(_node_of(k), int) and _node_of(k) in to_partition for k in value
    ):
        def key_of(k: Any) -> Any:
            return (to_partition[k[0]], *k[1:]) if isinstance(k, tuple) else to_partition[k]

        return _ByPartition(tuple((key_of(k), v) for k, v in value.items()))
    return value


def _rekey_back(value: Any, to_node: dict[int, int]) -> Any:
    if not isinstance(value, _ByPartition):
        return value

    def key_of(k: Any) -> Any:
        return (to_node[k[0]], *k[1:]) if isinstance(k, tuple) else to_node[k]

    return {key_of(k): v for k, v in value.items}


def _partitions_in(state: dict[str, Any]) -> set[int]:
    return {_node_of(k) for v in state.values() if isinstance(v, _ByPartition) for k, _ in v.items}
