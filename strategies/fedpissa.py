"""FedPissa: selective aggregation of B with a decorrelated subspace projection; A stays local.

FedPissa (2026; abstract in ``shared/papers/abstracts.md``). ALGORITHMS.md, section "FedPissa"
([FIG + abstract]: the server update is "Eq. 4" of the authors' overview figure; the PiSSA init,
the tail-rank default and the global-model definition are [RECON] and therefore options).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from logging import INFO
from typing import Any, ClassVar, Literal

import numpy as np
from flwr.supercore import log
from pydantic import Field

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload, head_only, normalise, split_payload, weighted_average
from fedlora.profile import configured_rank
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions

ClientId = int  # partition id


class FedPissaOptions(StrategyOptions):
    """FedPissa's options (``[strategy]`` keys next to ``name = "fedpissa"``)."""

    lam: float = Field(
        1.0,
        ge=0.0,
        description="lambda of Eq. 4: strength of the projected client deviations added to "
        "the average of B (0 = plain averaging of B).",
    )
    delta: int | None = Field(
        None,
        description="Tail rank: P_k projects onto the eigenvectors of the delta smallest "
        "eigenvalues of C_k; 1 <= delta < r. Empty = r // 2 (ALGORITHMS.md default r/2).",
    )
    correction: Literal["bounded", "literal"] = Field(
        "bounded",
        description="[RECON] How the projected deviations enter Eq. 4: 'bounded' = lam * sum_k p_k "
        "(B_k - B_avg) P_k (identical projectors give exactly B_avg; a convex mix per direction "
        "for lam <= 1); 'literal' = lam * sum_k (B_k - B_avg) P_k as the figure draws it, which "
        "extrapolates under sample weights (10 clients, one holding 43 % of the data: a "
        "coefficient near -2.8 on the others' deviations).",
    )
    weights: Literal["samples", "uniform"] = Field(
        "samples",
        description="p_k in B_avg = sum_k p_k B_k (and in the head's average): 'samples' "
        "(n_k / sum n, FedAvg) or 'uniform' (1 / K).",
    )
    init: Literal["pissa", "kaiming"] = Field(
        "pissa",
        description="[RECON] LoRA init: 'pissa' (A = S_r^1/2 V_r^T, B = U_r S_r^1/2 from the "
        "exact top-r SVD of W0, frozen residual W0 - s B A, identical on every client and the "
        "server) or 'kaiming' (standard LoRA, B = 0). Overrides model.init for fedpissa only.",
    )
    global_model: Literal["clients", "mean_A"] = Field(
        "clients",
        description="[RECON] what 'global accuracy' means (the paper has no global model): "
        "'clients' = every client's personalised model W0 + s B_agg A_k on the global test "
        "set, example-weighted; 'mean_A' = one model B_agg with the example-weighted mean of "
        "the clients' last A, evaluated by the server.",
    )


# ------------------------------------------------------------------------------------ math
def decorrelation_projectors(
    A_by_client: Mapping[ClientId, Mapping[str, np.ndarray]], delta: int
) -> dict[ClientId, dict[str, np.ndarray]]:
    """P_k per client and module: projector onto the tail eigenspace of C_k = sum_{j != k} A_j A_j^T.

    ``A_by_client[k][module]`` is A_k (r, d_in); every client has the same modules and rank r.
    The r x r Gram matrices are stacked over clients and modules, C_k is the total minus client
    k's own Gram, and one batched ``eigh`` gives every eigenbasis (ascending eigenvalues, so the
    tail is the first ``delta`` columns). Nothing of size d x d is formed.
    """
    clients = list(A_by_client)
    modules = list(A_by_client[clients[0]])
    r = int(A_by_client[clients[0]][modules[0]].shape[0])
    if not 1 <= delta < r:
        raise ValueError(f"delta must be in [1, r) = [1, {r}), got {delta}")
    grams = np.empty((len(clients), len(modules), r, r))  # (K, M, r, r)
    for m, module in enumerate(modules):
        A = np.stack([np.asarray(A_by_client[k][module], dtype=np.float64) for k in clients])  # (K, r, d_in)
        grams[:, m] = A @ A.transpose(0, 2, 1)
    C = grams.sum(axis=0, keepdims=True) - grams  # (K, M, r, r): the other clients' A only
    _, U = np.linalg.eigh(C)  # batched; eigenvalues ascending
    U_tail = U[..., :delta]  # (K, M, r, delta)
    P = U_tail @ U_tail.swapaxes(-1, -2)  # (K, M, r, r)
    return {k: {module: P[i, m] for m, module in enumerate(modules)} for i, k in enumerate(clients)}


def aggregate_B(
    B_by_client: Mapping[ClientId, Mapping[str, np.ndarray]],
    P_by_client: Mapping[ClientId, Mapping[str, np.ndarray]],
    weights: Mapping[ClientId, float],
    lam: float,
    correction: Literal["bounded", "literal"] = "bounded",
) -> dict[str, np.ndarray]:
    """Eq. 4: B_agg = B_avg + lam * sum_k c_k (B_k - B_avg) P_k, with B_avg = sum_k p_k B_k.

    ``weights`` are the p_k (summing to one); c_k = p_k for ``correction = 'bounded'`` (the
    default) and c_k = 1 for ``'literal'`` (the figure's unweighted sum).
    Returns one B_agg (d_out, r) per module, float32 (the wire dtype).
    """
    clients = list(B_by_client)
    p = np.array([weights[k] for k in clients], dtype=np.float64)  # (K,)
    c = p if correction == "bounded" else np.ones_like(p)  # (K,)
    result: dict[str, np.ndarray] = {}
    for module in B_by_client[clients[0]]:
        B = np.stack([np.asarray(B_by_client[k][module], dtype=np.float64) for k in clients])  # (K, d_out, r)
        P = np.stack([P_by_client[k][module] for k in clients])  # (K, r, r)
        B_avg = np.einsum("k,kor->or", p, B)  # (d_out, r)
        correction_term = np.einsum("k,kor,krs->os", c, B - B_avg, P)  # (d_out, r)
        result[module] = (B_avg + lam * correction_term).astype(np.float32)
    return result


def resolved_delta(delta: int | None, r: int) -> int:
    """The tail rank used for rank ``r`` (``None`` -> r // 2)."""
    return r // 2 if delta is None else delta


# ------------------------------------------------------------------------------------ protocol
class FedPissa(LoRAStrategy):
    """FedPissa: one LoRA per module; B aggregated with decorrelated projections, A kept local.

    Paper: "FedPissa: rethinking single-LoRA personalised federated fine-tuning via selective
    aggregation and subspace decorrelation" (2026; abstract only, ALGORITHMS.md "FedPissa").

    Parameters
    ----------
    lam : float, default 1.0
        lambda of Eq. 4; 0 reduces the server to plain (weighted) averaging of B.
    delta : int or None, default None (= r // 2)
        Tail rank of the projection, 1 <= delta < r.
    correction : {"bounded", "literal"}, default "bounded"
        [RECON] Deviation weights in Eq. 4: p_k (bounded; identical projectors give B_avg) or 1
        (literal, as drawn in the figure; extrapolates under skewed sample weights).
    weights : {"samples", "uniform"}, default "samples"
        p_k for B_avg (and for the head's FedAvg when ``model.head = global``).
    init : {"pissa", "kaiming"}, default "pissa"
        [RECON] LoRA init. 'pissa' takes A, B from the exact top-r SVD of W0 and freezes the
        residual W0 - s B A; the SVD is deterministic, so clients and server share one residual
        base. It overrides ``model.init`` for this method only (the client trainer builds with it,
        and :meth:`model_init` gives it to the server's evaluator); the config's ``model.init``
        is left as is, so a comparison's other strategies keep their own init.
    global_model : {"clients", "mean_A"}, default "clients"
        [RECON] definition of the reported global accuracy (FedPissa is personalised and has
        no global model): 'clients' has each client evaluate its own W0 + s B_agg A_k on the
        global test set (example-weighted mean); 'mean_A' evaluates B_agg with the
        example-weighted mean of the clients' last A on the server.

    One rank only (``capabilities.mixed_ranks = False``): Eq. 4 adds B_k (d_out, r) times P_k
    (r, r) across clients, and under PiSSA the frozen residual itself depends on r, so clients of
    different ranks would not even share a base model; zero-padding would break both. Mixed
    declared ranks therefore follow the platform's ``clients.mixed_rank_policy``: 'smallest'
    (default) runs every client at the smallest declared rank, 'refuse' is a ConfigError.

    Upload: A_k and B_k of every module (and the head when ``model.head = global``).

    Aggregation: B and A are treated differently. B_avg = sum_k p_k B_k; for each client
    C_k = sum_{j != k} A_j A_j^T (r x r, from the other clients' A), P_k = U_tail U_tail^T with
    U_tail the eigenvectors of the delta smallest eigenvalues of C_k, and
    B_agg = B_avg + lam * sum_k p_k (B_k - B_avg) P_k (``correction = bounded``; the figure's
    literal form drops the p_k): each client's deviation survives only along directions the other
    clients' A barely use. A is never aggregated. The head is FedAvg'd.

    Download: the same B_agg (and head) to every client; A_k stays on client k and is never
    overwritten, so client k's model is W0 + s B_agg A_k: upload A + B, download B only.
    """

    name = "fedpissa"
    Options: ClassVar[type[StrategyOptions]] = FedPissaOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=True,
        uploads="A, B, head",
        downloads="B, head",
        mixed_ranks=False,
        paper="FedPissa, 2026 (abstract; ALGORITHMS.md [FIG])",
    )

    def __init__(self, experiment: ExperimentConfig, *args: Any, **kwargs: Any) -> None:
        type(self).check_config(experiment)  # also when the config did not come from load_config
        super().__init__(experiment, *args, **kwargs)
        self.options: FedPissaOptions = FedPissaOptions(**experiment.strategy.options())  # typed
        self.rank = common_rank(experiment)  # settled again from the profiles in setup()
        self.delta = resolved_delta(self.options.delta, self.rank)
        self.last_A: dict[ClientId, dict[str, np.ndarray]] = {}  # partition id -> module -> A_k
        self.last_examples: dict[ClientId, int] = {}
        self.diagnostics: dict[str, float] = {}

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        options = FedPissaOptions(**experiment.strategy.options())
        check_delta(options.delta, common_rank(experiment))
        if experiment.model.init not in ("kaiming", options.init):  # kaiming: the platform default
            raise ConfigError(
                f"model.init = '{experiment.model.init}' conflicts with strategy.init = "
                f"'{options.init}' for fedpissa; set strategy.init instead of model.init"
            )

    def model_init(self) -> str:
        """``strategy.init``: the server's evaluator builds with it, as the client trainer does."""
        return self.options.init

    def setup(self) -> None:
        # after the base class settled mixed ranks (clients.mixed_rank_policy), every profile has one rank
        self.rank = next(iter(self.profiles.values())).rank
        self.delta = resolved_delta(self.options.delta, self.rank)
        check_delta(self.options.delta, self.rank)
        initial = self.initial_adapter(self.rank)  # PiSSA (or kaiming) factors + head
        factors, _ = split_payload(initial)
        self.B_agg: dict[str, np.ndarray] = {module: f.B for module, f in factors.items()}  # (d_out, r)
        self.head: Payload = head_only(initial) if self.sends_head else {}
        self.initial_A = {module: f.A for module, f in factors.items()}  # (r, d_in)

    def download(self, node_id: int, server_round: int) -> Payload:
        return {**{m + B_SUFFIX: B for m, B in self.B_agg.items()}, **self.head}

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        p = self.aggregation_weights(uploads)
        A_by_client: dict[ClientId, dict[str, np.ndarray]] = {}
        B_by_client: dict[ClientId, dict[str, np.ndarray]] = {}
        for upload in uploads:
            factors, _ = split_payload(upload.payload)
            A_by_client[upload.partition_id] = {m: f.A for m, f in factors.items()}
            B_by_client[upload.partition_id] = {m: f.B for m, f in factors.items()}
            self.last_A[upload.partition_id] = A_by_client[upload.partition_id]
            self.last_examples[upload.partition_id] = upload.num_examples
        P_by_client = decorrelation_projectors(A_by_client, self.delta)
        B_agg = aggregate_B(B_by_client, P_by_client, p, self.options.lam, self.options.correction)
        self.diagnostics = projection_diagnostics(A_by_client, B_by_client, P_by_client, p, B_agg)
        self.B_agg = B_agg
        if self.sends_head:
            self.head = weighted_average(
                [head_only(u.payload) for u in uploads], [p[u.partition_id] for u in uploads]
            )
        log(
            INFO,
            "aggregate: fedpissa round %d, %d clients, delta %d, lam %.3g, |B_agg - B_avg| / |B_avg| = %.3g",
            server_round,
            len(uploads),
            self.delta,
            self.options.lam,
            self.diagnostics["relative_correction"],
        )

    def aggregation_weights(self, uploads: Sequence[ClientUpload]) -> dict[ClientId, float]:
        counts = [u.num_examples if self.options.weights == "samples" else 1.0 for u in uploads]
        return dict(zip([u.partition_id for u in uploads], normalise(counts).tolist()))

    def global_payload(self) -> Payload | None:
        if self.options.global_model == "clients":
            return None
        A_mean = self.initial_A
        if self.last_A:
            clients = sorted(self.last_A)
            p = normalise([self.last_examples[k] for k in clients])
            A_mean = {
                m: np.einsum("k,krd->rd", p, np.stack([self.last_A[k][m] for k in clients])).astype(
                    np.float32
                )
                for m in self.initial_A
            }
        return {
            **{m + A_SUFFIX: A for m, A in A_mean.items()},
            **{m + B_SUFFIX: B for m, B in self.B_agg.items()},
            **self.head,
        }

    def round_extra(self, server_round: int) -> dict[str, Any]:
        return {"delta": self.delta, "lam": self.options.lam, **self.diagnostics}


def common_rank(experiment: ExperimentConfig) -> int:
    """The one LoRA rank every client trains at, as the config declares it.

    Mixed declared ranks follow the platform's ``clients.mixed_rank_policy``: 'smallest' runs
    every client at the smallest rank (the server tells clients ``common-rank``), 'refuse' is a
    ConfigError here, before anything starts.
    """
    n = experiment.data.num_clients
    ranks = sorted({configured_rank(experiment.clients, experiment.model.lora_rank, k, n) for k in range(n)})
    if len(ranks) > 1 and experiment.clients.mixed_rank_policy == "refuse":
        raise ConfigError(
            f"strategy 'fedpissa' needs one LoRA rank for every client (B_k must share r), got "
            f"ranks {ranks} with clients.mixed_rank_policy='refuse'; give equal clients.ranks or "
            f"set clients.mixed_rank_policy='smallest'"
        )
    return ranks[0]


def check_delta(delta: int | None, r: int) -> None:
    """ConfigError unless 1 <= delta < r (``None`` means r // 2, which needs r >= 2)."""
    if r < 2:
        raise ConfigError(f"strategy 'fedpissa' needs LoRA rank >= 2 (delta in [1, r)), got rank {r}")
    value = resolved_delta(delta, r)
    if not 1 <= value < r:
        raise ConfigError(
            f"strategy.delta must be in [1, rank), got {value} (rank = {r}); "
            f"set 1 <= strategy.delta <= {r - 1} or omit it for r // 2 = {r // 2}"
        )


def projection_diagnostics(
    A_by_client: Mapping[ClientId, Mapping[str, np.ndarray]],
    B_by_client: Mapping[ClientId, Mapping[str, np.ndarray]],
    P_by_client: Mapping[ClientId, Mapping[str, np.ndarray]],
    weights: Mapping[ClientId, float],
    B_agg: Mapping[str, np.ndarray],
) -> dict[str, float]:
    """How large the projected correction was and how much of the other clients' A it touches.

    ``relative_correction`` = ||B_agg - B_avg||_F / ||B_avg||_F summed over modules;
    ``interference`` = mean over k, j != k, modules of ||P_k A_j||_F / ||A_j||_F (small when the
    tail directions are ones the other clients barely use).
    """
    clients = list(B_by_client)
    num, den, ratios = 0.0, 0.0, []
    for module, B_new in B_agg.items():
        B_avg = sum(weights[k] * np.asarray(B_by_client[k][module], dtype=np.float64) for k in clients)
        num += float(np.linalg.norm(B_new - B_avg) ** 2)
        den += float(np.linalg.norm(B_avg) ** 2)
        for k in clients:
            for j in clients:
                if j != k:
                    A_j = np.asarray(A_by_client[j][module], dtype=np.float64)  # (r, d_in)
                    ratios.append(
                        float(np.linalg.norm(P_by_client[k][module] @ A_j) / max(np.linalg.norm(A_j), 1e-12))
                    )
    return {
        "relative_correction": float(np.sqrt(num / max(den, 1e-24))),
        "interference": float(np.mean(ratios)) if ratios else 0.0,
    }
