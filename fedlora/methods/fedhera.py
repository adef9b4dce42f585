"""FedHera: resource-decoupled ranks, spectrum-preserving allocation, prefix gating.

FedHera (2026). Taken from the official implementation (github.com/shock-xiaoke/FedHera:
``main.py``, ``fed_utils/model_aggregation.py``, ``fed_utils/rank_allocator.py``,
``fed_utils/adaptive_peft.py``); every choice that code does not make is a [RECON] option below
(docs/algorithms.md). Pure math over ``dict[str, Factors]`` / ``dict[str, LowRankSVD]`` (one entry
per adapted module); the protocol is ``strategies/fedhera.py``, the client step
``clients/trainers/fedhera.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError
from fedlora.lora import (
    Factors,
    LowRankSVD,
    factor_svd,
    product_inner,
    split_spectrum,
    trim,
)
from fedlora.methods.base import Method, MethodOptions
from fedlora.schema import ExperimentConfig

BYTES_PER_PARAM = 4  # adapters cross the wire as float32 arrays
BUDGET_KEYS = ("download", "time", "memory")
ATW_MIN_NORM = 1e-6  # official: a norm at or below this gives s_i = 0
NEVER_SCORED = (0.0, -1)  # official default (s, t_hat) of a client with no score yet
NO_TAIL_SCALING = 0.999  # official: lambda at or above this leaves the tail as it is
Allocation = Literal["greedy", "uniform", "random"]


class FedHeraOptions(MethodOptions):
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
        description="How budgets become ranks (official --ablation): 'greedy' water-filling on "
        "sigma^2 / cost (rank_allocator.py); ablations 'uniform' (every module at the largest "
        "affordable common rank, r_main capped by T and M alike) and 'random' (columns to "
        "uniformly drawn affordable modules, seeded by train.seed here, unseeded there; r_main "
        "as in 'uniform').",
    )
    coupled: bool = Field(
        False, description="Ablation: r_tot = r_main (download only what is trained, no frozen tail)."
    )
    atw: bool = Field(
        False,
        description="Adaptive tail warm-up: scale the frozen tail by lambda_k. Off by default as in "
        "the official code (--use_atw is store_true); kept off on validation by the fedhera fidelity "
        "scenario's tuning (0.9213 off, 0.9200 on at 100 rounds; the runs: docs/algorithms.md).",
    )
    atw_horizon: float = Field(2.0, gt=0.0, description="T_atw of the lambda schedule (official --atw_temperature 2.0).")
    atw_decay: float = Field(
        0.9, gt=0.0, le=1.0, description="Per-round decay of a client's remembered score (official: beta = 0.9)."
    )
    time_unit: float = Field(1.0, gt=0.0, description="t_unit: time units per trained parameter.")
    memory_unit: float = Field(1.0, gt=0.0, description="m_unit: memory units per trained parameter.")
    min_rank: int = Field(
        0,
        ge=0,
        description="Smallest r_tot and r_main of any module. 0 (official rank_allocator.py: both "
        "greedy passes start every module at 0): a module with r_main = 0 is frozen on that "
        "client (its downloaded columns act in the forward pass, untrained, and go back up "
        "unchanged), one with r_tot = 0 is not adapted there (nothing downloaded or uploaded; "
        "peft cannot build a rank-0 layer, so the client holds a zero rank-1 placeholder, "
        "A = B = 0, frozen, never sent). [RECON] 1: every module downloaded and trained at rank "
        ">= 1 (fedlora's earlier default).",
    )
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


# --------------------------------------------------------------------------------------------
# server: aggregation in factor space
# --------------------------------------------------------------------------------------------


def empty_svd(d_out: int, d_in: int) -> LowRankSVD:
    """G = 0 of a (d_out, d_in) module: no components."""
    return LowRankSVD(np.zeros((d_out, 0)), np.zeros(0), np.zeros((0, d_in)))


def aggregate_original(
    updates: Sequence[Mapping[str, Factors]], weights: Sequence[float], shapes: Mapping[str, tuple[int, int]]
) -> dict[str, LowRankSVD]:
    """G^l = sum_i w_i s_i B_i A_i per module of ``shapes`` (``updates`` already scaled), as its
    thin SVD. An upload without module l (its client had r_tot^l = 0: no adapter there) is a zero
    term, its weight w_i unchanged (the weights are normalised over all uploads)."""
    out = {}
    for m, (d_out, d_in) in shapes.items():
        terms = [(u[m], w) for u, w in zip(updates, weights) if m in u]
        out[m] = trim(factor_svd([f.B for f, _ in terms], [f.A for f, _ in terms], [w for _, w in terms])) if terms \
            else empty_svd(d_out, d_in)
    return out


def aggregate_unbiased(
    previous: Mapping[str, LowRankSVD],
    updates: Sequence[Mapping[str, Factors]],
    starts: Sequence[Mapping[str, Factors]],
    weights: Sequence[float],
) -> dict[str, LowRankSVD]:
    """G^l = G_prev^l + sum_i w_i (dW_i - dW_i,init), all scaled factors, as its thin SVD.

    The subtraction travels as negative weights through :func:`factor_svd` (factor space). A
    client without module l (r_tot^l = 0) neither received nor trained it: no term.
    """
    out = {}
    for m, G in previous.items():
        Bs, As, w = [G.U * G.S], [G.Vt], [1.0]  # (d_out, r), (r, d_in)
        for u, s, wi in zip(updates, starts, weights):
            if m in u:
                Bs += [u[m].B, s[m].B]
                As += [u[m].A, s[m].A]
                w += [wi, -wi]
        out[m] = trim(factor_svd(Bs, As, w))
    return out


# --------------------------------------------------------------------------------------------
# server: water-filling rank allocation (official fed_utils/rank_allocator.py)
# --------------------------------------------------------------------------------------------

GAIN_FLOOR_BYTES = 1e-9  # official allocate_r_tot_for_client: gain = energy / max(cost, 1e-9)
GAIN_FLOOR_COST = 1e-12  # official allocate_r_main_for_client: gain = sigma^2 / max(unit_cost, 1e-12)
PRESSURE_FLOOR = 1e-9  # official: T_left / T as max(T_left, 1e-9) / max(T, 1e-9)


def next_energy(spectrum: np.ndarray, rank: int) -> float:
    """sigma_{r+1}^2: the energy the next column would carry (0 past the numerical spectrum; the
    official dense SVD has min(d_out, d_in) values there, ~0)."""
    return float(spectrum[rank]) ** 2 if rank < len(spectrum) else 0.0


def best_module(candidates: list[str], gains: Mapping[str, float]) -> str:
    """The official comparison (``if gain > best``, candidates in module order): the largest gain,
    ties to the first module in order."""
    best = candidates[0]
    for m in candidates[1:]:
        if gains[m] > gains[best]:
            best = m
    return best


def allocate_download(
    spectra: Mapping[str, np.ndarray],
    column_bytes: Mapping[str, int],
    budget: float,
    min_rank: int,
    max_rank: Mapping[str, int],
    policy: Allocation = "greedy",
    rng: np.random.Generator | None = None,
) -> dict[str, int]:
    """r_tot per module (``spectra`` in the model's module order).

    'greedy' (official ``allocate_r_tot_for_client``): every module starts at ``min_rank`` (0
    officially); then, while some module below its ``max_rank`` can still afford a column
    (spent + bytes_l <= ``budget``), the one with the largest sigma_{l, r_l+1}^2 / bytes_l gets
    it (ties: the first in module order). 'random' (official ``_random_allocation``): the column
    goes to a uniformly drawn affordable module. 'uniform' (official ``_uniform_allocation``):
    every module at floor(budget / sum_l bytes_l), capped at its ``max_rank``.
    ``column_bytes[l]`` = (d_out + d_in) * bytes_per_param; the total never exceeds ``budget``.
    """
    rng = rng or np.random.default_rng(0)
    if policy == "uniform":
        cap = int(budget // max(sum(column_bytes.values()), 1))
        return {m: min(max(cap, min_rank), max_rank[m]) for m in spectra}  # min_rank: affordable (check_profile)
    ranks = {m: min_rank for m in spectra}
    spent = float(sum(min_rank * column_bytes[m] for m in spectra))
    if spent > budget:
        raise ValueError(f"download budget {budget} cannot afford rank {min_rank} on every module")
    while True:
        candidates = [m for m in spectra if ranks[m] < max_rank[m] and spent + column_bytes[m] <= budget]
        if not candidates:
            return ranks
        if policy == "random":
            chosen = candidates[int(rng.integers(len(candidates)))]
        else:
            gains = {m: next_energy(spectra[m], ranks[m]) / max(column_bytes[m], GAIN_FLOOR_BYTES) for m in candidates}
            chosen = best_module(candidates, gains)
        ranks[chosen] += 1
        spent += column_bytes[chosen]


def pressure_weights(time_budget: float, time_left: float, memory_budget: float, memory_left: float) -> tuple[float, float]:
    """(a, b) of the official r_main pass: with p_T = T / T_left and p_M = M / M_left (each ratio
    floored at 1e-9 as there; 1 for an undeclared, infinite budget), a = p_T / (p_T + p_M) and
    b = p_M / (p_T + p_M): the scarcer resource weighs more."""

    def pressure(budget: float, left: float) -> float:
        if math.isinf(budget):
            return 1.0
        return 1.0 / (max(left, PRESSURE_FLOOR) / max(budget, PRESSURE_FLOOR))

    p_time, p_memory = pressure(time_budget, time_left), pressure(memory_budget, memory_left)
    total = p_time + p_memory
    return p_time / total, p_memory / total


def uniform_training_cap(column_time: Mapping[str, float], column_memory: Mapping[str, float],
                         time_budget: float, memory_budget: float) -> float:
    """The official ablations' r_main cap: min(T // sum_l c_time_l, M // sum_l c_mem_l)."""
    caps = [budget // max(sum(costs.values()), 1) for budget, costs in ((time_budget, column_time), (memory_budget, column_memory))
            if not math.isinf(budget)]
    return min(caps, default=math.inf)


def allocate_training(
    spectra: Mapping[str, np.ndarray],
    r_tot: Mapping[str, int],
    column_time: Mapping[str, float],
    column_memory: Mapping[str, float],
    time_budget: float,
    memory_budget: float,
    min_rank: int,
    policy: Allocation = "greedy",
) -> dict[str, int]:
    """r_main^l <= r_tot^l (``spectra`` in the model's module order).

    'greedy' (official ``allocate_r_main_for_client``): every module starts at min(``min_rank``,
    r_tot^l) (0 officially); then, while some module below r_tot^l can afford a column within
    both T_left and M_left, the one with the largest sigma_{l, r_l+1}^2 / (a c_time_l + b c_mem_l)
    gets it (:func:`pressure_weights`; ties: the first in module order). A module left at 0 is
    frozen on that client. 'uniform' / 'random' (official ablations): r_main^l = min(r_tot^l,
    :func:`uniform_training_cap`).
    """
    if policy != "greedy":
        cap = uniform_training_cap(column_time, column_memory, time_budget, memory_budget)
        return {m: int(min(r_tot[m], max(cap, min_rank))) for m in spectra}
    ranks = {m: min(min_rank, r_tot[m]) for m in spectra}
    time_left = time_budget - sum(ranks[m] * column_time[m] for m in spectra)
    memory_left = memory_budget - sum(ranks[m] * column_memory[m] for m in spectra)
    if time_left < 0 or memory_left < 0:
        raise ValueError(f"training budgets (T={time_budget}, M={memory_budget}) cannot afford rank {min_rank}")
    while True:
        a, b = pressure_weights(time_budget, time_left, memory_budget, memory_left)
        candidates = [
            m for m in spectra
            if ranks[m] < r_tot[m] and not (memory_left < column_memory[m] or time_left < column_time[m])
        ]
        if not candidates:
            return ranks
        gains = {
            m: next_energy(spectra[m], ranks[m]) / max(a * column_time[m] + b * column_memory[m], GAIN_FLOOR_COST)
            for m in candidates
        }
        chosen = best_module(candidates, gains)
        ranks[chosen] += 1
        time_left -= column_time[chosen]
        memory_left -= column_memory[chosen]


# --------------------------------------------------------------------------------------------
# server: spectral push and adaptive tail warm-up; client: the tail scaling
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


def alignment_score(update: Mapping[str, Factors], G: Mapping[str, LowRankSVD]) -> float:
    """ATW score s_i: ONE cosine between the client's whole product and the whole new G.

    Official ``fed_utils/model_aggregation.py`` (l.247-305): over all modules together,
    s_i = sum_l <P_i^l, G^l>_F / (sqrt(sum_l ||P_i^l||_F^2) * sqrt(sum_l ||G^l||_F^2)) with
    P_i^l = s_i B_i^l A_i^l the client's uploaded product (``update``, already scaled; its frozen
    tail carries the lambda it trained with) and G the aggregate this round produced (client i's
    own contribution included). s_i is in [-1, 1]; 0 when either norm is <= 1e-6 (as there).
    ||G|| runs over every module of G (official: computed before the loop over the client's
    modules); a module the client did not upload (r_tot = 0) adds nothing to its sums.
    """
    inner, update_sq = 0.0, 0.0
    for m, f in update.items():
        g_B, g_A = G[m].U * G[m].S, G[m].Vt  # G = (U S) Vt
        inner += product_inner(f.B, f.A, g_B, g_A)
        update_sq += product_inner(f.B, f.A, f.B, f.A)
    global_sq = sum(float(np.sum(np.square(g.S, dtype=np.float64))) for g in G.values())  # every module of G
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


def scale_tail(factors: Mapping[str, Factors], r_main: Mapping[str, int], lam: float) -> dict[str, Factors]:
    """FedHera's tail warm-up: rows r_main: of A and columns r_main: of B times sqrt(lam), so the
    frozen tail's product B_tail A_tail is scaled by lam (unchanged when lam >= 0.999)."""
    if lam >= NO_TAIL_SCALING:
        return dict(factors)
    root = np.float32(np.sqrt(max(lam, 0.0)))
    out = {}
    for module, f in factors.items():
        A, B = np.array(f.A, copy=True), np.array(f.B, copy=True)
        A[r_main[module]:] *= root  # (r_tot - r_main, d_in)
        B[:, r_main[module]:] *= root  # (d_out, r_tot - r_main)
        out[module] = Factors(A, B)
    return out


# --------------------------------------------------------------------------------------------
# what a round records (results.json round ``extra``)
# --------------------------------------------------------------------------------------------


def tier_label(name: str, index: int) -> str:
    """A budget tier's name as a key part: lower case, [a-z0-9_] (``tier<index>`` when unnamed)."""
    label = re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")
    return label or f"tier{index}"


def round_summary(
    tiers: Mapping[str, Sequence[tuple[Mapping[str, int], Mapping[str, int]]]], lambdas: Sequence[float] | None
) -> dict[str, float]:
    """Flat numeric facts of one round's allocation, from (r_tot, r_main) per sampled client of
    each tier: ``fedhera_r_tot_<tier>`` / ``fedhera_r_main_<tier>`` = mean over the tier's clients
    of the mean over modules of r_tot^l / r_main^l (an average rank per module, comparable with
    the tier's targets); ``fedhera_frozen_<tier>`` = mean number of modules with r_main^l = 0
    (untrained on that client, r_tot^l = 0 included); ``fedhera_unadapted_<tier>`` = mean number
    with r_tot^l = 0; and, when ``lambdas`` is given (ATW on), ``fedhera_lambda_mean`` / ``_min``
    / ``_max`` over all the round's sampled clients."""
    out: dict[str, float] = {}
    for tier, clients in tiers.items():
        if not clients:
            continue
        out[f"fedhera_r_tot_{tier}"] = float(np.mean([np.mean(list(r_tot.values())) for r_tot, _ in clients]))
        out[f"fedhera_r_main_{tier}"] = float(np.mean([np.mean(list(r_main.values())) for _, r_main in clients]))
        out[f"fedhera_frozen_{tier}"] = float(np.mean([sum(r == 0 for r in r_main.values()) for _, r_main in clients]))
        out[f"fedhera_unadapted_{tier}"] = float(np.mean([sum(r == 0 for r in r_tot.values()) for r_tot, _ in clients]))
    if lambdas:
        out |= {"fedhera_lambda_mean": float(np.mean(lambdas)), "fedhera_lambda_min": float(min(lambdas)),
                "fedhera_lambda_max": float(max(lambdas))}
    return out


def check(experiment: ExperimentConfig, options: FedHeraOptions) -> None:
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


METHOD = Method(
    name="fedhera",
    options=FedHeraOptions,
    capabilities=Capabilities(
        personalized=False,
        uploads="A, B (r_tot, tail included), head",
        downloads="top-r_tot spectrum of G per module, head; r_tot, r_main, lambda",
        mixed_ranks=True,
        dp_compatible=False,  # prefix gating edits p.grad; Opacus steps on per-example grads
        paper="FedHera, 2026 (official code: github.com/shock-xiaoke/FedHera)",
        not_robust=(
            "SVD-based: it allocates ranks from the spectrum of sum_k w_k s_k B_k A_k, a product of "
            "factors, not a mean of arrays"
        ),
        not_flower_dp=(
            "SVD-based: its arrays are the SVD factors of sum_k w_k s_k B_k A_k, a product of factors and not a "
            "mean of the uploads, so noise on them is not noise on a mean of clipped updates"
        ),
        not_secure=("SVD-based: it allocates ranks from the spectrum of sum_k w_k s_k B_k A_k (a sum of factor "
                    "products, not of the uploads) and scores each client's own update"),
        not_server_optimizer=("SVD-based: its arrays are the top spectrum of sum_k w_k s_k B_k A_k, not a mean of the "
                              "uploads"),
        proximal=True,
    ),
    strategy="fedlora.strategies.fedhera:FedHera",
    trainer="fedlora.clients.trainers.fedhera:FedHeraTrainer",
    check=check,
)
