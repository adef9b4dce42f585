"""FedDR-LoRA: the server averages the robust B, A stays local (``fedlora/methods/feddr_lora.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedlora.lora import Payload, head_only, normalise, split_payload
from fedlora.methods import feddr_lora
from fedlora.methods.feddr_lora import NOISE_METRIC_PREFIX, aggregate_robust_B, split_summary
from fedlora.protocol import Phase
from strategies.base import ClientUpload, LoRAStrategy


class FedDRLoRA(LoRAStrategy[feddr_lora.FedDRLoRAOptions]):
    """FedDR-LoRA: decoupled robust LoRA; the server averages the robust B, A stays local.

    Paper: "Federated Decoupled Robust LoRA (FedDR-LoRA)", 2026; only the abstract is available
    (the announced github.com/FangXiuwen/FedDR-LoRA holds no code); docs/algorithms.md.

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
    robust_loss : {"posterior", "all", "clean"}, default "posterior"
        [RECON] CE of the robust branch weighted by each sample's clean posterior (soft, normalised
        by the split's mean weight), plain on all samples, or on the clean samples only ("clean"
        collapsed in the fidelity scenario: f_r overfits the low-loss classes it already predicts).
        "posterior" is provisional: the benchmark's tuning stage chooses on validation.
    noise_branch : bool, default True
        [RECON] False = the ablation without the noise branch (no B^n, no NL loss).
    split : {"epoch", "batch"}, default "epoch"
        [RECON] 2-component GMM on per-sample CE of f_r, per epoch over the samples the epoch
        trains on (eval mode, before its first step), or per batch.
    split_scope : {"class", "pooled"}, default "class"
        [RECON] One Gaussian mixture per given label, or one over all samples (DivideMix).
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
    counts against the injected noise and the robust-CE weight sums per sample group (``noise-*``).

    Aggregation: B = sum_k p_k B_k^r per module (head: FedAvg). There is no global A, so there is
    no single global model: "global accuracy" is the mean of the clients' own models on the global
    test set. Each round's ``extra`` carries flat numeric ``feddr_*`` keys micro-averaged over the
    clients: the split's precision / recall against the injected noise and the mean robust-CE
    weight of truly noisy / clean and flagged / unflagged samples (``split_summary``).

    Download: the global B (and head) to every sampled client, which sets B_k^r <- B and keeps
    its own A_k; inference uses the robust branch W0 + s B A_k only.

    Arrays (Flower's ``start`` loop): no single global model, so ``aggregate_train`` returns
    what every client downloads alike: the global B^r and the head; ``configure_*`` continue
    from the arrays given (the same keys and shapes) as B^r and head. A_k and the noise branch
    stay on the clients; no arrays hold them.
    """

    method = feddr_lora.METHOD

    def setup(self) -> None:
        self.rank = min(p.rank for p in self.roster.profiles.values())  # one rank, settled by the roster
        factors, _ = split_payload(self.initial_adapter(self.rank))
        self.global_B: Payload = {m + "::B": f.B for m, f in factors.items()}  # (d_out, r) each
        self.head: Payload = head_only(self.initial_adapter(self.rank)) if self.sends_head else {}
        self.split_metrics: dict[int, dict[str, float]] = {}

    def download(self, partition: int, server_round: int, phase: Phase) -> Payload:
        return {**self.global_B, **self.head}

    def expected_upload(self, partition: int, server_round: int) -> dict[str, tuple[int, ...]]:
        return self.lora_shapes(self.rank, send_A=False, send_B=True)

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        if self.options.weights == "uniform":
            return normalise([1.0] * len(uploads))
        return super().weights(uploads)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        averaged = aggregate_robust_B([u.payload for u in uploads], self.weights(uploads), self.combine)
        self.global_B = {k: v for k, v in averaged.items() if k in self.global_B}
        self.head = {k: v for k, v in averaged.items() if k in self.head}
        self.split_metrics = {
            u.partition_id: {k: v for k, v in u.metrics.items() if k.startswith(NOISE_METRIC_PREFIX)} for u in uploads
        }

    def global_arrays(self) -> Payload:
        """The global B^r and the head (what every client downloads)."""
        return {**self.global_B, **self.head}

    def load_arrays(self, payload: Payload) -> None:
        self.global_B = {k: payload[k] for k in self.global_B}
        self.head = {k: payload[k] for k in self.head}

    def global_payload(self) -> Payload | None:
        return None  # A is local: every client has its own model

    def round_extra(self, server_round: int) -> dict[str, Any]:
        return split_summary({pid: m for pid, m in self.split_metrics.items() if m})
