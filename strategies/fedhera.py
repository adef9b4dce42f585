"""FedHera: resource-decoupled ranks, spectrum-preserving allocation and prefix gating: the
server protocol (the math and the options are ``fedlora/methods/fedhera.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from logging import INFO, WARNING, getLogger
from typing import Any

import numpy as np

from fedlora import protocol, state
from fedlora.lora import (
    LowRankSVD,
    Payload,
    adapter_shapes,
    factor_svd,
    join_payload,
    kaiming_rows,
    lora_scale,
    payload_bytes,
    scaled,
    split_payload,
    trim,
)
from fedlora.methods import fedhera
from fedlora.profile import ClientProfile
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


@state.register
@dataclass
class Budgets:
    download: float  # bytes per round
    time: float  # time units
    memory: float  # memory units


@state.register
@dataclass
class Push:
    """What one client received for one round."""

    r_tot: dict[str, int]
    r_main: dict[str, int]
    lam: float
    payload: Payload
    bytes: int
    budget_applies: bool = True  # False for round 1 under initial_budget = 'ignore' (official)


class FedHera(LoRAStrategy[fedhera.FedHeraOptions]):
    """FedHera: each client downloads as much of the global spectrum as its bandwidth allows
    (r_tot per module) and trains only what its compute allows (r_main <= r_tot).

    Paper: FedHera (2026); official code github.com/shock-xiaoke/FedHera (docs/algorithms.md, FedHera).

    Parameters
    ----------
    aggregation : {'original', 'unbiased'}, default 'original'
        'original' (official default, --fedhera_server_agg original): G = sum_i w_i s_i B_i A_i over this
        round's uploads; 'unbiased' (the README's 'paper-style' example): G = G_prev + sum_i w_i (dW_i -
        dW_i,init), dW_i,init = what was pushed to client i.
    unbiased_reference : {'push', 'start'}, default 'push'
        dW_i,init of 'unbiased': 'push' = the push as sent (official: read back from the saved push file,
        tail not scaled by lambda); [RECON] 'start' = the push with its tail scaled by lambda_i, the
        client's real starting point.
    allocation : {'greedy', 'uniform', 'random'}, default 'greedy'
        How budgets become ranks (official --ablation): 'greedy' water-filling on sigma^2 / cost
        (rank_allocator.py); ablations 'uniform' (every module at the largest affordable common rank,
        r_main capped by T and M alike) and 'random' (columns to uniformly drawn affordable modules,
        seeded by train.seed here, unseeded there; r_main as in 'uniform').
    coupled : bool, default False
        Ablation: r_tot = r_main (download only what is trained, no frozen tail).
    atw : bool, default False
        Adaptive tail warm-up: scale the frozen tail by lambda_k. Off by default as in the official code
        (--use_atw is store_true); kept off on validation by the fedhera fidelity scenario's tuning
        (0.9213 off, 0.9200 on at 100 rounds; the runs: docs/algorithms.md).
    atw_horizon : float > 0, default 2.0
        T_atw of the lambda schedule (official --atw_temperature 2.0).
    atw_decay : float in (0, 1], default 0.9
        Per-round decay of a client's remembered score (official: beta = 0.9).
    time_unit : float > 0, default 1.0
        t_unit: time units per trained parameter.
    memory_unit : float > 0, default 1.0
        m_unit: memory units per trained parameter.
    min_rank : int >= 0, default 0
        Smallest r_tot and r_main of any module. 0 (official rank_allocator.py: both greedy passes start
        every module at 0): a module with r_main = 0 is frozen on that client (its downloaded columns act
        in the forward pass, untrained, and go back up unchanged), one with r_tot = 0 is not adapted there
        (nothing downloaded or uploaded; peft cannot build a rank-0 layer, so the client holds a zero
        rank-1 placeholder, A = B = 0, frozen, never sent). [RECON] 1: every module downloaded and trained
        at rank >= 1 (fedlora's earlier default).
    initial_rank : int >= 0, default 0
        Rank of every module of every client in round 1 (standard init, every column trainable); 0 =
        model.lora_rank (official main.py: every client trains lora_r = 8 in its first round, whatever its
        tier).
    initial_budget : {'ignore', 'fit'}, default 'ignore'
        Budgets in round 1: 'ignore' (official: budgets apply from the first push on; round-1 downloads
        are not counted as violations); [RECON] 'fit': lower the round-1 rank to the largest rank <= the
        initial rank that every client's budgets afford.
    fresh_components : bool, default False
        [RECON] Columns past the numerical rank of G start as standard LoRA init (A kaiming, B = 0)
        instead of the official near-zero columns (sigma ~ 0: A = B = 0, which receive no gradient).

    Budgets: a client declares ``download`` (bytes per round, LoRA factors + head), ``time`` and
    ``memory`` (units) in its profile (``clients.budget_tiers`` or node config ``budget-*``);
    the server learns them by query. A budget not declared defaults to what a uniform adapter at
    the client's declared rank costs (so a plain rank-r client behaves as r_tot = r_main = r).

    Upload: all of A and B at the client's r_tot (frozen tail included) and the head; a module
    with r_tot = 0 is neither downloaded nor uploaded, and counts as a zero term (the client's
    adapter there is zero) with the client's weight in 'original', as no term in 'unbiased'.

    Aggregation: per module, the thin SVD of G = sum_i w_i s_i B_i A_i (or the 'unbiased'
    update) in factor space, w_i = n_i / sum n; the head is averaged (FedAvg). Each upload's
    cosine with G (one cosine over all modules, official) is remembered as its ATW score.

    Download: for each client sampled for the next round, water-filling gives r_tot^l under the
    download budget and r_main^l <= r_tot^l under the time / memory budgets; the client gets
    B = U_r sqrt(S_r / s), A = sqrt(S_r / s) V_r^T (s = alpha / r_tot^l), the head, and r_tot,
    r_main and lambda_k in its config. It scales the tail by sqrt(lambda_k) and trains only the
    prefix A[:r_main], B[:, :r_main]. Round 1: every module at the same initial rank, standard init.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns the global model (G at its full
    numerical rank per module, B = U sqrt(S / s), A = sqrt(S / s) V^T, s = alpha / rank, and the
    head); ``configure_*`` continue from the arrays given (the same keys and shapes): G = s B A
    (its thin SVD) and the head are taken from them, and the next pushes are allocated on it.
    """

    RETIRED_STATE = frozenset({"sent", "violations"})  # checkpoints before the Download value
    STATE = (*LoRAStrategy.STATE, "G", "_global", "allocation_rng", "budgets", "head", "initial_rank", "max_rank", "pushes", "scores", "tiers")  # checkpointed

    # ---------------------------------------------------------------- budgets
    @property
    def column_params(self) -> dict[str, int]:
        """d_out + d_in: parameters of one rank column (a row of A and a column of B)."""
        return {m: d_out + d_in for m, (d_out, d_in) in self.module_shapes.items()}

    @property
    def head_bytes(self) -> int:
        return payload_bytes(self.head_initial) if self.sends_head else 0

    def budgets_of(self, profile: ClientProfile) -> Budgets:
        """Declared budgets; an undeclared one costs what a uniform rank-``profile.rank`` adapter does."""
        params = profile.rank * sum(self.column_params.values())
        declared = profile.budgets
        return Budgets(
            download=declared.get("download", params * fedhera.BYTES_PER_PARAM + self.head_bytes),
            time=declared.get("time", params * self.options.time_unit),
            memory=declared.get("memory", params * self.options.memory_unit),
        )

    def uniform_rank_fits(self, budgets: Budgets, rank: int) -> bool:
        params = rank * sum(self.column_params.values())
        return (
            params * fedhera.BYTES_PER_PARAM + self.head_bytes <= budgets.download
            and params * self.options.time_unit <= budgets.time
            and params * self.options.memory_unit <= budgets.memory
        )

    def check_profile(self, profile: ClientProfile) -> str:
        problem = super().check_profile(profile)
        unknown = sorted(set(profile.budgets) - set(fedhera.BUDGET_KEYS))
        if problem or unknown:
            return problem or f"unknown budgets {unknown} (FedHera reads {list(fedhera.BUDGET_KEYS)})"
        budgets = self.budgets_of(profile)
        # 'fit' needs a round-1 rank >= 1 on every module; otherwise only the floor (and the head) must fit
        rank = max(self.options.initial_rank, 1) if self.options.initial_budget == "fit" else 0
        rank = max(rank, self.options.min_rank)
        if not self.uniform_rank_fits(budgets, rank):
            return f"budgets {budgets} cannot afford rank {rank} on every module (plus the head)"
        return ""

    # ---------------------------------------------------------------- state
    def setup(self) -> None:
        self.budgets = {p: self.budgets_of(profile) for p, profile in self.roster.profiles.items()}
        self.initial_rank = self.options.initial_rank or self.experiment.model.lora_rank
        if self.options.initial_budget == "fit":
            self.initial_rank = max(
                r for r in range(max(self.options.min_rank, 1), max(self.initial_rank, self.options.min_rank, 1) + 1)
                if all(self.uniform_rank_fits(b, r) for b in self.budgets.values())
            )
        self.max_rank = {m: min(shape) for m, shape in self.module_shapes.items()}
        self.G: dict[str, LowRankSVD] | None = None  # None until the first aggregation
        self.head: Payload = dict(self.head_initial)
        self.scores: dict[int, tuple[float, int]] = {}  # partition -> (ATW score s, official 0-based t_hat)
        self.pushes: dict[tuple[int, int], Push] = {}  # (partition, round) -> what it got
        self.allocation_rng = np.random.default_rng([self.experiment.train.seed, 7])  # 'random' ablation
        self.tiers = {p: self.tier_of(profile) for p, profile in self.roster.profiles.items()}
        self._global: Payload | None = None
        log(INFO, "setup: FedHera initial rank %d, budgets %s", self.initial_rank, dict(sorted(self.budgets.items())))

    def tier_of(self, profile: ClientProfile) -> str:
        """The budget tier a client's declared budgets match (clients.budget_tiers, by name), for
        the round records; 'custom' when they match none (a node config override), 'all' when
        no tiers are configured."""
        tiers = self.experiment.clients.budget_tiers
        if not tiers:
            return "all"
        for index, tier in enumerate(tiers):
            if tier.budgets() == profile.budgets:
                return fedhera.tier_label(tier.name, index)
        return "custom"

    # ---------------------------------------------------------------- download
    def allocate(self, partition: int) -> tuple[dict[str, int], dict[str, int]]:
        """(r_tot, r_main) of client ``partition`` under its budgets and the current spectrum of G,
        the modules in the model's order (the official order, which breaks ties)."""
        assert self.G is not None
        spectra = {m: self.G[m].S for m in self.module_shapes}
        budgets, opts = self.budgets[partition], self.options
        column_bytes = {m: c * fedhera.BYTES_PER_PARAM for m, c in self.column_params.items()}
        r_tot = fedhera.allocate_download(
            spectra, column_bytes, budgets.download - self.head_bytes, opts.min_rank, self.max_rank, opts.allocation, self.allocation_rng
        )
        r_main = fedhera.allocate_training(
            spectra, r_tot,
            {m: c * opts.time_unit for m, c in self.column_params.items()},
            {m: c * opts.memory_unit for m, c in self.column_params.items()},
            budgets.time, budgets.memory, opts.min_rank, opts.allocation,
        )
        return (dict(r_main) if opts.coupled else r_tot), r_main

    def lam(self, partition: int, server_round: int) -> float:
        """lambda_k of the push trained on in ``server_round`` (1 without ATW and in round 1,
        which has no push)."""
        if not self.options.atw or server_round < 2:
            return 1.0
        score, seen = self.scores.get(partition, fedhera.NEVER_SCORED)
        push_round = fedhera.push_round_of(server_round)
        return fedhera.tail_lambda(score, seen, push_round, self.options.atw_horizon, self.options.atw_decay)

    def push_for(self, partition: int, for_round: int) -> Push:
        """The push of client ``partition`` for ``for_round``, built once: the evaluation after round
        t sends the push round t + 1 trains from."""
        key = (partition, for_round)
        if key not in self.pushes:
            self.pushes[key] = self._push(partition, for_round)
        return self.pushes[key]

    def download(self, partition: int, for_round: int, phase: protocol.Phase) -> Download:
        """The push (``context``), its ranks and lambda in the config, and its shapes for the reply:
        A and B at r_tot of every module with r_tot > 0, and the head."""
        push = self.push_for(partition, for_round)
        config: dict[str, bool | int | float | str] = {
            protocol.FEDHERA_R_TOT: json.dumps(push.r_tot),
            protocol.FEDHERA_R_MAIN: json.dumps(push.r_main),
            protocol.FEDHERA_LAMBDA: push.lam if phase == "train" else 1.0,
        }
        upload = adapter_shapes(self.module_shapes, push.r_tot) | {k: v.shape for k, v in self.head.items() if self.sends_head}
        return Download(partition, for_round, phase, push.payload, config, upload, context=push)

    def _push(self, partition: int, server_round: int) -> Push:
        if self.G is None:  # round 1: the seeded initial adapter, one rank everywhere
            ranks = {m: self.initial_rank for m in self.module_shapes}
            payload = dict(self.initial_adapter(self.initial_rank))
            if not self.sends_head:
                payload = {k: v for k, v in payload.items() if k not in self.head}
            applies = self.options.initial_budget == "fit"
            return Push(ranks, dict(ranks), 1.0, payload, payload_bytes(payload), budget_applies=applies)
        r_tot, r_main = self.allocate(partition)
        alpha = self.experiment.model.lora_alpha
        rng = np.random.default_rng([self.experiment.train.seed, server_round, partition])
        factors = {}
        for m, G in self.G.items():
            if r_tot[m] == 0:  # not adapted on this client: nothing to send
                continue
            missing = max(r_tot[m] - len(G.S), 0)
            fresh = kaiming_rows(missing, G.Vt.shape[1], rng) if self.options.fresh_components else None
            factors[m] = fedhera.spectral_push(G, r_tot[m], lora_scale(alpha, r_tot[m]), fresh)
        payload = join_payload(factors, self.head if self.sends_head else None)
        return Push(r_tot, r_main, self.lam(partition, server_round), payload, payload_bytes(payload))

    # ---------------------------------------------------------------- aggregation
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = [float(w) for w in self.weights(uploads)]
        alpha = self.experiment.model.lora_alpha
        updates, starts = [], []
        for u in uploads:
            push = u.download.context if u.download is not None else self.push_for(u.partition_id, server_round)
            scales = {m: lora_scale(alpha, r) for m, r in push.r_tot.items() if r > 0}
            updates.append(scaled(split_payload(u.payload)[0], scales))
            start = split_payload(push.payload)[0]
            if self.options.unbiased_reference == "start":
                start = fedhera.scale_tail(start, push.r_main, push.lam)
            starts.append(scaled(start, scales))
        if self.options.aggregation == "unbiased":
            self.G = fedhera.aggregate_unbiased(self.G or self._initial_G(), updates, starts, weights)
        else:
            self.G = fedhera.aggregate_original(updates, weights, self.module_shapes)
        self.head = self.averaged_head(uploads, weights, self.head)
        for u, update in zip(uploads, updates):
            self.scores[u.partition_id] = (fedhera.alignment_score(update, self.G), fedhera.scored_round_of(server_round))
        self._global = None
        self.pushes = {k: v for k, v in self.pushes.items() if k[1] > server_round}

    def _initial_G(self) -> dict[str, LowRankSVD]:
        """G before any aggregation: s B0 A0 of the initial adapter (zero with kaiming init)."""
        factors = split_payload(self.initial_adapter(self.initial_rank))[0]
        alpha = self.experiment.model.lora_alpha
        return {m: trim(factor_svd([f.B * lora_scale(alpha, f.rank)], [f.A], [1.0])) for m, f in factors.items()}

    def load_arrays(self, payload: Payload) -> None:
        factors, head = split_payload(payload)
        alpha = self.experiment.model.lora_alpha
        self.G = {m: trim(factor_svd([f.B * lora_scale(alpha, f.rank)], [f.A], [1.0])) for m, f in factors.items()}
        self.head = head
        self._global = None
        self.pushes = {}  # allocated on the old G

    def global_payload(self) -> Payload:
        """Round 0: the initial adapter; then G itself (its full numerical rank) and the head."""
        if self.G is None:
            return dict(self.initial_adapter(self.initial_rank))
        if self._global is None:
            alpha = self.experiment.model.lora_alpha
            factors = {m: fedhera.spectral_push(G, max(len(G.S), 1), lora_scale(alpha, max(len(G.S), 1))) for m, G in self.G.items()}
            self._global = join_payload(factors, self.head)
        return self._global

    def round_extra(self, server_round: int) -> dict[str, Any]:
        """Per sampled client its download, budget, ranks (summed over modules) and lambda under
        ``fedhera``; flat numeric keys per budget tier (:func:`fedhera.round_summary`)."""
        sampled: dict[int, Push] = {p: d.context for p, d in sorted(self.sent_this_round("train").items())}
        rows = {
            str(partition): {
                "download_bytes": push.bytes,
                "download_budget": self.budgets[partition].download,
                "r_tot": sum(push.r_tot.values()),
                "r_main": sum(push.r_main.values()),
                "lambda": push.lam,
                "budget_applies": push.budget_applies,
            }
            for partition, push in sampled.items()
        }
        tiers: dict[str, list[tuple[dict[str, int], dict[str, int]]]] = {}
        for partition, push in sampled.items():
            tiers.setdefault(self.tiers.get(partition, "custom"), []).append((push.r_tot, push.r_main))
        lambdas = [push.lam for push in sampled.values()] if self.options.atw else None
        over = [p for p, push in sampled.items() if push.budget_applies and push.bytes > self.budgets[p].download]
        for p in over:
            log(WARNING, "fedhera: round %d: client %d got %d bytes, over its budget %.0f", server_round, p,
                sampled[p].bytes, self.budgets[p].download)
        return {"fedhera": {"clients": rows, "budget_violations": len(over)}, **fedhera.round_summary(tiers, lambdas)}
