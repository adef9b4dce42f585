"""The Flower protocol shared by every fedlora strategy: one round, read top-down.

:class:`LoRAStrategy` implements Flower's Message-API ``Strategy`` hooks once; a method subclass
only says what goes down to a client and what must come back (:meth:`download`, one
:class:`~fedlora.strategies.download.Download` per client and round), how uploads are aggregated
(:meth:`aggregate`) and what its global model is (:meth:`global_payload`). Its options and
capabilities come from its home (``fedlora/methods/<name>.py``, the ``Method`` that names the
class). Every hook
speaks partition ids; node ids stay in :class:`~fedlora.strategies.roster.ClientRoster`.

A round, as the hooks below run it:

- ``configure_train``: the clients' profiles once (:meth:`connect`, the named first step of a run:
  query, common rank, the method's :meth:`setup`), the Flower-DP check (:meth:`check_flower_dp`),
  the ``arrays`` given (:meth:`receive`), a seeded sample (``sampling.py``), one message per client
  (``messages.py``), and in a secure federation SecAgg+'s first stages (``secure_round.py``);
- ``aggregate_train``: the replies through the reply pipeline (``pipeline.py``: parse, validate,
  screen, weigh, account, select), then the method's aggregation of what it selected
  (:meth:`aggregate_round`); a secure round's replies through ``secure_round.py``, which uses the
  same pipeline and ends in the same :meth:`aggregate_round`;
- ``configure_evaluate`` / ``aggregate_evaluate``: personalised evaluation (``reading.py``,
  ``evaluation.py``).

Flower's contract (``Strategy.start``): :meth:`aggregate_train` returns the new global arrays
(:meth:`global_arrays`, an ``ArrayRecord``) and the round's metrics, as Flower's FedAvg does, and
``configure_train`` / ``configure_evaluate`` build their downloads from the ``arrays`` they are
given (:meth:`receive`): the ones the strategy returned change nothing, other arrays of the same
keys and shapes replace its global state (:meth:`load_arrays`), an empty record means "the
strategy's own state" (before round 1: the common seeded initial adapter, at ranks only the
clients' profiles tell). A strategy is built from a whole fedlora experiment (the ServerApp) or
from keywords (a Flower user's ServerApp; docs/flower.md), with ``server_optimizer`` (FedAvgM /
FedAdam / FedYogi on the method's mean). Beside the hooks: the checkpointed state
(``checkpointed.py``), what a method implements and builds on (``method_api.py``), the named
steps the hooks call (``round_steps.py``), who takes part
(``roster.py``), the privacy ledger (``ledger.py``). Every key a message carries is declared in
``fedlora/protocol.py``; the server never raises on what a client sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, getLogger
from typing import TYPE_CHECKING, Any, Generic

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedlora import protocol
from fedlora.lora import Payload, from_array_record, payload_bytes, to_array_record
from fedlora.methods import Declaration, FromDeclaration, OptionsT
from fedlora.protocol import Phase, wire_size
from fedlora.results import RoundRecord
from fedlora.schema import ExperimentConfig, apply_overrides
from fedlora.strategies.accounting import reply_wire_size
from fedlora.strategies.anomaly import Fingerprint
from fedlora.strategies.checkpointed import Checkpointed
from fedlora.strategies.download import Download
from fedlora.strategies.evaluation import aggregate_accuracy, aggregate_generation
from fedlora.strategies.ledger import PrivacyLedger
from fedlora.strategies.messages import RunPaths, download_message
from fedlora.strategies.method_api import ArraysError
from fedlora.strategies.pipeline import ReplyPipeline, RoundReplies
from fedlora.strategies.reading import read_evaluate_replies
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.roster import ClientRoster
from fedlora.strategies.round_steps import RoundSteps
from fedlora.strategies.sampling import evaluation_round
from fedlora.strategies.secure_round import (
    SecureRound,
    aggregate_secure_round,
    secure_summary,
    start_secure_round,
)
from fedlora.strategies.server_optimizer import Moments
from fedlora.strategies.validation import reference_norm, replacement_problem, update_norm

__all__ = ["ArraysError", "ClientUpload", "InitialAdapter", "LoRAStrategy", "evaluation_round"]

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show

if TYPE_CHECKING:
    from fedlora.models import SeededAdapters

InitialAdapter = Callable[[int], Payload]  # rank -> the common, seeded initial adapter


class LoRAStrategy(Checkpointed, RoundSteps, Strategy, Generic[OptionsT]):
    """Base class of fedlora's aggregation strategies (see the module docstring).

    Built either from a whole experiment (fedlora's ServerApp) or from keywords (a Flower user's
    ServerApp, run by ``strategy.start(grid=..., initial_arrays=..., num_rounds=...)``).

    Parameters
    ----------
    experiment : ExperimentConfig, optional
        The resolved experiment; ``experiment.strategy`` holds this method's options. Without it
        the keywords below build one (checked like a config file: ConfigError).
    initial_adapter : Callable[[int], Payload], optional
        Returns the common seeded initial adapter (LoRA factors + head) at a given rank. Default:
        built from the experiment's model (:class:`fedlora.models.SeededAdapters`).
    module_shapes : dict[str, tuple[int, int]], optional
        (d_out, d_in) of every adapted module, used to check ranks and upload shapes (given with
        ``initial_adapter``; default: read from the model).
    fraction_train : float, optional
        Fraction of the clients sampled per training round (``federation.fraction_train``).
    fraction_evaluate : float, optional
        Fraction of the clients asked for personalised evaluation (``federation.fraction_evaluate``).
    min_train_nodes : int, optional
        Fewest clients sampled per round and fewest valid updates a round needs to aggregate
        (``federation.min_clients``).
    min_evaluate_nodes : int, optional
        Fewest clients asked for evaluation (default: ``min_train_nodes``).
    min_available_nodes : int, optional
        Nodes the strategy waits for (up to ``federation.round_timeout``) before its profile query
        (default: ``data.num_clients``).
    paths : RunPaths, optional
        Where fedlora's ServerApp keeps the run's files (the clients' state and adapters, the
        round a resumed run continues after); default: none.
    **settings
        The method's options (its options model, ``fedlora/methods/<name>.py``) and experiment
        sections as mappings or section models: ``model``, ``data``, ``train``, ``federation``,
        ``clients``, ``faults``, ``privacy``, ``server_optimizer``, ``output`` (the clients read them from
        every message).
    """

    # The method's declaration (fedlora/methods/<name>.py: name, options, capabilities, this class, its
    # trainer), looked up from the class (fedlora.methods.declaring): the declaration names the strategy,
    # the strategy does not point back. ``class FedHera(LoRAStrategy[FedHeraOptions])`` types ``self.options``.
    method = Declaration()
    options: OptionsT  # ``method.parse(experiment)``: the options model with its defaults filled in
    name = FromDeclaration(lambda declared: declared.name)
    capabilities = FromDeclaration(lambda declared: declared.capabilities)

    def __init__(
        self,
        experiment: ExperimentConfig | None = None,
        initial_adapter: InitialAdapter | None = None,
        module_shapes: dict[str, tuple[int, int]] | None = None,
        *,
        fraction_train: float | None = None,
        fraction_evaluate: float | None = None,
        min_train_nodes: int | None = None,
        min_evaluate_nodes: int | None = None,
        min_available_nodes: int | None = None,
        paths: RunPaths | None = None,
        **settings: Any,
    ) -> None:
        federation = {"fraction_train": fraction_train, "fraction_evaluate": fraction_evaluate,
                      "min_clients": min_train_nodes}
        if experiment is None:
            experiment = self.experiment_from(settings, federation)
        elif settings or any(value is not None for value in federation.values()):
            raise TypeError(f"{type(self).__name__}: give an experiment or keyword settings, not both")
        if (initial_adapter is None) != (module_shapes is None):
            raise TypeError(f"{type(self).__name__}: give initial_adapter and module_shapes together")
        self.experiment = experiment
        self.options = self.method.parse(experiment)
        if initial_adapter is None or module_shapes is None:
            adapters = self.seeded_adapters()
            initial_adapter, module_shapes = adapters.initial_adapter, adapters.module_shapes()
        self.initial_adapter = initial_adapter
        self.module_shapes = module_shapes
        self.min_evaluate_nodes = experiment.federation.min_clients if min_evaluate_nodes is None else min_evaluate_nodes
        self.min_available_nodes = experiment.data.num_clients if min_available_nodes is None else min_available_nodes
        self.roster = ClientRoster()
        self.paths = paths or RunPaths()
        self.ledger = PrivacyLedger()
        self.records: dict[int, RoundRecord] = {}
        self.started: dict[int, float] = {}
        self.cpu_started: dict[int, float] = {}
        self.rng = np.random.default_rng(experiment.train.seed)  # the client sampler
        self.failed_rounds = 0  # consecutive rounds with too few valid updates
        self.common_rank = 0  # > 0: a same-rank method runs every client at this rank
        self.norm_reference = 0.0  # faults.max_update_ratio's reference norm (0: the initial adapter's)
        self._experiment_json = experiment.to_json()
        self._sent: dict[Phase, dict[int, Download]] = {}  # this round's downloads, by phase and partition
        self._initial_norm = 0.0  # norm of the initial adapter at model.lora_rank (computed once)
        self.update_history: list[Fingerprint] = []  # the anomaly rule's sketches of recent uploads
        self.secure_round: SecureRound | None = None  # secure_aggregation.enabled: this round's SecAgg+ (secure.py)
        self.excluded: dict[int, str] = {}  # partition -> why it is never sampled again (a secure round named it)
        self.masked_digests: list[str] = []  # SHA-256 of every masked vector summed so far (a replay is named)
        self.server_moments: Moments = {}  # [server_optimizer]'s state (server_optimizer.py): empty until it steps

    @classmethod
    def experiment_from(cls, settings: Mapping[str, Any], federation: Mapping[str, Any]) -> ExperimentConfig:
        """The experiment of a keyword-built strategy (:func:`fedlora.config.experiment_from_settings`)."""
        from fedlora.config import experiment_from_settings

        if "strategy" in settings or "name" in settings:
            raise TypeError(f"{cls.__name__}: the strategy is '{cls.name}'; give its options as keywords")
        return experiment_from_settings(cls.name, settings, federation)

    def seeded_adapters(self) -> SeededAdapters:
        """The experiment's model as the server sees it (initial adapters, module shapes), built
        with this method's LoRA init (:meth:`model_init`); the labels come from the data config."""
        from fedlora.data import build_federated_data
        from fedlora.models import SeededAdapters

        labels = build_federated_data(self.experiment.data).label_names
        train = self.experiment.train
        return SeededAdapters(self.experiment.model, len(labels), train.seed, self.model_init(), train.device)

    # ---------------------------------------------------------------- Flower hooks
    def connect(self, grid: Grid) -> None:
        """The first step of a run, once: query the clients' profiles (waiting for
        ``min_available_nodes``), settle one rank for a same-rank method, and the method's
        :meth:`setup`. fedlora's ServerApp calls it before its first round; ``configure_train``
        calls it when no one has; once the clients are known, a second call does nothing."""
        if self.roster:
            return
        federation = self.experiment.federation
        self.roster.announce = self.paths.entries()  # the run's entries (the label names) reach the queries too
        self.roster.query(grid, self._experiment_json, self.min_available_nodes, federation.round_timeout,
                          self.check_profile, connect_timeout=federation.connect_timeout)
        if not self.capabilities.mixed_ranks:
            refuse = self.experiment.clients.mixed_rank_policy == "refuse"
            self.common_rank = self.roster.settle_common_rank(refuse, self.name)
        self.setup()

    def summary(self) -> None:
        log(INFO, "\t├── %s (%s)", type(self).__name__, self.capabilities.paper)
        for key, value in self.options.model_dump().items():
            log(INFO, "\t├── %s: %s", key, value)
        log(INFO, "\t├── sampling: fraction train %.2f, evaluate %.2f; minimum nodes: train %d, evaluate %d, "
            "available %d", self.fraction_train, self.fraction_evaluate, self.min_train_nodes,
            self.min_evaluate_nodes, self.min_available_nodes)
        if self.experiment.secure_aggregation.enabled:
            log(INFO, "\t├── %s", secure_summary(self.experiment))

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Flower's ``Strategy.start``: rounds 1..``num_rounds`` of the one round loop
        (:func:`fedlora.strategies.loop.run_rounds`, which fedlora's ServerApp runs too), with
        ``num_rounds`` as the experiment's ``train.rounds`` (clients read it: the last round saves
        adapters, DP budgets span all rounds). ``initial_arrays``: an empty ``ArrayRecord`` starts
        from the common seeded initial adapter; arrays of :meth:`global_arrays`'s keys and shapes
        start from them."""
        from fedlora.strategies.loop import run_rounds

        if num_rounds != self.experiment.train.rounds:
            self.set_rounds(num_rounds)
        return run_rounds(self, grid, 1, num_rounds, arrays=initial_arrays, timeout=timeout, train_config=train_config,
                          evaluate_config=evaluate_config, evaluate_fn=evaluate_fn)

    def set_rounds(self, num_rounds: int) -> None:
        """Run for ``num_rounds`` rounds: ``train.rounds`` of the experiment the clients receive
        (checked again, e.g. FedTreeLoRA's warm-up must end before the last round)."""
        from fedlora.config import build_config

        self.experiment = build_config(apply_overrides(self.experiment.model_dump(mode="json"),
                                                       [f"train.rounds={int(num_rounds)}"]))
        self.options = self.method.parse(self.experiment)
        self._experiment_json = self.experiment.to_json()

    def receive(self, arrays: ArrayRecord | None, hook: str) -> None:
        """Flower's ``arrays`` into the strategy (``configure_*``, once the clients are known):
        empty: the strategy's own state; equal to :meth:`global_arrays` (Flower's loop passes back
        what :meth:`aggregate_train` returned): nothing to do; other finite arrays of the same
        keys and shapes: :meth:`load_arrays`. Anything else is an :class:`ArraysError`."""
        if arrays is None or len(arrays) == 0:
            return
        payload, current = from_array_record(arrays), self.global_arrays()
        if payload.keys() == current.keys() and all(
            payload[k].shape == current[k].shape and np.array_equal(payload[k], current[k], equal_nan=True) for k in current
        ):
            return
        problem = replacement_problem(payload, current)
        if problem:
            raise ArraysError(f"{hook}: {type(self).__name__} cannot continue from the arrays it was given: {problem}")
        self.load_arrays({k: np.asarray(v, dtype=current[k].dtype) for k, v in payload.items()})
        log(INFO, "%s: %s continues from the arrays it was given", hook, type(self).__name__)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The clients' profiles on the run's first call (:meth:`connect`), the Flower-DP check, the
        ``arrays`` given (:meth:`receive`), a seeded sample of clients, one message per client
        (``config``'s entries travel too, except fedlora's own keys); in a secure federation, SecAgg+'s
        first stages and the masking entries on these messages (``secure_round.py``)."""
        if not self.roster:  # the run's first step (fedlora's ServerApp takes it before round 1)
            self.connect(grid)
        self.check_flower_dp(config)
        self.roster.refresh(grid, self._experiment_json, self.experiment.federation.round_timeout)
        self.receive(arrays, "configure_train")
        record = self.record(server_round)
        record.refused = sorted(self.roster.refused_partitions)
        partitions = self.sample_train(server_round)
        self._sent["train"] = {p: self.download(p, server_round, "train") for p in partitions}
        messages = [self._message(download, server_round, config) for download in self._sent["train"].values()]
        if self.experiment.secure_aggregation.enabled:
            self.secure_round, messages = start_secure_round(self, grid, server_round, messages)
        record.bytes_down += sum(payload_bytes(download.payload) for download in self._sent["train"].values())
        record.wire_bytes_down += sum(wire_size(message) for message in messages)
        record.sampled = len(partitions)
        log(INFO, "configure_train: round %d, %d of %d clients", server_round, len(partitions), len(self.roster.profiles))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's training replies through the reply pipeline (:class:`~fedlora.strategies.pipeline.ReplyPipeline`:
        parse, validate, screen, weigh, account, select), then the method's aggregation of what it
        selected (:meth:`aggregate_round`). A secure round (``secure_aggregation.enabled``) is read
        by :func:`~fedlora.strategies.secure_round.aggregate_secure_round`, through the same steps
        a server can run on masked replies.

        Returns the new :meth:`global_arrays` and the round's train loss and client count; (None,
        None) when too few updates were valid (the state is unchanged, as are Flower's arrays)."""
        if self.secure_round is not None:
            secure, self.secure_round = self.secure_round, None
            return aggregate_secure_round(self, secure, server_round, replies)
        replies_read = ReplyPipeline(self, server_round).run(replies)
        if not replies_read.enough:
            return None, None
        return self.aggregate_round(replies_read)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Personalised evaluation: each sampled client tests its own model (built from the
        ``arrays`` given, :meth:`receive`) on its local split."""
        if self.roster:
            self.receive(arrays, "configure_evaluate")
        if self.fraction_evaluate == 0.0 or not self.roster or not self.evaluates(server_round):
            self._sent["evaluate"] = {}
            return []
        record = self.record(server_round)
        messages = []
        partitions = self.sample(self.fraction_evaluate, self.min_evaluate_nodes)
        # the model round server_round + 1 would start from
        self._sent["evaluate"] = {p: self.download(p, server_round + 1, "evaluate") for p in partitions}
        for download in self._sent["evaluate"].values():
            record.bytes_eval_down += payload_bytes(download.payload)
            messages.append(self._message(download, server_round, config))
            record.wire_bytes_eval += wire_size(messages[-1])
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Personalised evaluation over the round's valid replies: **parse** and **validate** each
        (:func:`fedlora.strategies.reading.read_evaluate_replies`), then **weigh** and **aggregate**: a
        classifier's accuracy (:func:`fedlora.strategies.evaluation.aggregate_accuracy`), a causal LM's
        ROUGE-L and loss (:func:`fedlora.strategies.evaluation.aggregate_generation`),
        example-weighted (each count within its client's bound: :meth:`count_bounds`) and unweighted, worst client
        and 10th percentile (``evaluation.py``). None when no reply was valid."""
        record = self.record(server_round)
        replies = list(replies)
        record.wire_bytes_eval += sum(reply_wire_size(reply) for reply in replies)
        kind = self.experiment.model.kind
        rows = read_evaluate_replies(replies, self.roster, self._sent, kind, record)  # parse -> validate
        if not rows:
            return None
        aggregate = aggregate_generation if kind == "causal_lm" else aggregate_accuracy  # weigh -> aggregate -> account
        return aggregate(record, rows, self.count_bounds(), self.global_payload() is None)

    # ---------------------------------------------------------------- the method's step
    def aggregate_round(self, replies: RoundReplies) -> tuple[ArrayRecord, MetricRecord]:
        """The method's step of the round: :meth:`aggregate` what the reply pipeline selected, the
        server optimiser's step from there, and their record: the time, the next round's
        reference norm (``faults.max_update_ratio``), the method's facts (:meth:`round_extra`).
        Flower's result of ``aggregate_train``."""
        record, server_round, started = replies.record, replies.server_round, time.perf_counter()
        optimised = self.experiment.server_optimizer.name != "none"
        before = {k: np.array(v, copy=True) for k, v in self.global_arrays().items()} if optimised else {}
        self.aggregate(server_round, replies.selected)
        if optimised:
            self.server_optimizer_step(server_round, before)
        record.aggregation_seconds = time.perf_counter() - started
        self.norm_reference = reference_norm([update_norm(u.payload) for u in replies.selected], self.norm_reference)
        record.extra.update(self.round_extra(server_round))
        metrics = MetricRecord({protocol.TRAIN_LOSS: record.train_loss, protocol.CLIENTS: replies.clients})
        return to_array_record(self.global_arrays()), metrics

    # ---------------------------------------------------------------- internals
    def _message(self, download: Download, server_round: int, flower_config: ConfigRecord | None = None) -> Message:
        """The Flower message of ``download``, sent in ``server_round`` (:func:`~fedlora.strategies.messages.download_message`)."""
        entries = {protocol.EXPERIMENT: self._experiment_json, protocol.RANK: self.rank_of(download.partition),
                   **self.paths.entries()}
        if download.phase == "train" and self.evaluates(server_round):
            entries[protocol.EVAL_RECEIVED] = True  # an evaluation round: report the received model's metrics
        if download.phase == "evaluate":
            entries[protocol.EVAL_GLOBAL] = self.global_payload() is None
            if self.paths.adapter_dir and self.capabilities.personalized and server_round >= self.experiment.train.rounds:
                entries[protocol.SAVE_ADAPTER_DIR] = self.paths.adapter_dir
        return download_message(download, server_round, self.roster.node_of[download.partition], entries, flower_config)

