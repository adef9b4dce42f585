"""FedDR-LoRA: federated decoupled robust LoRA under label noise.

FedDR-LoRA (2026). Verified from the abstract: A extracts stable features and stays local, B is
aggregated, a dual branch trained with negative learning absorbs the label noise. The announced
official repository holds no code, so everything else is a reconstruction and therefore an
option below (docs/algorithms.md). Pure math: the server's average of the robust B, the client's
loss-based clean / suspect split (a 2-component Gaussian mixture, scikit-learn) and the split's
quality against the injected noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import Field

from fedlora.lora import A_SUFFIX, Combine, Payload, Weights, weighted_average
from fedlora.methods.base import Capabilities, Method, MethodOptions

SPLIT_COUNT_KEYS = ("flagged", "true-positives", "noisy", "samples")
NOISE_METRIC_PREFIX = "noise-"  # train metrics: noise-precision, noise-recall, noise-flagged, ...
GMM_REG_COVAR = 5e-4  # variance floor on losses normalised to [0, 1] (DivideMix's setting)
GMM_MAX_ITER = 20
GMM_INIT = "k-means++"  # 5x faster than a full k-means init on 1-D losses, and no OpenMP k-means in actors
GMM_MIN_SAMPLES = 4  # below this (or with constant losses) every sample counts as clean



class FedDRLoRAOptions(MethodOptions):
    """FedDR-LoRA's options (all [RECON]: the announced official repository holds no code)."""

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
    robust_loss: Literal["all", "clean"] = Field(
        "all",
        description="[RECON] Cross-entropy of the robust branch f_r on 'all' samples (nothing dropped; "
        "with nl_target = 'complementary' the split then only measures, it does not act) or on the "
        "clean part D_c only ('clean': drops every suspect sample from f_r's training). 'all' is the "
        "default because 'clean' was measured to collapse under 40 % symmetric noise (the low-loss set is the "
        "classes the model already predicts, and f_r overfits it; personalised accuracy 0.59 with 'clean' "
        "against 0.8+ with 'all' in the fidelity scenario, seed 0: docs/results/fidelity.md).",
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


def aggregate_robust_B(
    uploads: Sequence[Mapping[str, np.ndarray]], weights: Weights, combine: Combine | None = None
) -> Payload:
    """B = sum_k p_k B_k^r per module (and the head averaged the same way); A must not be there.
    ``combine`` (``faults.aggregation``): a coordinate-wise robust rule instead of the mean."""
    for upload in uploads:
        leaked = [key for key in upload if key.endswith(A_SUFFIX)]
        if leaked:
            raise ValueError(f"FedDR-LoRA keeps A local, but an upload carries {leaked[0]}")
    return weighted_average(uploads, weights, combine)  # each B^r (d_out, r), each head array


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


def gmm_clean_mask(losses: np.ndarray, threshold: float = 0.5, seed: int = 0) -> np.ndarray:
    """Clean / suspect split of per-sample losses with a 2-component Gaussian mixture.

    Losses are min-max normalised to [0, 1]; a sample is clean when its posterior under the
    component with the lower mean exceeds ``threshold``. Too few samples or constant losses:
    everything is clean (there is nothing to separate). Returns a boolean mask, True = clean.
    """
    from sklearn.mixture import GaussianMixture

    losses = np.asarray(losses, dtype=np.float64).reshape(-1)
    spread = float(np.ptp(losses)) if losses.size else 0.0
    if losses.size < GMM_MIN_SAMPLES or not np.isfinite(spread) or spread < 1e-8:
        return np.ones(losses.size, dtype=bool)
    normalised = ((losses - losses.min()) / spread).reshape(-1, 1)
    gmm = GaussianMixture(
        n_components=2, max_iter=GMM_MAX_ITER, tol=1e-2, reg_covar=GMM_REG_COVAR, init_params=GMM_INIT, random_state=seed
    )
    gmm.fit(normalised)
    clean_component = int(np.argmin(gmm.means_.reshape(-1)))
    return np.asarray(gmm.predict_proba(normalised)[:, clean_component] > threshold)


def split_counts(suspect: np.ndarray, is_noisy: np.ndarray) -> dict[str, float]:
    """How a suspect mask matches the injected noise: flagged, true positives, noisy, samples."""
    suspect = np.asarray(suspect, dtype=bool)
    is_noisy = np.asarray(is_noisy, dtype=bool)
    return {
        "flagged": float(suspect.sum()),
        "true-positives": float((suspect & is_noisy).sum()),
        "noisy": float(is_noisy.sum()),
        "samples": float(suspect.size),
    }


def split_quality(counts: dict[str, float]) -> dict[str, float]:
    """Precision (flagged that are noisy), recall (noisy that are flagged), flagged fraction."""
    flagged, hits, noisy, samples = (counts.get(k, 0.0) for k in ("flagged", "true-positives", "noisy", "samples"))
    return {
        "precision": hits / flagged if flagged else math.nan,
        "recall": hits / noisy if noisy else math.nan,
        "flagged-fraction": flagged / samples if samples else math.nan,
    }


METHOD = Method(
    name="feddr_lora",
    options=FedDRLoRAOptions,
    capabilities=Capabilities(
        personalized=True,
        uploads="B^r, head",
        downloads="B, head",
        mixed_ranks=False,
        dp_compatible=False,
        paper="FedDR-LoRA, 2026 (abstract; github.com/FangXiuwen/FedDR-LoRA announced, empty)",
        robust_aggregation=True,
        causal_lm="its clean / noisy split and negative learning act on noisy class labels, which "
        "instruction tuning does not have",
    ),
)
