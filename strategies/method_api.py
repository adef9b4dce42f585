"""The method's side of a strategy: what a method subclass implements (:meth:`~MethodAPI.download`,
:meth:`~MethodAPI.aggregate`, :meth:`~MethodAPI.global_payload`, and the defaults it may override)
and what its ``download`` and ``aggregate`` build on (LoRA downloads and their shapes, the
classification head, the means' combine rule, the aggregation weights and the weight-share
bounds). A base of :class:`~fedlora.strategies.base.LoRAStrategy`, whose Flower hooks call it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from fedlora.lora import Combine, Payload, adapter_shapes, head_only, normalise, weighted_average
from fedlora.methods import Capabilities
from fedlora.profile import ClientProfile
from fedlora.protocol import Phase
from fedlora.schema import AggregationRule, ExperimentConfig
from fedlora.shares import entitlements, share_bound, size_cut
from fedlora.strategies.download import Download
from fedlora.strategies.evaluation import CountBounds
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.robust import minimum_uploads
from fedlora.strategies.roster import ClientRoster, profile_problem
from fedlora.strategies.sampling import seeded_sample
from fedlora.strategies.secure_round import masks_problem


class ArraysError(ValueError):
    """``configure_*`` was given arrays the strategy cannot continue from (other keys or shapes
    than its global arrays, non-finite values, or a state the method cannot replace)."""


class MethodAPI(ABC):
    """What a method implements and builds on; it reads the strategy's experiment, model and roster."""

    capabilities: ClassVar[Capabilities]
    experiment: ExperimentConfig
    initial_adapter: Callable[[int], Payload]
    module_shapes: dict[str, tuple[int, int]]
    roster: ClientRoster
    rng: np.random.Generator
    excluded: dict[int, str]

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

    def sample(self, fraction: float, minimum: int) -> list[int]:
        """Seeded sample of accepted partitions, at least ``minimum`` (:func:`~fedlora.strategies.sampling.seeded_sample`);
        a client a secure round left out (``excluded``) is never sampled."""
        return seeded_sample([p for p in self.roster.partitions if p not in self.excluded], self.rng, fraction, minimum)

    # ---------------------------------------------------------------- helpers for a method's download and aggregate
    def rank_of(self, partition: int) -> int:
        """The LoRA rank client ``partition`` trains at (sent as ``lora-rank`` in every message)."""
        return self.roster.rank(partition)

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
        select uploads, then the mean combines them: :meth:`fedlora.strategies.pipeline.ReplyPipeline.select`)."""
        faults = self.experiment.faults
        return Combine(self.aggregation_rule, faults.trim_fraction, faults.num_malicious)

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        """p_k = n_k / sum n over this round's uploads (n_k as the weight-share rule weighs it:
        :func:`fedlora.strategies.screening.weigh`)."""
        return normalise([u.weight for u in uploads])

    # ---------------------------------------------------------------- the weight-share rule's bounds
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
