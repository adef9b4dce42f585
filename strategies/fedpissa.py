"""FedPissa: selective aggregation of B with a decorrelated subspace projection; A stays local
(``fedlora/methods/fedpissa.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.supercore import log

from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload, head_only, normalise, split_payload
from fedlora.methods import fedpissa
from fedlora.methods.fedpissa import (
    ClientId,
    aggregate_B,
    check_delta,
    decorrelation_projectors,
    projection_diagnostics,
    resolved_delta,
)
from fedlora.protocol import Phase
from strategies.base import ClientUpload, LoRAStrategy


class FedPissa(LoRAStrategy):
    """FedPissa: one LoRA per module; B aggregated with decorrelated projections, A kept local.

    Paper: "FedPissa: rethinking single-LoRA personalised federated fine-tuning via selective
    aggregation and subspace decorrelation" (2026; abstract and overview figure only).

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

    method = fedpissa.METHOD
    options: fedpissa.FedPissaOptions

    def setup(self) -> None:
        # after the roster settled mixed ranks (clients.mixed_rank_policy), every profile has one rank
        self.rank = next(iter(self.roster.profiles.values())).rank
        self.delta = resolved_delta(self.options.delta, self.rank)
        check_delta(self.options.delta, self.rank)
        initial = self.initial_adapter(self.rank)  # PiSSA (or kaiming) factors + head
        factors, _ = split_payload(initial)
        self.B_agg: dict[str, np.ndarray] = {module: f.B for module, f in factors.items()}  # (d_out, r)
        self.head: Payload = head_only(initial) if self.sends_head else {}
        self.initial_A = {module: f.A for module, f in factors.items()}  # (r, d_in)
        # global_model = mean_A only: every client's last A (that global model is their mean); with
        # 'clients' A_k lives on client k alone and the server forgets it after the round
        self.last_A: dict[ClientId, dict[str, np.ndarray]] = {}  # partition id -> module -> A_k
        self.last_examples: dict[ClientId, int] = {}
        self.diagnostics: dict[str, float] = {}

    def model_init(self) -> str:
        """``strategy.init``: the server's evaluator builds with it, as the client trainer does."""
        return self.options.init

    def download(self, partition: int, server_round: int, phase: Phase) -> Payload:
        return {**{m + B_SUFFIX: B for m, B in self.B_agg.items()}, **self.head}

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        p = self.aggregation_weights(uploads)
        A_by_client: dict[ClientId, dict[str, np.ndarray]] = {}
        B_by_client: dict[ClientId, dict[str, np.ndarray]] = {}
        for upload in uploads:
            factors, _ = split_payload(upload.payload)
            A_by_client[upload.partition_id] = {m: f.A for m, f in factors.items()}
            B_by_client[upload.partition_id] = {m: f.B for m, f in factors.items()}
            if self.options.global_model == "mean_A":
                self.last_A[upload.partition_id] = A_by_client[upload.partition_id]
                self.last_examples[upload.partition_id] = upload.num_examples
        P_by_client = decorrelation_projectors(A_by_client, self.delta)
        B_agg = aggregate_B(B_by_client, P_by_client, p, self.options.lam, self.options.correction)
        self.diagnostics = projection_diagnostics(A_by_client, B_by_client, P_by_client, p, B_agg)
        self.B_agg = B_agg
        self.head = self.averaged_head(uploads, [p[u.partition_id] for u in uploads], self.head)
        log(INFO, "aggregate: fedpissa round %d, %d clients, delta %d, lam %.3g, |B_agg - B_avg| / |B_avg| = %.3g",
            server_round, len(uploads), self.delta, self.options.lam, self.diagnostics["relative_correction"])

    def aggregation_weights(self, uploads: Sequence[ClientUpload]) -> dict[ClientId, float]:
        counts = [u.weight if self.options.weights == "samples" else 1.0 for u in uploads]
        return dict(zip([u.partition_id for u in uploads], normalise(counts).tolist()))

    def global_payload(self) -> Payload | None:
        if self.options.global_model == "clients":
            return None
        A_mean = self.initial_A
        if self.last_A:
            clients = sorted(self.last_A)
            p = normalise([self.last_examples[k] for k in clients])
            A_mean = {
                m: np.einsum("k,krd->rd", p, np.stack([self.last_A[k][m] for k in clients])).astype(np.float32)
                for m in self.initial_A
            }
        return {
            **{m + A_SUFFIX: A for m, A in A_mean.items()},
            **{m + B_SUFFIX: B for m, B in self.B_agg.items()},
            **self.head,
        }

    def round_extra(self, server_round: int) -> dict[str, Any]:
        return {"delta": self.delta, "lam": self.options.lam, **self.diagnostics}
