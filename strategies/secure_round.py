"""Secure aggregation in a :class:`~fedlora.strategies.base.LoRAStrategy` round
(``secure_aggregation.enabled``, docs/secure-aggregation.md). The strategy is typed by what this
module uses of it, :class:`SecureStrategy` (``base.py`` imports this module, and no import cycle is
allowed, ``TYPE_CHECKING`` ones included); every call is a public one.

At join, :func:`masks_problem` refuses a client that does not declare fedlora's mask generator; at
start, :func:`secure_summary` says in one line what a secure round does instead of the screening
the server cannot do on a sum. ``configure_train`` calls :func:`start_secure_round` once the
round's downloads and messages are built: the server chooses every sampled client's aggregation
weight (the strategy's own weighing of the example counts the clients declared when they joined,
as a rule each client checks: :func:`secure_weighting`), the round's parameters
(:func:`fedlora.secagg.choose_params`, a threshold above half of the shares unless allowed), runs
the setup and share-keys stages (:class:`~fedlora.strategies.secure.SecureRound`) and returns the
training messages of the clients still in the protocol, each with the SecAgg+ record of the
masking stage and fedlora's ``secagg-*`` entries (the clipping norm C, the range c, the pad rank).
``aggregate_train`` calls :func:`aggregate_secure_round`: every reply is read as usual, by the reply
pipeline's read step (:class:`~fedlora.strategies.pipeline.ReplyPipeline`: sender, metrics, example
count; its arrays are empty), the masked vectors of the valid ones are checked and summed, the
unmask stage removes the masks, the unmasked mean is checked against what clipped updates can give
(:func:`checked_mean`), the pipeline weighs and accounts the summed replies, and the weighted mean
of the updates plus the weighted mean of the survivors' downloads is handed to the strategy's
aggregation step (``aggregate_round``: the method's :meth:`aggregate`) as one upload of weight 1:
for a method whose aggregate is the weighted mean of its uploads (zero-padded to the largest rank),
that is the aggregate of the round. Every client the round named is left out of the rest of the
run (:func:`exclude_culprits`).

What the server does not check in a secure round, since it never sees an upload: the norm outlier
rule, the anomaly rule and the update-ratio bound (the clients clip to C instead, and the server
checks the mean); NaN and shape checks run on the client.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING, getLogger
from typing import Protocol

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.serverapp import Grid

from fedlora import protocol, secagg
from fedlora.errors import ConfigError
from fedlora.lora import ADAPTER_DTYPE
from fedlora.methods import Capabilities
from fedlora.profile import ClientProfile
from fedlora.protocol import Phase
from fedlora.schema import ExperimentConfig
from fedlora.secagg import canonical_shapes, choose_params, error_bound, factor_rank, flatten, unflatten
from fedlora.strategies.accounting import reject
from fedlora.strategies.download import Download
from fedlora.strategies.pipeline import ReplyPipeline, RoundReplies, RoundStrategy
from fedlora.strategies.replies import ClientUpload
from fedlora.strategies.secure import SecureRound

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


class SecureStrategy(RoundStrategy, Protocol):
    """What a secure round reads from a strategy and the public calls by which it changes it
    (:class:`~fedlora.strategies.base.LoRAStrategy` has them all), beside the reply pipeline's."""

    masked_digests: list[str]
    excluded: dict[int, str]

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def rank_of(self, partition: int) -> int: ...

    def sent_this_round(self, phase: Phase) -> Mapping[int, Download]: ...

    def size_cut(self) -> float: ...

    def exclude(self, partition: int, why: str) -> None: ...

    def remember_masked(self, digests: list[str]) -> None: ...

    def aggregate_round(self, replies: RoundReplies) -> tuple[ArrayRecord, MetricRecord]: ...


def secure_problem(strategy: SecureStrategy) -> str:
    """Why ``strategy`` cannot aggregate this run securely ('' if it can): the method's
    ``capabilities.not_secure``, a robust ``faults.aggregation``, or mixed ranks where the method's
    mean is not over zero-padded uploads (``capabilities.secure_one_rank``)."""
    caps = strategy.capabilities
    if not caps.secure_aggregation:
        return caps.not_secure or "its capabilities do not declare secure_aggregation"
    if strategy.aggregation_rule != "mean":
        return f"faults.aggregation = '{strategy.aggregation_rule}' needs the uploads, which the server never sees"
    ranks = sorted({strategy.rank_of(p) for p in strategy.roster.partitions})
    if len(ranks) > 1 and caps.secure_one_rank:
        return f"clients train ranks {ranks}: {caps.secure_one_rank}"
    return ""


def masks_problem(profile: ClientProfile, secure: bool) -> str:
    """Why a client cannot join a secure federation ('' if it can, or if the federation is not
    secure): its profile does not declare fedlora's mask generator (ChaCha20 under the whole key);
    a client running Flower's own SecAgg+ mod would expand its masks from 32 bits of the key."""
    if not secure or profile.secure_masks == secagg.MASK_GENERATOR:
        return ""
    declared = f"declares masks {profile.secure_masks!r}" if profile.secure_masks else "declares no mask generator"
    return (f"it {declared}: this secure federation masks with {secagg.MASK_GENERATOR} keyed by the whole 256-bit "
            "key, and a client on Flower's own SecAgg+ mod would seed its masks with 32 bits of it")


def secure_summary(experiment: ExperimentConfig) -> str:
    """The secure round in one line, at start: the generator, the threshold rule, the clients'
    clipping norm and what the server can no longer screen (the counterparts of the plain rules)."""
    secure, faults = experiment.secure_aggregation, experiment.faults
    clip = secagg.clip_bound(secure.clip_norm, faults.max_update_norm)
    threshold = ("above half of the shares" if secure.reconstruction_threshold == 0
                 else f"{secure.reconstruction_threshold!r}")
    bound = (f"each client clips its update to L2 norm {clip:g} before masking and the server refuses a round whose "
             f"unmasked mean is beyond it" if clip else
             "no norm bound (secure_aggregation.clip_norm = faults.max_update_norm = 0): a client can move the mean "
             "by up to the clipping range per entry; set secure_aggregation.clip_norm")
    return (f"secure aggregation: SecAgg+, masks {secagg.MASK_GENERATOR} ({secagg.SECURITY_BITS}-bit security), "
            f"threshold {threshold}; {bound}; faults.norm_outlier_factor, faults.max_update_ratio and the anomaly "
            "rule need single updates and do not run")


def secure_weighting(weights: list[float], counts: list[int], max_share: float, size_cut: float = 0.0) -> str:
    """How the strategy weighs the round's sampled clients, as a rule each client can check on its
    own (:func:`fedlora.secagg.weight_ratio`): 'examples' when the weights are the weight-share rule
    on the declared ``counts`` (entitlements cut at ``size_cut``, 0: none), 'uniform' when they are
    all equal; ConfigError for any other weighting (a client could not tell it from a server that
    shrinks the others' weights)."""
    largest = max(weights)
    ratios = [w / largest for w in weights]
    if all(abs(r - secagg.weight_ratio(counts, i, max_share, "examples", size_cut)) <= 1e-9
           for i, r in enumerate(ratios)):
        return "examples"
    if all(abs(r - 1.0) <= 1e-12 for r in ratios):
        return "uniform"
    raise ConfigError("secure_aggregation.enabled = true needs weights a client can check on its own: its examples "
                      "under the weight-share rule (faults.max_size_ratio, faults.max_client_share), or the same for "
                      "every client")


def start_secure_round(strategy: SecureStrategy, grid: Grid, server_round: int,
                       messages: list[Message]) -> tuple[SecureRound, list[Message]]:
    """The setup and share-keys stages of ``server_round``, then the training messages of the
    clients still in the protocol, carrying the masking stage (module docstring). No message
    when a stage halts the round (too few clients left: the round fails, counted as such)."""
    problem = secure_problem(strategy)
    if problem:
        raise ConfigError(f"strategy '{strategy.name}' cannot run with secure_aggregation.enabled = true: {problem}")
    sent, node_of = strategy.sent_this_round("train"), strategy.roster.node_of
    partitions = sorted(sent)
    pad_rank = max((factor_rank(k, s) for p in partitions for k, s in sent[p].upload.items()), default=0)
    shapes = canonical_shapes(sent[partitions[0]].upload, pad_rank)
    for p in partitions:
        download = sent[p]
        if canonical_shapes(download.upload, pad_rank) != shapes or {
                k: tuple(np.shape(v)) for k, v in download.payload.items()} != {k: tuple(s) for k, s in download.upload.items()}:
            raise ConfigError(f"strategy '{strategy.name}' cannot run with secure_aggregation.enabled = true: client "
                              f"{p}'s reply would not upload the arrays it downloads (a client masks upload - download)")
    counts = [strategy.roster.declared_examples(p) for p in partitions]
    placeholders = [ClientUpload(p, {}, n, {}) for p, n in zip(partitions, counts)]
    # the strategy's own weighing (the weight-share rule, then the method's weights), before any reply
    weights = [float(w) for w in ReplyPipeline(strategy, server_round).weigh(placeholders)]
    secure, faults = strategy.experiment.secure_aggregation, strategy.experiment.faults
    cut = strategy.size_cut()
    cut = cut if math.isfinite(cut) else 0.0  # 0 on the wire: no cut
    weighting = secure_weighting(weights, counts, faults.max_client_share, cut)
    clip = secagg.clip_bound(secure.clip_norm, faults.max_update_norm)
    params = choose_params(weights, secure.num_shares, secure.reconstruction_threshold, clip,
                           secure.clipping_range, secure.quantization_range, secure.modulus_range)
    problem = secagg.threshold_problem(params.threshold, params.num_shares, secure.allow_low_threshold)
    if problem:
        raise ConfigError(f"secure_aggregation: {problem}")
    size = sum(int(np.prod(s)) for s in shapes.values())
    round_ = SecureRound(params, grid, server_round, {node_of[p]: w for p, w in zip(partitions, weights)},
                         {node_of[p]: n for p, n in zip(partitions, counts)}, weighting, size,
                         strategy.experiment.federation.round_timeout, max_share=faults.max_client_share,
                         size_cut=cut, low_threshold=secure.allow_low_threshold, history=set(strategy.masked_digests))
    round_.report.update(clipping_range=params.clipping_range, quantization_range=params.quantization_range,
                         modulus_range=params.modulus_range, max_weight=params.max_weight, pad_rank=pad_rank,
                         clip_norm=clip, weighting=weighting)
    if not (round_.setup() and round_.share_keys()):
        return round_, []
    entries = {protocol.SECAGG_CLIP: float(clip), protocol.SECAGG_RANGE: float(params.clipping_range),
               protocol.SECAGG_PAD_RANK: pad_rank}
    masking = []
    for message in messages:
        record = round_.masking_record(message.metadata.dst_node_id)
        if record is None:
            continue
        message.content.config_records[RECORD_KEY_CONFIGS] = record
        message.content.config_records[protocol.CONFIG_RECORD].update(entries)
        masking.append(message)
    log(INFO, "secure aggregation, round %d: %d of %d clients masking (threshold %d, T = %d, c = %g, C = %g)",
        server_round, len(masking), len(partitions), params.threshold, params.quantization_range,
        params.clipping_range, clip)
    return round_, masking


def aggregate_secure_round(strategy: SecureStrategy, round_: SecureRound, server_round: int,
                           replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """``aggregate_train`` of a secure round: read every reply (its arrays are empty), sum the
    masked vectors of the valid ones, unmask, check the mean against what clipped updates can
    give, weigh and account the summed ones, and hand the strategy's aggregation step the
    weighted mean (module docstring). (None, None) when the round failed (too few valid replies,
    a halted stage, a mean out of bounds). Every client the round named (``culprits``) is left out
    of the rest of the run."""
    pipeline, replies = ReplyPipeline(strategy, server_round), list(replies)
    record, sent = pipeline.record, strategy.sent_this_round("train")
    uploads = pipeline.read(replies, {p: dataclasses.replace(d, upload={}, alternatives={}) for p, d in sent.items()})
    node_of = strategy.roster.node_of
    by_node = {reply.metadata.src_node_id: reply for reply in replies}
    left_out = round_.collect({node_of[u.partition_id]: by_node[node_of[u.partition_id]] for u in uploads})
    for upload in uploads:
        node = node_of[upload.partition_id]
        if node in left_out:
            reject(record, upload.partition_id, node, f"secure aggregation: {left_out[node]}")
    uploads = [u for u in uploads if node_of[u.partition_id] in round_.summed]
    unmasked = round_.unmask()
    exclude_culprits(strategy, round_)
    strategy.remember_masked(round_.report.pop("masked_digests", []))
    mean = None if unmasked is None else checked_mean(strategy, round_, uploads, sent, unmasked)
    if mean is None:
        record.failures += len(uploads)
        uploads = []
    weights = pipeline.weigh(uploads)
    pipeline.account(uploads, weights)
    record.bytes_up = len(uploads) * (round_.size + 1) * 8  # the masked int64 vectors
    record.extra["secure_aggregation"] = round_.report
    record.wire_bytes_down += sum(b["down"] for b in round_.report["wire_bytes"].values())  # stages 0, 1, 3
    record.wire_bytes_up += sum(b["up"] for b in round_.report["wire_bytes"].values())
    if not pipeline.enough(uploads) or mean is None:
        return None, None
    mean_upload = ClientUpload(-1, mean, int(sum(u.num_examples for u in uploads)), {}, weight=1.0)
    return strategy.aggregate_round(RoundReplies(server_round, record, uploads, weights, True, [mean_upload],
                                                 len(uploads)))


def checked_mean(strategy: SecureStrategy, round_: SecureRound, uploads: list[ClientUpload],
                 sent: Mapping[int, Download],
                 unmasked: tuple[np.ndarray, float]) -> dict[str, np.ndarray] | None:
    """The weighted mean of the summed uploads (the unmasked mean update plus the weighted mean of
    their downloads), or None when the mean update is beyond what the clients' clipped updates can
    average to (:func:`fedlora.secagg.mean_problem`: a client masked something else; the round is
    refused, in its report)."""
    if not uploads:
        return None
    update, total_weight = unmasked
    params, node_of = round_.params, strategy.roster.node_of
    bound = error_bound(params.clipping_range, len(uploads), params.quantization_range, total_weight)
    problem = secagg.mean_problem(update, round_.report["clip_norm"], params.clipping_range, bound)
    if problem:
        round_.fail("mean", f"{problem}: the round is refused (a client masked something other than its clipped "
                            "update; the server cannot tell whose)")
        return None
    shapes = canonical_shapes(sent[uploads[0].partition_id].upload, round_.report["pad_rank"])
    factors = np.array([round_.factors[node_of[u.partition_id]] for u in uploads], dtype=np.float64)
    downloads = np.stack([flatten(sent[u.partition_id].payload, shapes) for u in uploads])  # (|S|, size)
    mean = unflatten(update + factors @ downloads / factors.sum(), shapes)
    payload = {key: value.astype(ADAPTER_DTYPE) for key, value in mean.items()}
    largest = max((float(np.max(np.abs(v))) for v in payload.values() if v.size), default=0.0)
    round_.report.update(masked=len(uploads), total_weight=total_weight, error_bound=bound,
                         error_bound_relative=bound / largest if largest else float("nan"),
                         mean_update_norm=float(np.linalg.norm(update)))
    return payload


def exclude_culprits(strategy: SecureStrategy, round_: SecureRound) -> None:
    """Leave every client the round named out of the rest of the run (``strategy.exclude``: never
    sampled again), with one line each."""
    partition_of = {node: p for p, node in strategy.roster.node_of.items()}
    for node, why in sorted(round_.culprits.items()):
        partition = partition_of.get(node)
        if partition is None or partition in strategy.excluded:
            continue
        strategy.exclude(partition, f"round {round_.server_round}, secure aggregation, {why}")
        log(WARNING, "secure aggregation: client %d (node %d) is left out of the rest of the run: %s", partition,
            node, why)
    round_.report["excluded"] = {str(p): why for p, why in sorted(strategy.excluded.items())}
