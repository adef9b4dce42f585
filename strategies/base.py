"""The Flower protocol shared by every fedlora strategy.

:class:`LoRAStrategy` implements Flower's Message-API ``Strategy`` hooks once (sampling, one
message per client, reply checking, byte accounting, personalised evaluation); a method subclass
only says what goes down to a client and what must come back (:meth:`download`, one
:class:`~fedlora.strategies.download.Download` per client and round), how uploads are aggregated
(:meth:`aggregate`) and what its global model is (:meth:`global_payload`). Its options and capabilities come from its home
(``fedlora/methods/<name>.py``, ``method = METHOD``). Every hook speaks partition ids; node ids
stay in :class:`~fedlora.strategies.roster.ClientRoster`. Every message is built fresh per client, so
per-client payloads (mixed ranks, personalised factors) never share a RecordDict.

Flower's contract (``Strategy.start``): :meth:`aggregate_train` returns the new global arrays
(:meth:`global_arrays`, an ``ArrayRecord``) and the round's metrics, as Flower's FedAvg does, and
``configure_train`` / ``configure_evaluate`` build their downloads from the ``arrays`` they are
given (:meth:`receive`): the ones the strategy returned change nothing, other arrays of the same
keys and shapes replace its global state (:meth:`load_arrays`), an empty record means "the
strategy's own state" (before round 1: the common seeded initial adapter, at ranks only the
clients' profiles tell). A strategy is built from a whole fedlora experiment (the ServerApp) or
from keywords (a Flower user's ServerApp): its method's options, Flower's ``fraction_train``,
``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes``, ``min_available_nodes``, and
the experiment sections the clients need (``model``, ``data``, ``train``, ...; docs/flower.md), and
``server_optimizer`` (FedAvgM / FedAdam / FedYogi on the method's mean, :meth:`_server_optimizer_step`).

A reply is read in steps, each a method of its own ("reading replies" below; what they check is in
``replies.py``): parse -> validate -> weigh -> aggregate (:meth:`aggregate`) -> account; the
server never raises on what a client sent. Every key a message carries is declared in
``fedlora/protocol.py``. The parts that are not
the protocol live beside it: who takes part (``roster.py``), the steps of reading a reply
(``replies.py``), the defence against bad updates (``validation.py``), the anomaly rule for
poisoning within the bounds (``anomaly.py``), the privacy ledger (``ledger.py``), reading a round's
replies (``reading.py``), the round's record (``accounting.py``), the personalised evaluation's
aggregates (``evaluation.py``).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, getLogger
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedlora import protocol
from fedlora.errors import ConfigError
from fedlora.lora import (
    Combine,
    Payload,
    adapter_shapes,
    from_array_record,
    head_only,
    normalise,
    payload_bytes,
    to_array_record,
    weighted_average,
)
from fedlora.methods import Capabilities, Method, OptionsT
from fedlora.profile import ClientProfile
from fedlora.protocol import Phase, wire_size
from fedlora.results import RoundRecord
from fedlora.schema import AggregationRule, ExperimentConfig, apply_overrides, sample_size
from fedlora.shares import entitlements, share_bound, size_cut
from fedlora.strategies.accounting import account_train, failed_rounds, reply_wire_size
from fedlora.strategies.anomaly import Fingerprint
from fedlora.strategies.download import Download
from fedlora.strategies.evaluation import CountBounds, aggregate_accuracy, aggregate_generation
from fedlora.strategies.ledger import PrivacyLedger
from fedlora.strategies.messages import RunPaths, download_message
from fedlora.strategies.reading import read_evaluate_replies, read_train_replies
from fedlora.strategies.replies import ClientUpload, Expectation
from fedlora.strategies.robust import minimum_uploads
from fedlora.strategies.roster import ClientRoster, profile_problem
from fedlora.strategies.screening import drop_outliers, select_byzantine, watch_updates, weigh
from fedlora.strategies.secure_round import (
    SecureRound,
    aggregate_secure_round,
    masks_problem,
    secure_summary,
    start_secure_round,
)
from fedlora.strategies.server_optimizer import Moments, server_step
from fedlora.strategies.validation import reference_norm, replacement_problem, update_norm

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show

if TYPE_CHECKING:
    from fedlora.models import SeededAdapters

InitialAdapter = Callable[[int], Payload]  # rank -> the common, seeded initial adapter


class ArraysError(ValueError):
    """``configure_*`` was given arrays the strategy cannot continue from (other keys or shapes
    than its global arrays, non-finite values, or a state the method cannot replace)."""


class LoRAStrategy(Strategy, Generic[OptionsT]):
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

    # The method's home declaration (name, options, capabilities): ``class FedHera(LoRAStrategy[
    # FedHeraOptions])`` with ``method = fedhera.METHOD`` (a ``Method[FedHeraOptions]``) types
    # ``self.options``; a class attribute in effect (a ClassVar cannot hold a type variable).
    method: Method[OptionsT]
    options: OptionsT  # ``method.parse(experiment)``: the options model with its defaults filled in
    name: ClassVar[str] = ""  # set from ``method`` by __init_subclass__
    capabilities: ClassVar[Capabilities]

    # What a checkpoint saves and a resumed run restores (:meth:`state_dict`): what the strategy has
    # learned and counted so far. A method adds its own (``STATE = (*LoRAStrategy.STATE, "global_adapter")``);
    # tests/test_architecture.py checks that every attribute a strategy assigns is declared here or below.
    STATE: ClassVar[tuple[str, ...]] = ("records", "started", "ledger", "rng", "failed_rounds", "common_rank",
                                        "norm_reference", "update_history", "excluded", "masked_digests",
                                        "server_moments")
    # Attributes an older fedlora checkpointed for the method and this one no longer keeps (what a
    # download's context now carries): a resume drops them (fedlora.checkpoint.check_strategy_state).
    RETIRED_STATE: ClassVar[frozenset[str]] = frozenset()
    # Attributes rebuilt on every run (from the config, the models and the query), never checkpointed;
    # ``cpu_started`` holds this process's CPU clock at each round's start, which means nothing in another.
    NOT_STATE: ClassVar[frozenset[str]] = frozenset({
        "experiment", "options", "initial_adapter", "module_shapes", "roster", "paths", "_experiment_json",
        "_sent", "_initial_norm", "min_evaluate_nodes", "min_available_nodes", "secure_round", "cpu_started",
    })

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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "method" in cls.__dict__:
            cls.name = cls.method.name
            cls.capabilities = cls.method.capabilities

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

    # ---------------------------------------------------------------- Flower's settings
    @property
    def fraction_train(self) -> float:
        return self.experiment.federation.fraction_train

    @property
    def fraction_evaluate(self) -> float:
        return self.experiment.federation.fraction_evaluate

    @property
    def min_train_nodes(self) -> int:
        return self.experiment.federation.min_clients

    # ---------------------------------------------------------------- method interface
    def check_profile(self, profile: ClientProfile) -> str:
        """Why a client cannot take part ('' if it can): :func:`fedlora.strategies.roster.profile_problem`,
        and in a secure federation a client whose masks are not ChaCha20 under the whole key
        (:func:`fedlora.strategies.secure_round.masks_problem`)."""
        secure = self.experiment.secure_aggregation.enabled
        return (profile_problem(profile, self.module_shapes, self.experiment.data.num_clients, secure=secure)
                or masks_problem(profile, secure))

    def setup(self) -> None:
        """Called once after the profiles are known (e.g. to build per-client state)."""

    def rank_of(self, partition: int) -> int:
        """The LoRA rank client ``partition`` trains at (sent as ``lora-rank`` in every message)."""
        return self.roster.rank(partition)

    @abstractmethod
    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        """What client ``partition`` is sent for ``for_round`` and what its reply must upload (one
        :class:`~fedlora.strategies.download.Download`; :meth:`lora_download` builds the usual one).
        ``for_round``: a train message of round t is for t; an evaluate message after round t is
        for t + 1 (the model round t + 1 would start from). No side effect: what a client was sent
        comes back with its upload (``ClientUpload.download``)."""

    @abstractmethod
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        """Fold the round's valid uploads into the strategy's state."""

    @abstractmethod
    def global_payload(self) -> Payload | None:
        """The method's single global adapter, evaluated on the global test set (None: none)."""

    def sample_train(self, server_round: int) -> list[int]:
        """The partitions that train in ``server_round`` (default: a seeded fraction_train sample)."""
        return self.sample(self.fraction_train, self.min_train_nodes)

    def min_uploads(self) -> int:
        """Fewest valid uploads a round needs to aggregate: ``federation.min_clients``, and what a
        Byzantine-robust selection needs to keep its guarantee (Krum 2f + 3, Bulyan 4f + 3)."""
        return max(self.min_train_nodes, minimum_uploads(self.aggregation_rule, self.experiment.faults.num_malicious))

    def global_arrays(self) -> Payload:
        """What :meth:`aggregate_train` returns and ``configure_*`` read back (Flower's
        ``arrays``): by default the single global model (:meth:`global_payload`, nothing when
        there is none). A method without one returns what every client downloads alike."""
        payload = self.global_payload()
        return {} if payload is None else dict(payload)

    def load_arrays(self, payload: Payload) -> None:
        """Continue from ``payload`` instead of :meth:`global_arrays` (same keys and shapes, checked
        by :meth:`receive`): replace the state the downloads are built from. Default: refused."""
        raise ArraysError(f"{type(self).__name__} cannot continue from other arrays than the ones it returned")

    def flower_dp_problem(self) -> str:
        """Why Flower's ``DifferentialPrivacyClientSideFixedClipping`` cannot wrap this strategy in
        this run ('' if it can): the method's ``capabilities.not_flower_dp``, or a robust
        ``faults.aggregation`` (a median is not the mean the noise is calibrated for). Checked by
        :meth:`configure_train` once the clients are known, when the train config carries the
        wrapper's clipping norm."""
        if not self.capabilities.flower_dp:
            return self.capabilities.not_flower_dp
        if self.aggregation_rule != "mean":
            return (f"faults.aggregation = '{self.experiment.faults.aggregation}' replaces the weighted mean the "
                    "noise is calibrated for; use faults.aggregation = 'mean'")
        if self.experiment.server_optimizer.name != "none":
            return (f"server_optimizer.name = '{self.experiment.server_optimizer.name}' steps from the mean to arrays "
                    "the noise is not calibrated for; use server_optimizer.name = 'none'")
        return ""

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
        """What the strategy learned: the attributes :attr:`STATE` declares, those set so far
        (per-client entries are keyed by partition id, so a resumed run's new node ids do not matter)."""
        return {key: getattr(self, key) for key in self.STATE if hasattr(self, key)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` after this run's query."""
        for key, value in state.items():
            setattr(self, key, value)

    # ---------------------------------------------------------------- helpers for subclasses
    def sent_this_round(self, phase: Phase) -> Mapping[int, Download]:
        """Partition -> the download of ``phase`` sent this round (e.g. FedHera's report of the round)."""
        return self._sent.get(phase, {})

    def lora_download(self, partition: int, for_round: int, phase: Phase, payload: Payload, *,
                      rank: int | None = None, send_A: bool = True, send_B: bool = True, **fields: Any) -> Download:
        """A :class:`~fedlora.strategies.download.Download` of ``payload`` whose reply uploads A and / or
        B (and the head) at ``rank`` (default: the client's, :meth:`rank_of`); ``fields``: its
        ``config``, ``context``, ..."""
        upload = self.lora_shapes(self.rank_of(partition) if rank is None else rank, send_A, send_B)
        return Download(partition, for_round, phase, payload, upload=upload, **fields)

    def lora_shapes(self, rank: int, send_A: bool, send_B: bool, head: bool = True) -> dict[str, tuple[int, ...]]:
        """Shapes of a rank-``rank`` adapter (optionally only A or only B, with or without head)."""
        shapes = adapter_shapes(self.module_shapes, rank, send_A, send_B)
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
        """FedAvg of the uploads' head arrays when the head is global (``previous`` otherwise);
        ``faults.aggregation``'s robust rule where the method allows it."""
        if not self.sends_head:
            return previous
        return weighted_average([head_only(u.payload) for u in uploads], weights, self.combine)

    @property
    def aggregation_rule(self) -> AggregationRule:
        """``faults.aggregation``; 'mean' unless the method declares
        ``capabilities.robust_aggregation`` (which the config check enforces)."""
        return self.experiment.faults.aggregation if self.capabilities.robust_aggregation else "mean"

    @property
    def combine(self) -> Combine:
        """How the method's means combine arrays (:attr:`aggregation_rule`: Krum and MultiKrum
        select uploads, then the mean combines them: :func:`fedlora.strategies.screening.select_byzantine`)."""
        faults = self.experiment.faults
        return Combine(self.aggregation_rule, faults.trim_fraction, faults.num_malicious)

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        """p_k = n_k / sum n over this round's uploads (n_k as the weight-share rule weighs it:
        :func:`fedlora.strategies.screening.weigh`)."""
        return normalise([u.weight for u in uploads])

    def sample(self, fraction: float, minimum: int) -> list[int]:
        """Seeded sample of accepted partitions, at least ``minimum`` (Flower's sample_nodes uses the global RNG)."""
        partitions = [p for p in self.roster.partitions if p not in self.excluded]  # a secure round's culprits: never
        size = sample_size(len(partitions), fraction, minimum)
        chosen = self.rng.choice(len(partitions), size=size, replace=False)
        return [partitions[i] for i in sorted(chosen)]

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` is an evaluation round (:func:`evaluation_round`)."""
        return evaluation_round(self.experiment, server_round)

    # ---------------------------------------------------------------- Flower hooks
    def connect(self, grid: Grid) -> None:
        """Query the clients' profiles once, settle one rank for a same-rank method, set up."""
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
        """Query profiles once, take the ``arrays`` given (:meth:`receive`), sample clients, build
        one message per client (``config``'s entries travel too, except fedlora's own keys)."""
        self.connect(grid)
        if KEY_CLIPPING_NORM in config:  # Flower's client-side fixed-clipping DP wrapper asks the clients to clip
            problem = self.flower_dp_problem()
            if problem:
                raise ConfigError(f"strategy '{self.name}' cannot run under Flower's "
                                  f"DifferentialPrivacyClientSideFixedClipping: {problem}")
        self.roster.refresh(grid, self._experiment_json, self.experiment.federation.round_timeout)
        self.receive(arrays, "configure_train")
        record = self.record(server_round)
        record.refused = sorted(self.roster.refused_partitions)
        partitions = self.sample_train(server_round)
        self._sent["train"] = {p: self.download(p, server_round, "train") for p in partitions}
        messages = [self._message(download, server_round, config) for download in self._sent["train"].values()]
        if self.experiment.secure_aggregation.enabled:  # SecAgg+: its first stages now, the masking on these messages
            self.secure_round, messages = start_secure_round(self, grid, server_round, messages)
        record.bytes_down += sum(payload_bytes(download.payload) for download in self._sent["train"].values())
        record.wire_bytes_down += sum(wire_size(message) for message in messages)
        record.sampled = len(partitions)
        log(INFO, "configure_train: round %d, %d of %d clients", server_round, len(partitions), len(self.roster.profiles))
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read the round's training replies and aggregate the valid uploads, in steps (each its own
        method, below under "reading replies"):

        1. **parse** and **validate** each reply (:meth:`_read_train_replies`), then over the round
           (:meth:`_screen`): the norm outliers; every valid update measured and the anomalous ones
           flagged (logged, or refused with ``faults.anomaly_action = 'reject'``);
        2. **weigh** the valid uploads (:meth:`_weigh`);
        3. **account** what arrived (:meth:`_account_train`);
        4. the failure policy (:meth:`_too_few_uploads`);
        5. **aggregate** them (:meth:`aggregate`, the method's; :meth:`_aggregate_round`), the ones
           a Byzantine-robust selection keeps (:func:`fedlora.strategies.screening.select_byzantine`)
           where one is configured.

        Returns the new :meth:`global_arrays` and the round's train loss and client count; (None,
        None) when too few updates were valid (the state is unchanged, as are Flower's arrays).
        A secure round (``secure_aggregation.enabled``) is read by :func:`~fedlora.strategies.secure_round.aggregate_secure_round`."""
        if self.secure_round is not None:
            secure, self.secure_round = self.secure_round, None
            return aggregate_secure_round(self, secure, server_round, replies)
        record = self.record(server_round)
        replies = list(replies)
        record.wire_bytes_up += sum(reply_wire_size(reply) for reply in replies)
        uploads = self._read_train_replies(replies, server_round, record)  # parse -> validate
        uploads = self._screen(server_round, uploads, record)  # validate (the round) -> weigh
        self._account_train(uploads, record)  # account
        if self._too_few_uploads(uploads, server_round):
            return None, None
        uploads = select_byzantine(uploads, self.aggregation_rule, self.experiment.faults, record,
                                   self._weigh)  # Krum / MultiKrum / Bulyan (faults.aggregation)
        self._aggregate_round(server_round, uploads, record)  # aggregate
        metrics = MetricRecord({protocol.TRAIN_LOSS: record.train_loss, protocol.CLIENTS: len(uploads)})
        return to_array_record(self.global_arrays()), metrics

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

    # ---------------------------------------------------------------- results
    def record(self, server_round: int) -> RoundRecord:
        """The round's record (created, and its clock started, on first use)."""
        if server_round not in self.records:
            self.records[server_round] = RoundRecord(round=server_round)
            self.started[server_round] = time.perf_counter()
            self.cpu_started[server_round] = time.process_time()
        return self.records[server_round]

    def finish_round(self, server_round: int) -> RoundRecord:
        """The round's record, with its wall and CPU time; called by the ServerApp after evaluation."""
        record = self.record(server_round)
        record.seconds = time.perf_counter() - self.started[server_round]
        record.cpu_seconds = time.process_time() - self.cpu_started[server_round]
        return record

    def privacy_report(self) -> dict[str, Any] | None:
        return self.ledger.report(self.experiment.privacy)

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

    # ---------------------------------------------------------------- reading replies
    # parse -> validate (reading.py, replies.py) -> weigh -> aggregate -> account (accounting.py)
    def _expectation(self, partition: int) -> Expectation:
        """What the server knows about ``partition``'s training reply before reading it."""
        faults = self.experiment.faults
        if not self.norm_reference and not self._initial_norm:
            self._initial_norm = update_norm(self.initial_adapter(self.experiment.model.lora_rank))
        reference = self.norm_reference or self._initial_norm
        return Expectation(partition, self.roster.profiles[partition].num_train_examples, faults.max_examples,
                           reference, faults.max_update_ratio)

    def _read_train_replies(self, replies: list[Message], server_round: int, record: RoundRecord) -> list[ClientUpload]:
        """Parse and validate every training reply (:func:`fedlora.strategies.reading.read_train_replies`),
        each upload against the download its sender was sent this round."""
        sent = self._sent.setdefault("train", {})
        for partition in self.roster.partitions if not sent else ():  # replies to no configure_train of ours
            sent[partition] = self.download(partition, server_round, "train")
        return read_train_replies(replies, self.roster, self._sent, self._expectation, self.ledger, record)

    def _screen(self, server_round: int, uploads: list[ClientUpload], record: RoundRecord) -> list[ClientUpload]:
        """Validate over the round (``screening.py``): drop the norm outliers, measure every update
        by the anomaly rule (logged, or refused with ``faults.anomaly_action = 'reject'``), then
        weigh what is left (:meth:`_weigh`)."""
        faults, node_of = self.experiment.faults, self.roster.node_of
        uploads = drop_outliers(uploads, faults, node_of, record)
        uploads, self.update_history = watch_updates(server_round, uploads, self.update_history, faults, node_of,
                                                     record)
        self._weigh(uploads)
        return uploads

    def _weigh(self, uploads: list[ClientUpload]) -> None:
        """Each upload's aggregation weight (:func:`fedlora.strategies.screening.weigh`)."""
        weigh(uploads, self.entitled(), self.experiment.faults.max_client_share)

    def size_cut(self) -> float:
        """The most examples a client is entitled to: ``faults.max_size_ratio`` x the lower median of
        the training sizes the accepted clients declared when they joined (:func:`fedlora.shares.size_cut`;
        inf: no cut)."""
        return size_cut([p.num_train_examples for p in self.roster.profiles.values()],
                        self.experiment.faults.max_size_ratio)

    def entitled(self) -> dict[int, float]:
        """Every accepted client's entitlement: the training size it declared when it joined, cut to
        :meth:`size_cut` (:func:`fedlora.shares.entitlements`)."""
        partitions = sorted(self.roster.profiles)
        sizes = entitlements([self.roster.profiles[p].num_train_examples for p in partitions], self.size_cut())
        return dict(zip(partitions, sizes.tolist()))

    def count_bounds(self) -> CountBounds:
        """The most each client's evaluation counts weigh (:class:`fedlora.strategies.evaluation.CountBounds`)."""
        return CountBounds.of(self.entitled(), self.experiment.data, self.experiment.train.max_length)

    def round_share_bound(self, uploads: list[ClientUpload]) -> float:
        """The largest share of the round one of ``uploads`` may weigh, whatever the method weighs
        by (:func:`fedlora.shares.share_bound`): a method weighing by something else than the
        example counts (HetLoRA's norms) cuts its weights to it with :func:`fedlora.shares.capped_weights`."""
        entitled = self.entitled()
        return share_bound([entitled[u.partition_id] for u in uploads], self.experiment.faults.max_client_share)

    def _account_train(self, uploads: list[ClientUpload], record: RoundRecord) -> None:
        """The round's record of what arrived (:func:`fedlora.strategies.accounting.account_train`)."""
        account_train(uploads, record, self.weights(uploads) if uploads else np.ones(0), self.count_bounds())

    def _too_few_uploads(self, uploads: list[ClientUpload], server_round: int) -> bool:
        """The failure policy: fewer valid uploads than :meth:`min_uploads` leave the state as it
        is (the next round retries); ``faults.max_failed_rounds`` such rounds in a row end the run
        (:class:`~fedlora.strategies.accounting.RoundFailedError`)."""
        needed = (f"federation.min_clients={self.min_train_nodes}" if self.min_uploads() == self.min_train_nodes else
                  f"{self.min_uploads()}, what faults.aggregation = '{self.aggregation_rule}' needs for "
                  f"faults.num_malicious = {self.experiment.faults.num_malicious}")
        self.failed_rounds = failed_rounds(server_round, len(uploads), self.min_uploads(), needed, self.failed_rounds,
                                           self.experiment.faults.max_failed_rounds)
        return self.failed_rounds > 0

    def _aggregate_round(self, server_round: int, uploads: list[ClientUpload], record: RoundRecord) -> None:
        """Aggregate (:meth:`aggregate`) and account for it: its time, the next round's reference
        norm (``faults.max_update_ratio``), the method's facts of the round (:meth:`round_extra`)."""
        started = time.perf_counter()
        optimised = self.experiment.server_optimizer.name != "none"
        before = {k: np.array(v, copy=True) for k, v in self.global_arrays().items()} if optimised else {}
        self.aggregate(server_round, uploads)
        if optimised:
            self._server_optimizer_step(server_round, before)
        record.aggregation_seconds = time.perf_counter() - started
        self.norm_reference = reference_norm([update_norm(u.payload) for u in uploads], self.norm_reference)
        record.extra.update(self.round_extra(server_round))

    def _server_optimizer_step(self, server_round: int, before: Payload) -> None:
        """``[server_optimizer]``: the method's aggregate (its new :meth:`global_arrays`) is the mean
        y; the optimiser steps from ``before`` (x) along y - x (:func:`~fedlora.strategies.server_optimizer.server_step`)
        and the strategy continues from the result (:meth:`load_arrays`). Only methods whose
        capabilities declare ``server_optimizer`` get here (the config check refuses the others)."""
        new, self.server_moments = server_step(self.experiment.server_optimizer, server_round, before,
                                               self.global_arrays(), self.server_moments)
        self.load_arrays(new)


def evaluation_round(experiment: ExperimentConfig, server_round: int) -> bool:
    """Whether the server evaluates in ``server_round``: every ``federation.evaluate_every`` rounds,
    and the last (a train message of such a round asks the client for its received-model metrics)."""
    every = experiment.federation.evaluate_every
    return server_round % every == 0 or server_round >= experiment.train.rounds
