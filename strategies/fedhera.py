"""FedHera: resource-decoupled ranks, spectrum-preserving allocation and prefix gating.

ALGORITHMS.md, section FedHera ([CODE]: taken from the official implementation). The math lives
in the pure functions below (over ``dict[str, Factors]`` / ``dict[str, LowRankSVD]``, one entry
per adapted module); :class:`FedHera` only adds the Flower protocol around them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, ClassVar, Literal

import numpy as np
from flwr.supercore import log
from pydantic import Field

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import (
    Factors,
    LowRankSVD,
    Payload,
    factor_svd,
    head_only,
    join_payload,
    payload_bytes,
    scale_tail,
    split_payload,
    split_spectrum,
    weighted_average,
)
from fedlora.profile import ClientProfile
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions

BYTES_PER_PARAM = 4  # adapters cross the wire as float32 arrays
BUDGET_KEYS = ("download", "time", "memory")
ATW_MIN_NORM = 1e-6  # official: a norm at or below this gives s_i = 0
NEVER_SCORED = (0.0, -1)  # official default (s, t_hat) of a client with no score yet
Allocation = Literal["greedy", "uniform", "random"]


# --------------------------------------------------------------------------------------------
# server math: aggregation in factor space
# --------------------------------------------------------------------------------------------


def scaled(factors: Mapping[str, Factors], scales: Mapping[str, float]) -> dict[str, Factors]:
    """Fold each module's scale s = alpha / r into B, so that B A is the update dW."""
    return {m: Factors(f.A, scales[m] * np.asarray(f.B, np.float64)) for m, f in factors.items()}


def trim(svd: LowRankSVD, rtol: float = 1e-8) -> LowRankSVD:
    """Drop the numerically zero singular components (keeps the global rank from growing)."""
    if len(svd.S) == 0 or svd.S[0] <= 0:
        return LowRankSVD(svd.U[:, :0], svd.S[:0], svd.Vt[:0])
    keep = int(np.sum(svd.S > rtol * svd.S[0]))
    return LowRankSVD(svd.U[:, :keep], svd.S[:keep], svd.Vt[:keep])


def aggregate_original(updates: Sequence[Mapping[str, Factors]], weights: Sequence[float]) -> dict[str, LowRankSVD]:
    """G^l = sum_i w_i s_i B_i A_i per module (``updates`` already scaled), as its thin SVD."""
    modules = updates[0].keys()
    return {
        m: trim(factor_svd([u[m].B for u in updates], [u[m].A for u in updates], weights))
        for m in modules
    }


def aggregate_unbiased(
    previous: Mapping[str, LowRankSVD],
    updates: Sequence[Mapping[str, Factors]],
    starts: Sequence[Mapping[str, Factors]],
    weights: Sequence[float],
) -> dict[str, LowRankSVD]:
    """G^l = G_prev^l + sum_i w_i (dW_i - dW_i,init), all scaled factors, as its thin SVD.

    The subtraction travels as negative weights through :func:`factor_svd` (factor space).
    """
    out = {}
    for m, G in previous.items():
        Bs = [G.U * G.S] + [u[m].B for u in updates] + [s[m].B for s in starts]  # (d_out, r) each
        As = [G.Vt] + [u[m].A for u in updates] + [s[m].A for s in starts]  # (r, d_in) each
        w = [1.0, *weights, *(-np.asarray(weights))]
        out[m] = trim(factor_svd(Bs, As, w))
    return out


# --------------------------------------------------------------------------------------------
# server math: water-filling rank allocation
# --------------------------------------------------------------------------------------------


def next_sigma(spectrum: np.ndarray, rank: int) -> float:
    """sigma_{r+1}: the singular value the next column would carry (0 past the spectrum)."""
    return float(spectrum[rank]) if rank < len(spectrum) else 0.0


def _pick(
    candidates: list[str], gains: Mapping[str, float], ranks: Mapping[str, int], policy: Allocation, rng: np.random.Generator
) -> str:
    """The module that gets the next column: best gain (greedy), smallest rank (uniform), or any."""
    if policy == "random":
        return candidates[int(rng.integers(len(candidates)))]
    if policy == "uniform":
        return min(candidates, key=lambda m: ranks[m])  # ties: module order
    return max(candidates, key=lambda m: (gains[m], -ranks[m]))  # ties: spread evenly


def allocate_download(
    spectra: Mapping[str, np.ndarray],
    column_bytes: Mapping[str, int],
    budget: float,
    min_rank: int,
    max_rank: Mapping[str, int],
    policy: Allocation = "greedy",
    rng: np.random.Generator | None = None,
) -> dict[str, int]:
    """r_tot per module: start at ``min_rank``, then repeatedly add a column to the module with
    the largest sigma_{l, r_l+1}^2 / bytes_l among those still affordable, until none is.

    ``column_bytes[l]`` = (d_out + d_in) * bytes_per_param; the total never exceeds ``budget``.
    """
    rng = rng or np.random.default_rng(0)
    ranks = {m: min_rank for m in spectra}
    left = budget - sum(min_rank * column_bytes[m] for m in spectra)
    if left < 0:
        raise ValueError(f"download budget {budget} cannot afford rank {min_rank} on every module")
    while True:
        candidates = [m for m in spectra if ranks[m] < max_rank[m] and column_bytes[m] <= left]
        if not candidates:
            return ranks
        gains = {m: next_sigma(spectra[m], ranks[m]) ** 2 / column_bytes[m] for m in candidates}
        chosen = _pick(candidates, gains, ranks, policy, rng)
        ranks[chosen] += 1
        left -= column_bytes[chosen]


def _pressure(budget: float, left: float) -> float:
    """T / T_left (1 for an undeclared, infinite budget)."""
    return 1.0 if math.isinf(budget) else budget / max(left, 1e-300)


def allocate_training(
    spectra: Mapping[str, np.ndarray],
    r_tot: Mapping[str, int],
    column_time: Mapping[str, float],
    column_memory: Mapping[str, float],
    time_budget: float,
    memory_budget: float,
    min_rank: int,
    policy: Allocation = "greedy",
    rng: np.random.Generator | None = None,
) -> dict[str, int]:
    """r_main^l <= r_tot^l: the same water-filling under the time budget T and memory budget M.

    A column of module l costs c_time_l and c_mem_l; it is ranked by sigma^2 / (a c_time_l +
    b c_mem_l) with a = (T/T_left) / ((T/T_left) + (M/M_left)), b = 1 - a (the scarcer resource
    weighs more), and added only while both totals stay within T and M.
    """
    rng = rng or np.random.default_rng(0)
    ranks = {m: min(min_rank, r_tot[m]) for m in spectra}
    time_left = time_budget - sum(ranks[m] * column_time[m] for m in spectra)
    memory_left = memory_budget - sum(ranks[m] * column_memory[m] for m in spectra)
    if time_left < 0 or memory_left < 0:
        raise ValueError(f"training budgets (T={time_budget}, M={memory_budget}) cannot afford rank {min_rank}")
    while True:
        candidates = [
            m for m in spectra
            if ranks[m] < r_tot[m] and column_time[m] <= time_left and column_memory[m] <= memory_left
        ]
        if not candidates:
            return ranks
        pressure_t, pressure_m = _pressure(time_budget, time_left), _pressure(memory_budget, memory_left)
        a = pressure_t / (pressure_t + pressure_m)
        cost = {m: a * column_time[m] + (1.0 - a) * column_memory[m] for m in candidates}
        gains = {m: next_sigma(spectra[m], ranks[m]) ** 2 / cost[m] for m in candidates}
        chosen = _pick(candidates, gains, ranks, policy, rng)
        ranks[chosen] += 1
        time_left -= column_time[chosen]
        memory_left -= column_memory[chosen]


# --------------------------------------------------------------------------------------------
# server math: spectral push and adaptive tail warm-up
# --------------------------------------------------------------------------------------------


def spectral_push(svd: LowRankSVD, rank: int, scale: float, fresh_A: np.ndarray | None = None) -> Factors:
    """B = U_r diag(sqrt(S_r / s)), A = diag(sqrt(S_r / s)) V_r^T, so s B A = U_r S_r V_r^T.

    Columns past the spectrum's length (G has lower rank than ``rank``) get ``fresh_A`` rows
    (standard LoRA init) and zero B columns: s B A is unchanged, and they can still learn
    (zero rows of both A and B receive no gradient). Without ``fresh_A`` they stay zero.
    """
    head = split_spectrum(svd, rank, scale)  # rank min(rank, len(S))
    missing = rank - head.rank
    if missing == 0:
        return head
    d_out, d_in = svd.U.shape[0], svd.Vt.shape[1]
    tail_A = fresh_A[:missing].astype(np.float32) if fresh_A is not None else np.zeros((missing, d_in), np.float32)
    A = np.concatenate([head.A, tail_A], axis=0)  # (rank, d_in)
    B = np.concatenate([head.B, np.zeros((d_out, missing), np.float32)], axis=1)  # (d_out, rank)
    return Factors(A, B)


def fresh_rows(count: int, d_in: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` rows of peft's default LoRA A init: kaiming-uniform, bound 1 / sqrt(d_in)."""
    bound = 1.0 / math.sqrt(d_in)
    return rng.uniform(-bound, bound, size=(count, d_in)).astype(np.float32)  # (count, d_in)


def frobenius_inner(B1: np.ndarray, A1: np.ndarray, B2: np.ndarray, A2: np.ndarray) -> float:
    """<B1 A1, B2 A2>_F in factor space: sum((B1^T B2) * (A1 A2^T)), no dense d_out x d_in."""
    return float(np.sum((B1.T @ B2) * (A1 @ A2.T)))


def alignment_score(update: Mapping[str, Factors], G: Mapping[str, LowRankSVD]) -> float:
    """ATW score s_i: ONE cosine between the client's whole product and the whole new G.

    Official ``fed_utils/model_aggregation.py`` (l.247-305): over all modules together,
    s_i = sum_l <P_i^l, G^l>_F / (sqrt(sum_l ||P_i^l||_F^2) * sqrt(sum_l ||G^l||_F^2)) with
    P_i^l = s_i B_i^l A_i^l the client's uploaded product (``update``, already scaled; its frozen
    tail carries the lambda it trained with) and G the aggregate this round produced (client i's
    own contribution included). s_i is in [-1, 1]; 0 when either norm is <= 1e-6 (as there).
    """
    inner, update_sq, global_sq = 0.0, 0.0, 0.0
    for m, f in update.items():
        g_B, g_A = G[m].U * G[m].S, G[m].Vt  # G = (U S) Vt
        inner += frobenius_inner(f.B, f.A, g_B, g_A)
        update_sq += frobenius_inner(f.B, f.A, f.B, f.A)
        global_sq += float(np.sum(np.square(G[m].S, dtype=np.float64)))
    update_norm, global_norm = math.sqrt(max(update_sq, 0.0)), math.sqrt(global_sq)
    if update_norm <= ATW_MIN_NORM or global_norm <= ATW_MIN_NORM:
        return 0.0
    return inner / (update_norm * global_norm)


def tail_lambda(score: float, score_round: int, push_round: int, horizon: float, decay: float) -> float:
    """lambda = clip(1 - exp(-(1 + s decay^(e - t_hat)) (e + 1) / T_atw), 0, 1).

    Official lines (``model_aggregation.py`` l.408-418), with their 0-based round indices:
    ``e`` = ``push_round``, the round whose aggregation produced the push (it is trained on in
    round e + 1); ``t_hat`` = ``score_round``, the round in which the client last trained and
    was scored (-1 and s = 0 for a client never scored); T_atw = ``horizon``.
    """
    boost = 1.0 + score * decay ** (push_round - score_round)
    return float(np.clip(1.0 - math.exp(-boost * (push_round + 1) / horizon), 0.0, 1.0))


def push_round_of(server_round: int) -> int:
    """The official 0-based round ``e`` whose push is trained on in fedlora's 1-based
    ``server_round`` (round R trains on the aggregate of round R - 1, i.e. e = R - 2)."""
    return server_round - 2


def scored_round_of(server_round: int) -> int:
    """The official 0-based stamp t_hat of a score computed when 1-based ``server_round`` trained."""
    return server_round - 1


# --------------------------------------------------------------------------------------------
# protocol
# --------------------------------------------------------------------------------------------


class FedHeraOptions(StrategyOptions):
    """FedHera's options. Defaults follow the official code (github.com/shock-xiaoke/FedHera,
    ``main.py`` and ``fed_utils/``); a [RECON] option is a choice the code does not make."""

    aggregation: Literal["original", "unbiased"] = Field(
        "original",
        description="'original' (official default, --fedhera_server_agg original): G = sum_i w_i "
        "s_i B_i A_i over this round's uploads; 'unbiased' (the README's 'paper-style' example): "
        "G = G_prev + sum_i w_i (dW_i - dW_i,init), dW_i,init = what was pushed to client i.",
    )
    unbiased_reference: Literal["push", "start"] = Field(
        "push",
        description="dW_i,init of 'unbiased': 'push' = the push as sent (official: read back from "
        "the saved push file, tail not scaled by lambda); [RECON] 'start' = the push with its "
        "tail scaled by lambda_i, the client's real starting point.",
    )
    allocation: Allocation = Field(
        "greedy",
        description="How budgets become ranks: 'greedy' water-filling on sigma^2 / cost (paper); "
        "ablations 'uniform' (one column per module in turn) and 'random' (seeded).",
    )
    coupled: bool = Field(
        False, description="Ablation: r_tot = r_main (download only what is trained, no frozen tail)."
    )
    atw: bool = Field(
        False,
        description="Adaptive tail warm-up: scale the frozen tail by lambda_k. Off by default as in "
        "the official code (--use_atw is store_true) and as in the abstract, which names the "
        "allocation and prefix gating but not ATW; the official README examples turn it on "
        "(the fidelity benchmark runs both).",
    )
    atw_horizon: float = Field(2.0, gt=0.0, description="T_atw of the lambda schedule (official --atw_temperature 2.0).")
    atw_decay: float = Field(
        0.9, gt=0.0, le=1.0, description="Per-round decay of a client's remembered score (official: beta = 0.9)."
    )
    time_unit: float = Field(1.0, gt=0.0, description="t_unit: time units per trained parameter.")
    memory_unit: float = Field(1.0, gt=0.0, description="m_unit: memory units per trained parameter.")
    min_rank: int = Field(1, ge=1, description="[RECON] Smallest r_tot and r_main of any module.")
    initial_rank: int = Field(
        0,
        ge=0,
        description="Rank of every module of every client in round 1 (standard init, every column "
        "trainable); 0 = model.lora_rank (official main.py: every client trains lora_r = 8 in "
        "its first round, whatever its tier).",
    )
    initial_budget: Literal["ignore", "fit"] = Field(
        "ignore",
        description="Budgets in round 1: 'ignore' (official: budgets apply from the first push "
        "on; round-1 downloads are not counted as violations); [RECON] 'fit': lower the round-1 "
        "rank to the largest rank <= the initial rank that every client's budgets afford.",
    )
    fresh_components: bool = Field(
        False,
        description="[RECON] Columns past the numerical rank of G start as standard LoRA init "
        "(A kaiming, B = 0) instead of the official near-zero columns (sigma ~ 0: A = B = 0, which "
        "receive no gradient).",
    )


@dataclass
class Budgets:
    download: float  # bytes per round
    time: float  # time units
    memory: float  # memory units


@dataclass
class Push:
    """What one client received for one round."""

    r_tot: dict[str, int]
    r_main: dict[str, int]
    lam: float
    payload: Payload
    bytes: int
    budget_applies: bool = True  # False for round 1 under initial_budget = 'ignore' (official)


class FedHera(LoRAStrategy):
    """FedHera: each client downloads as much of the global spectrum as its bandwidth allows
    (r_tot per module) and trains only what its compute allows (r_main <= r_tot).

    Paper: FedHera (2026), ALGORITHMS.md "FedHera" ([CODE], from the official implementation).

    Parameters
    ----------
    aggregation : {'original', 'unbiased'}, default 'original'
        'original': G = sum_i w_i s_i B_i A_i; 'unbiased': G = G_prev + sum_i w_i (dW_i - dW_i,init).
    unbiased_reference : {'push', 'start'}, default 'push'
        dW_i,init of 'unbiased': the push as sent (official) or [RECON] the client's start (tail
        scaled by lambda).
    allocation : {'greedy', 'uniform', 'random'}, default 'greedy'
        Water-filling of the budgets on sigma^2 / cost (paper), or the ablations.
    coupled : bool, default False
        Ablation: r_tot = r_main (no frozen tail).
    atw : bool, default False
        Adaptive tail warm-up (lambda schedule); off as in the official code's default.
    atw_horizon : float, default 2.0
        T_atw of the lambda schedule.
    atw_decay : float, default 0.9
        Per-round decay of a client's remembered alignment score.
    time_unit, memory_unit : float, default 1.0
        t_unit and m_unit: a column of module l costs (d_out + d_in) * unit.
    min_rank : int, default 1
        [RECON] Smallest r_tot / r_main of any module (peft needs r >= 1).
    initial_rank : int, default 0
        Round-1 rank of every module of every client; 0 = model.lora_rank (official).
    initial_budget : {'ignore', 'fit'}, default 'ignore'
        Round 1 ignores the budgets (official) or [RECON] fits the initial rank to them.
    fresh_components : bool, default False
        [RECON] Columns past the spectrum's rank start as standard init instead of zero.

    Budgets: a client declares ``download`` (bytes per round, LoRA factors + head), ``time`` and
    ``memory`` (units) in its profile (``clients.budget_tiers`` or node config ``budget-*``);
    the server learns them by query. A budget not declared defaults to what a uniform adapter at
    the client's declared rank costs (so a plain rank-r client behaves as r_tot = r_main = r).

    Upload: all of A and B at the client's r_tot (frozen tail included) and the head.

    Aggregation: per module, the thin SVD of G = sum_i w_i s_i B_i A_i (or the 'unbiased'
    update) in factor space, w_i = n_i / sum n; the head is averaged (FedAvg). Each upload's
    cosine with G (one cosine over all modules, official) is remembered as its ATW score.

    Download: for each client sampled for the next round, water-filling gives r_tot^l under the
    download budget and r_main^l <= r_tot^l under the time / memory budgets; the client gets
    B = U_r sqrt(S_r / s), A = sqrt(S_r / s) V_r^T (s = alpha / r_tot^l), the head, and r_tot,
    r_main and lambda_k in its config. It scales the tail by sqrt(lambda_k) and trains only the
    prefix A[:r_main], B[:, :r_main]. Round 1: every module at the same initial rank, standard init.
    """

    name = "fedhera"
    phase: str = "train"  # which hook is building messages: 'train' or 'evaluate'
    train_round: int = 0  # the round whose training uploads are being checked
    Options = FedHeraOptions
    options: FedHeraOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=False,
        uploads="A, B (r_tot, tail included), head",
        downloads="top-r_tot spectrum of G per module, head; r_tot, r_main, lambda",
        mixed_ranks=True,
        dp_compatible=False,  # prefix gating edits p.grad; Opacus steps on per-example grads
        paper="FedHera, 2026 (ALGORITHMS.md, official code)",
    )

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        if experiment.model.init == "pissa":
            raise ConfigError(
                "strategy 'fedhera' cannot use model.init = 'pissa' (it rewrites the base per rank "
                "and FedHera changes ranks every round); set model.init = 'kaiming'"
            )
        if experiment.train.weight_decay != 0.0:
            raise ConfigError(
                f"strategy 'fedhera' trains with weight decay 0 (prefix gating), got "
                f"train.weight_decay = {experiment.train.weight_decay}; set train.weight_decay = 0"
            )

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
            download=declared.get("download", params * BYTES_PER_PARAM + self.head_bytes),
            time=declared.get("time", params * self.options.time_unit),
            memory=declared.get("memory", params * self.options.memory_unit),
        )

    def uniform_rank_fits(self, budgets: Budgets, rank: int) -> bool:
        params = rank * sum(self.column_params.values())
        return (
            params * BYTES_PER_PARAM + self.head_bytes <= budgets.download
            and params * self.options.time_unit <= budgets.time
            and params * self.options.memory_unit <= budgets.memory
        )

    def check_profile(self, profile: ClientProfile) -> str:
        problem = super().check_profile(profile)
        unknown = sorted(set(profile.budgets) - set(BUDGET_KEYS))
        if problem or unknown:
            return problem or f"unknown budgets {unknown} (FedHera reads {list(BUDGET_KEYS)})"
        budgets = self.budgets_of(profile)
        rank = self.options.initial_rank if self.options.initial_budget == "fit" else 0
        rank = max(rank, self.options.min_rank)
        if not self.uniform_rank_fits(budgets, rank):
            return f"budgets {budgets} cannot afford rank {rank} on every module (plus the head)"
        return ""

    # ---------------------------------------------------------------- state
    def setup(self) -> None:
        self.budgets = {node: self.budgets_of(p) for node, p in self.profiles.items()}
        self.initial_rank = self.options.initial_rank or self.experiment.model.lora_rank
        if self.options.initial_budget == "fit":
            self.initial_rank = max(
                r for r in range(self.options.min_rank, max(self.initial_rank, self.options.min_rank) + 1)
                if all(self.uniform_rank_fits(b, r) for b in self.budgets.values())
            )
        self.max_rank = {m: min(shape) for m, shape in self.module_shapes.items()}
        self.G: dict[str, LowRankSVD] | None = None  # None until the first aggregation
        self.head: Payload = dict(self.head_initial)
        self.scores: dict[int, tuple[float, int]] = {}  # partition -> (ATW score s, official 0-based t_hat)
        self.pushes: dict[tuple[int, int], Push] = {}  # (node, round) -> what it got
        self.last_push: dict[int, Push] = {}
        self.violations = 0
        self.allocation_rng = np.random.default_rng([self.experiment.train.seed, 7])  # 'random' ablation
        self._global: Payload | None = None
        log(INFO, "setup: FedHera initial rank %d, budgets %s", self.initial_rank,
            {self.partition_of(n): b for n, b in sorted(self.budgets.items(), key=lambda kv: self.partition_of(kv[0]))})

    def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        self.phase, self.train_round = "train", server_round
        return super().configure_train(server_round, arrays, config, grid)

    def configure_evaluate(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
        self.phase = "evaluate"
        return super().configure_evaluate(server_round, arrays, config, grid)

    # ---------------------------------------------------------------- download
    def allocate(self, node_id: int) -> tuple[dict[str, int], dict[str, int]]:
        """(r_tot, r_main) of ``node_id`` under its budgets and the current spectrum of G."""
        assert self.G is not None
        spectra = {m: G.S for m, G in self.G.items()}
        budgets, opts = self.budgets[node_id], self.options
        column_bytes = {m: c * BYTES_PER_PARAM for m, c in self.column_params.items()}
        r_tot = allocate_download(
            spectra, column_bytes, budgets.download - self.head_bytes, opts.min_rank, self.max_rank, opts.allocation, self.allocation_rng
        )
        r_main = allocate_training(
            spectra, r_tot,
            {m: c * opts.time_unit for m, c in self.column_params.items()},
            {m: c * opts.memory_unit for m, c in self.column_params.items()},
            budgets.time, budgets.memory, opts.min_rank, opts.allocation, self.allocation_rng,
        )
        return (dict(r_main) if opts.coupled else r_tot), r_main

    def lam(self, node_id: int, server_round: int) -> float:
        """lambda_k of the push trained on in ``server_round`` (1 without ATW and in round 1,
        which has no push)."""
        if not self.options.atw or server_round < 2:
            return 1.0
        score, seen = self.scores.get(self.partition_of(node_id), NEVER_SCORED)
        push_round = push_round_of(server_round)
        return tail_lambda(score, seen, push_round, self.options.atw_horizon, self.options.atw_decay)

    def download(self, node_id: int, server_round: int) -> Payload:
        key = (node_id, server_round)
        if key not in self.pushes:
            self.pushes[key] = self._push(node_id, server_round)
        push = self.last_push[node_id] = self.pushes[key]
        if push.budget_applies and push.bytes > self.budgets[node_id].download:
            self.violations += 1
            log(WARNING, "download: client %d gets %d bytes over its budget %.0f",
                self.partition_of(node_id), push.bytes, self.budgets[node_id].download)
        return push.payload

    def _push(self, node_id: int, server_round: int) -> Push:
        if self.G is None:  # round 1: the seeded initial adapter, one rank everywhere
            ranks = {m: self.initial_rank for m in self.module_shapes}
            payload = dict(self.initial_adapter(self.initial_rank))
            if not self.sends_head:
                payload = {k: v for k, v in payload.items() if k not in self.head}
            applies = self.options.initial_budget == "fit"
            return Push(ranks, dict(ranks), 1.0, payload, payload_bytes(payload), budget_applies=applies)
        r_tot, r_main = self.allocate(node_id)
        alpha = self.experiment.model.lora_alpha
        rng = np.random.default_rng([self.experiment.train.seed, server_round, self.partition_of(node_id)])
        factors = {}
        for m, G in self.G.items():
            missing = max(r_tot[m] - len(G.S), 0)
            fresh = fresh_rows(missing, G.Vt.shape[1], rng) if self.options.fresh_components else None
            factors[m] = spectral_push(G, r_tot[m], alpha / r_tot[m], fresh)
        payload = join_payload(factors, self.head if self.sends_head else None)
        return Push(r_tot, r_main, self.lam(node_id, server_round), payload, payload_bytes(payload))

    def client_config(self, node_id: int, server_round: int) -> dict[str, Any]:
        push = self.last_push[node_id]  # the base class builds the message right after download()
        return {
            "fedhera-r-tot": json.dumps(push.r_tot),
            "fedhera-r-main": json.dumps(push.r_main),
            "fedhera-lambda": push.lam if self.phase == "train" else 1.0,
        }

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        push = self.pushes[(node_id, self.train_round)]
        shapes: dict[str, tuple[int, ...]] = {}
        for m, (d_out, d_in) in self.module_shapes.items():
            shapes[m + "::A"] = (push.r_tot[m], d_in)
            shapes[m + "::B"] = (d_out, push.r_tot[m])
        if self.sends_head:
            shapes.update({k: tuple(v.shape) for k, v in self.head.items()})
        return shapes

    # ---------------------------------------------------------------- aggregation
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = [float(w) for w in self.weights(uploads)]
        alpha = self.experiment.model.lora_alpha
        updates, starts = [], []
        for u in uploads:
            push = self.pushes[(u.node_id, server_round)]
            scales = {m: alpha / r for m, r in push.r_tot.items()}
            updates.append(scaled(split_payload(u.payload)[0], scales))
            start = split_payload(push.payload)[0]
            if self.options.unbiased_reference == "start":
                start = scale_tail(start, push.r_main, push.lam)
            starts.append(scaled(start, scales))
        if self.options.aggregation == "unbiased":
            self.G = aggregate_unbiased(self.G or self._initial_G(), updates, starts, weights)
        else:
            self.G = aggregate_original(updates, weights)
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], weights)
        for u, update in zip(uploads, updates):
            self.scores[u.partition_id] = (alignment_score(update, self.G), scored_round_of(server_round))
        self._global = None
        self.pushes = {k: v for k, v in self.pushes.items() if k[1] >= server_round}

    def _initial_G(self) -> dict[str, LowRankSVD]:
        """G before any aggregation: s B0 A0 of the initial adapter (zero with kaiming init)."""
        factors = split_payload(self.initial_adapter(self.initial_rank))[0]
        return {m: trim(factor_svd([f.B * (self.experiment.model.lora_alpha / f.rank)], [f.A], [1.0]))
                for m, f in factors.items()}

    def global_payload(self) -> Payload:
        """Round 0: the initial adapter; then G itself (its full numerical rank) and the head."""
        if self.G is None:
            return dict(self.initial_adapter(self.initial_rank))
        if self._global is None:
            alpha = self.experiment.model.lora_alpha
            factors = {m: spectral_push(G, max(len(G.S), 1), alpha / max(len(G.S), 1)) for m, G in self.G.items()}
            self._global = join_payload(factors, self.head)
        return self._global

    def round_extra(self, server_round: int) -> dict[str, Any]:
        rows = {
            str(self.partition_of(node)): {
                "download_bytes": push.bytes,
                "download_budget": self.budgets[node].download,
                "r_tot": sum(push.r_tot.values()),
                "r_main": sum(push.r_main.values()),
                "lambda": push.lam,
                "budget_applies": push.budget_applies,
            }
            for (node, rnd), push in self.pushes.items()
            if rnd == server_round
        }
        violations, self.violations = self.violations, 0
        return {"fedhera": {"clients": rows, "budget_violations": violations}}

