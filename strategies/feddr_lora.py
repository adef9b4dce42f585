"""FedDR-LoRA: federated decoupled robust LoRA under label noise.

ALGORITHMS.md, "FedDR-LoRA" [abstract + RECON]. Verified from the abstract: A extracts stable
features and stays local, B is aggregated, a dual branch trained with negative learning absorbs
the label noise. Everything else is a reconstruction and therefore an option below. The client
half is :mod:`clients.trainers.feddr_lora`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field

from fedlora.lora import A_SUFFIX, Payload, head_only, normalise, split_payload, weighted_average
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions

SPLIT_COUNT_KEYS = ("flagged", "true-positives", "noisy", "samples")


class FedDRLoRAOptions(StrategyOptions):
    """FedDR-LoRA's options (all [RECON]: the paper's code was not available)."""

    topology: Literal["shared_a", "two_lora"] = Field(
        "shared_a",
        description="[RECON] 'shared_a': one local A shared by the robust B^r and the noise B^n "
        "(f_n = W0 x + s B^n A x); 'two_lora': the noise branch has its own local A^n and B^n.",
    )
    noise_head: Literal["detached", "shared"] = Field(
        "detached",
        description="[RECON] The trainable head (classifier) in the noise branch: 'detached' = f_n uses "
        "the robust head without training it (the NL loss reaches only B^n and A), 'shared' = the NL "
        "loss also trains the head that inference uses.",
    )
    warmup_rounds: int = Field(
        1, ge=0, description="[RECON] Rounds of plain cross-entropy on the robust branch before the split starts."
    )
    beta: float = Field(1.0, ge=0.0, description="[RECON] Weight of the negative-learning loss of the noise branch.")
    nl_target: Literal["complementary", "given"] = Field(
        "complementary",
        description="[RECON] Negative-learning target of the noise branch: 'complementary' = a random "
        "label != the given one, on every sample (standard negative learning, Kim et al., ICCV 2019: "
        "'this sample is not of class y-bar'); 'given' = the given (possibly wrong) label of each "
        "suspect sample only.",
    )
    robust_loss: Literal["clean", "all"] = Field(
        "clean",
        description="[RECON] Cross-entropy of the robust branch f_r on the clean part D_c only (the "
        "spec; drops every suspect sample from f_r's training) or on 'all' samples (nothing dropped; "
        "the split then only matters for nl_target = 'given').",
    )
    split: Literal["epoch", "batch"] = Field(
        "epoch",
        description="[RECON] Fit the 2-component Gaussian mixture on the per-sample CE of the robust "
        "branch over the whole local set once per local epoch ('epoch'), or on every batch ('batch').",
    )
    clean_threshold: float = Field(
        0.5, gt=0.0, lt=1.0,
        description="[RECON] A sample is clean when its posterior under the low-loss component exceeds this.",
    )
    weights: Literal["samples", "uniform"] = Field(
        "samples", description="Aggregation weights of B^r: p_k = n_k / sum n ('samples') or 1 / K ('uniform')."
    )


def aggregate_robust_B(uploads: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> Payload:
    """B = sum_k p_k B_k^r per module (and the head averaged the same way); A must not be there."""
    for upload in uploads:
        leaked = [key for key in upload if key.endswith(A_SUFFIX)]
        if leaked:
            raise ValueError(f"FedDR-LoRA keeps A local, but an upload carries {leaked[0]}")
    return weighted_average(uploads, weights)  # each B^r (d_out, r), each head array


def split_summary(per_client: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """Micro-averaged precision / recall of the clients' suspect sets against the injected noise."""
    totals = {key: sum(m.get(f"noise-{key}", 0.0) for m in per_client.values()) for key in SPLIT_COUNT_KEYS}
    flagged, hits, noisy, samples = (totals[k] for k in SPLIT_COUNT_KEYS)
    summary: dict[str, Any] = {
        "noise_precision": hits / flagged if flagged else None,
        "noise_recall": hits / noisy if noisy else None,
        "noise_flagged_fraction": flagged / samples if samples else None,
        "noise_true_rate": noisy / samples if samples else None,
    }
    summary["noise_split_per_client"] = {
        str(pid): {k.removeprefix("noise-"): v for k, v in m.items() if k.startswith("noise-")}
        for pid, m in per_client.items()
    }
    return summary


class FedDRLoRA(LoRAStrategy):
    """FedDR-LoRA: decoupled robust LoRA; the server averages the robust B, A stays local.

    Paper: "Federated Decoupled Robust LoRA (FedDR-LoRA)", 2026; only the abstract is available
    (shared/papers/abstracts.md; code announced at github.com/FangXiuwen/FedDR-LoRA).
    ALGORITHMS.md, "FedDR-LoRA".

    Parameters
    ----------
    topology : {"shared_a", "two_lora"}, default "shared_a"
        [RECON] One local A shared by the robust B^r and the noise B^n, or a separate (A^n, B^n).
    noise_head : {"detached", "shared"}, default "detached"
        [RECON] Whether the negative-learning loss of the noise branch also trains the head.
    warmup_rounds : int, default 1
        [RECON] Rounds of plain cross-entropy before the clean / suspect split starts.
    beta : float, default 1.0
        [RECON] Weight of the negative-learning loss NL(p, y) = -log(1 - p_y) on the noise branch.
    nl_target : {"complementary", "given"}, default "complementary"
        [RECON] NL on a random other label for every sample (standard negative learning), or on
        the suspect samples' given labels.
    robust_loss : {"clean", "all"}, default "clean"
        [RECON] CE of the robust branch on the clean samples only, or on all of them.
    split : {"epoch", "batch"}, default "epoch"
        [RECON] 2-component GMM on per-sample CE of f_r over the local set per epoch, or per batch.
    clean_threshold : float, default 0.5
        [RECON] Posterior of the low-loss component above which a sample is clean.
    weights : {"samples", "uniform"}, default "samples"
        p_k = n_k / sum n, or 1 / K.

    Mixed ranks: not supported as such. B^r is averaged column by column against each client's
    own local A, so every client needs the same rank r; the strategy declares
    ``capabilities.mixed_ranks = False`` and the platform's ``clients.mixed_rank_policy`` applies
    (``smallest``: every client trains at the smallest declared rank; ``refuse``: stop). Padding
    B^r to r_max was not chosen: the padded columns would pair with rows of A that only some
    clients have, and those A never travel, so the average would mix unrelated directions.

    Upload: B_k^r of every module (and the head when ``model.head = global``). A_k and the noise
    branch (B_k^n, and A_k^n for ``two_lora``) never leave the client. Train metrics add the split
    quality against the injected noise (``noise-precision``, ``noise-recall``, counts).

    Aggregation: B = sum_k p_k B_k^r per module (head: FedAvg). There is no global A, so there is
    no single global model: "global accuracy" is the mean of the clients' own models on the global
    test set. Each round's results carry the micro-averaged split precision / recall.

    Download: the global B (and head) to every sampled client, which sets B_k^r <- B and keeps
    its own A_k; inference uses the robust branch W0 + s B A_k only.
    """

    name = "feddr_lora"
    options: FedDRLoRAOptions
    Options: ClassVar[type[StrategyOptions]] = FedDRLoRAOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=True,
        uploads="B^r, head",
        downloads="B, head",
        mixed_ranks=False,
        dp_compatible=False,
        paper="FedDR-LoRA, 2026 (abstract; github.com/FangXiuwen/FedDR-LoRA)",
    )

    def setup(self) -> None:
        self.rank = min(p.rank for p in self.profiles.values())  # one rank, settled by the base
        factors, _ = split_payload(self.initial_adapter(self.rank))
        self.global_B: Payload = {m + "::B": f.B for m, f in factors.items()}  # (d_out, r) each
        self.head: Payload = head_only(self.initial_adapter(self.rank)) if self.sends_head else {}
        self.split_metrics: dict[int, dict[str, float]] = {}

    def download(self, node_id: int, server_round: int) -> Payload:
        return {**self.global_B, **self.head}

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        return self.lora_shapes(self.rank, send_A=False, send_B=True)

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        if self.options.weights == "uniform":
            return normalise([1.0] * len(uploads))
        return super().weights(uploads)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        averaged = aggregate_robust_B([u.payload for u in uploads], self.weights(uploads))
        self.global_B = {k: v for k, v in averaged.items() if k in self.global_B}
        self.head = {k: v for k, v in averaged.items() if k in self.head}
        self.split_metrics = {
            u.partition_id: {k: v for k, v in u.metrics.items() if k.startswith("noise-")} for u in uploads
        }

    def global_payload(self) -> Payload | None:
        return None  # A is local: every client has its own model

    def round_extra(self, server_round: int) -> dict[str, Any]:
        reported = {pid: m for pid, m in self.split_metrics.items() if m}
        if not reported:
            return {"noise_split": "warm-up" if server_round <= self.options.warmup_rounds else "none reported"}
        return split_summary(reported)
