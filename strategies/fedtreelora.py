"""FedTreeLoRA: layer-wise tree-structured aggregation (shared trunk, per-cluster branches).

ALGORITHMS.md, section "FedTreeLoRA". The math lives in the pure functions of this module
(distances, tree, cuts, cluster / external experts); :class:`FedTreeLoRA` is the protocol.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid
from flwr.supercore import log
from pydantic import Field

from fedlora.config import ConfigError, ExperimentConfig
from fedlora.lora import (
    Factors,
    Payload,
    head_only,
    join_payload,
    normalise,
    pad_rank,
    split_payload,
    truncate_rank,
    weighted_average,
)
from fedlora.models import layer_index
from strategies.base import Capabilities, ClientUpload, LoRAStrategy, StrategyOptions

EXTERNAL_PREFIX = "external::"  # download keys of the frozen external expert: external::<module>::A
NO_CLUSTER = -1

# --------------------------------------------------------------------------------------------
# pure functions: distances, tree, cuts
# --------------------------------------------------------------------------------------------


def modules_by_layer(modules: Sequence[str]) -> dict[int, list[str]]:
    """Transformer block -> its adapted modules (sorted), blocks ordered shallow to deep."""
    layers: dict[int, list[str]] = {}
    for module in sorted(modules):
        layers.setdefault(layer_index(module), []).append(module)
    return dict(sorted(layers.items()))


def layer_distances(
    Bs: Sequence[Mapping[str, np.ndarray]], layers: Mapping[int, list[str]], mode: str = "module_mean"
) -> dict[int, np.ndarray]:
    """D^(l)_ij between clients i and j in every block l, from their B factors.

    ``mode = 'module_mean'`` (the spec): D^(l)_ij = mean over the adapted modules m of block l of
    ||B_m,i - B_m,j||_F; ``'stacked'``: ||B_l,i - B_l,j||_F with B_l,i = client i's B of every
    module of block l stacked into one vector (larger modules weigh more).

    Bs: one ``module -> B (d_out, r_i)`` map per client; ranks may differ (zero-padded to the
    largest, which leaves B A unchanged). Returns block -> (N, N) symmetric, zero diagonal.
    """
    distances = {}
    for layer, modules in layers.items():
        rank = max(B[m].shape[1] for B in Bs for m in modules)
        per_module = []
        for m in modules:
            rows = np.stack([np.pad(B[m], ((0, 0), (0, rank - B[m].shape[1]))).ravel() for B in Bs])  # (N, d_out r)
            diff = rows[:, None, :].astype(np.float64) - rows[None, :, :]  # (N, N, d_out r)
            per_module.append((diff**2).sum(-1))  # squared distances, (N, N)
        if mode == "stacked":
            distances[layer] = np.sqrt(np.sum(per_module, axis=0))
        else:
            distances[layer] = np.mean(np.sqrt(per_module), axis=0)
    return distances


def global_distance(per_layer: Mapping[int, np.ndarray]) -> np.ndarray:
    """D_ij = (1/L) sum_l D^(l)_ij."""
    return np.mean(np.stack(list(per_layer.values())), axis=0)


def build_tree(D: np.ndarray) -> np.ndarray | None:
    """Agglomerative tree (scipy linkage matrix), average linkage on the condensed ``D``;
    None for fewer than two clients."""
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform

    if len(D) < 2:
        return None
    return linkage(squareform(D, checks=False), method="average")


def cut_tree(tree: np.ndarray | None, c: int, n: int) -> np.ndarray:
    """P_c: cluster label (0-based) of each of the ``n`` clients when the tree is cut into at
    most ``c`` clusters (scipy fcluster, criterion "maxclust")."""
    from scipy.cluster.hierarchy import fcluster

    if tree is None or c <= 1:
        return np.zeros(n, dtype=np.int64)
    return fcluster(tree, c, criterion="maxclust").astype(np.int64) - 1


def cut_score(D: np.ndarray, labels: np.ndarray, tau: float) -> float:
    """phi(P): tau for a single cluster, else the silhouette of P under the precomputed D
    (defined for 2 <= #clusters <= N - 1; -inf otherwise)."""
    from sklearn.metrics import silhouette_score

    clusters = len(np.unique(labels))
    if clusters == 1:
        return tau
    if not 2 <= clusters <= len(labels) - 1:
        return -math.inf
    return float(silhouette_score(D, labels, metric="precomputed"))


def layer_cuts(tree: np.ndarray | None, per_layer: Sequence[np.ndarray], tau: float, K: int) -> list[int]:
    """Cuts c*_l, shallow to deep, of ONE tree: c*_0 = 1 before the first block, then
    c*_l = argmax_{c in Omega_l} phi(P_c under D^(l)), Omega_l = {c : c*_(l-1) <= c <
    min(N, c*_(l-1) + K)}. Ties and an empty window keep c*_(l-1): cuts never decrease."""
    cuts, previous = [], 1
    for D in per_layer:
        n = len(D)
        window = range(previous, min(n, previous + K))
        scores = [cut_score(D, cut_tree(tree, c, n), tau) for c in window]
        if scores and max(scores) > -math.inf:
            previous = window[int(np.argmax(scores))]
        cuts.append(previous)
    return cuts


def independent_cuts(per_layer: Sequence[np.ndarray], tau: float) -> tuple[list[int], list[np.ndarray]]:
    """Ablation ``independent_layers``: every block builds its own tree from D^(l) and picks
    c in {1, ..., N-1} by phi, with no global tree and no monotone constraint."""
    cuts, labels = [], []
    for D in per_layer:
        n, tree = len(D), build_tree(D)
        window = range(1, max(2, n))
        scores = [cut_score(D, cut_tree(tree, c, n), tau) for c in window]
        c = window[int(np.argmax(scores))]
        cuts.append(c)
        labels.append(cut_tree(tree, c, n))
    return cuts, labels


# --------------------------------------------------------------------------------------------
# pure functions: aggregation
# --------------------------------------------------------------------------------------------


def mean_factors(factors: Sequence[Factors], weights: Sequence[float]) -> Factors:
    """FedAvg of one module: A = sum p_k A_k and B = sum p_k B_k, *separately* (ranks
    zero-padded to the largest, as FedIT does over mixed ranks)."""
    rank = max(f.rank for f in factors)
    padded = [pad_rank(f, rank) for f in factors]
    p = normalise(weights)
    A = np.tensordot(p, np.stack([f.A for f in padded]).astype(np.float64), axes=1)  # (r, d_in)
    B = np.tensordot(p, np.stack([f.B for f in padded]).astype(np.float64), axes=1)  # (d_out, r)
    return Factors(A.astype(np.float32), B.astype(np.float32))


def tree_aggregate(
    factors: Sequence[Mapping[str, Factors]],
    weights: Sequence[float],
    clusters: Mapping[str, np.ndarray],
) -> tuple[dict[str, dict[int, Factors]], dict[str, dict[int, Factors]]]:
    """Cluster and external experts of every module.

    factors: the uploaders' ``module -> Factors``; weights: their p_k; clusters: module -> the
    uploaders' cluster labels in that module's block. For a cluster S of a module:
    cluster expert = weighted mean of A and of B over S; external expert = the same over the
    uploaders outside S (absent when there are none, e.g. c*_l = 1: FedIT on that block).
    Returns (cluster experts, external experts), each module -> cluster id -> Factors.
    """
    w = np.asarray(weights, dtype=np.float64)
    cluster_experts: dict[str, dict[int, Factors]] = {}
    external_experts: dict[str, dict[int, Factors]] = {}
    for module, labels in clusters.items():
        labels = np.asarray(labels)
        cluster_experts[module], external_experts[module] = {}, {}
        for cluster in np.unique(labels):
            inside = labels == cluster
            members = [factors[i][module] for i in np.flatnonzero(inside)]
            cluster_experts[module][int(cluster)] = mean_factors(members, w[inside])
            if (~inside).any():
                others = [factors[i][module] for i in np.flatnonzero(~inside)]
                external_experts[module][int(cluster)] = mean_factors(others, w[~inside])
    return cluster_experts, external_experts


# --------------------------------------------------------------------------------------------
# protocol
# --------------------------------------------------------------------------------------------


class FedTreeLoRAOptions(StrategyOptions):
    """Options of FedTreeLoRA (ALGORITHMS.md, FedTreeLoRA; hyper-parameters tau, K, warm-up)."""

    warmup_rounds: int = Field(
        3, ge=1, description="Rounds of local-only training before the tree is built from the clients' B "
        "(must be < train.rounds)."
    )
    tau: float = Field(0.1, description="Score phi of the single-cluster cut c = 1 (bias toward sharing).")
    K: int = Field(2, ge=1, description="Window: block l may use c in [c*_(l-1), c*_(l-1) + K).")
    fixed_c: int | None = Field(
        None, ge=1, description="Ablation: cut every block into this many clusters (None = choose by "
        "silhouette). fixed_c = 1 is FedIT.",
    )
    independent_layers: bool = Field(
        False, description="Ablation: cluster every block on its own D^(l) (own tree, c in [1, N)) "
        "without the global tree or the never-coarser constraint.",
    )
    weights: Literal["samples", "uniform"] = Field(
        "samples", description="Expert averaging weights: 'samples' (p_k = n_k / sum n) or 'uniform'."
    )
    layer_distance: Literal["module_mean", "stacked"] = Field(
        "module_mean",
        description="D^(l)_ij: 'module_mean' = mean over the block's adapted modules of ||B_m,i - B_m,j||_F "
        "(the spec); 'stacked' = one norm of the block's B factors stacked together.",
    )
    lam0: float = Field(
        0.5, gt=0.0, lt=1.0,
        description="[RECON] Initial mixing weight lam = sigmoid(theta_l) of the cluster expert in every "
        "block (theta_l starts at logit(lam0)); the papers do not give it.",
    )


class FedTreeLoRA(LoRAStrategy):
    """FedTreeLoRA: clients share a trunk in shallow blocks and branch into clusters in deep ones.

    Paper: FedTreeLoRA (only its abstract is at hand: shared/papers/abstracts.md, "tree-structured
    aggregation for fine-grained, layer-wise alignment"); the spec followed here is ALGORITHMS.md,
    section FedTreeLoRA.

    Parameters
    ----------
    warmup_rounds : int, default 3
        Rounds of local-only training; the last one's B factors build the tree (once).
    tau : float, default 0.1
        phi(c = 1): the silhouette a finer cut must beat to split a block.
    K : int, default 2
        Window of candidate cuts per block, Omega_l = [c*_(l-1), min(N, c*_(l-1) + K)).
    fixed_c : int or None, default None
        Ablation: the same number of clusters in every block (1 = FedIT).
    independent_layers : bool, default False
        Ablation: per-block trees and cuts, no global tree, cuts may decrease with depth.
    weights : {"samples", "uniform"}, default "samples"
        Weights of the expert means.
    layer_distance : {"module_mean", "stacked"}, default "module_mean"
        D^(l)_ij as the mean of per-module norms (spec) or one norm of the stacked block.
    lam0 : float, default 0.5
        [RECON] Initial lam = sigmoid(theta_l) of every block (theta_l = logit(lam0)).

    Warm-up (rounds 1..W): nothing goes down (every client builds the same seeded initial
    adapter); clients train locally. Only round W's upload (A, B, and the head when
    ``model.head = global``) is sent: its B builds the distances D^(l)_ij = ||B_l,i - B_l,j||_F,
    the global tree on D = mean_l D^(l) (scipy, average linkage), and the cuts c*_l chosen shallow
    to deep by silhouette within the window, so cuts never get coarser with depth.

    Upload (after warm-up): the client's cluster expert A, B (and head). Aggregation per block
    and cluster S: cluster expert = weighted mean of A and of B over the uploaders in S
    (separately, FedAvg style); external expert = the same over the uploaders outside S. A block
    with c*_l = 1 has no external expert: FedIT on that block. The head is FedAvg over everyone.

    Download (one message per client): its cluster's expert (``<module>::A/B``), the external
    expert of its cluster (``external::<module>::A/B``, blocks with c*_l > 1 only) and the head.
    The client mixes them per block, h = W0 x + lam B_c A_c x + (1 - lam) B_e A_e x with a local
    learnable lam = sigmoid(theta_l) and the external expert frozen (clients/trainers/fedtreelora).

    Mixed ranks: averaging A and B within a cluster needs one rank, so FedTreeLoRA is a same-rank
    method (``clients.mixed_rank_policy``); if ranks still differ, factors are zero-padded to the
    largest rank and each client takes its first r_k components, as FedIT does.
    """

    name = "fedtreelora"
    Options: ClassVar[type[StrategyOptions]] = FedTreeLoRAOptions
    options: FedTreeLoRAOptions
    capabilities: ClassVar[Capabilities] = Capabilities(
        personalized=True,
        uploads="A, B, head (warm-up: only in its last round)",
        downloads="cluster expert A, B + external expert A, B per block, head",
        partial_participation=True,
        dp_compatible=False,  # two active peft adapters + a bare theta parameter: not verified with Opacus
        paper="FedTreeLoRA (shared/papers/abstracts.md)",
    )

    @classmethod
    def check_config(cls, experiment: ExperimentConfig) -> None:
        options = FedTreeLoRAOptions(**experiment.strategy.options())
        rounds = experiment.train.rounds
        if options.warmup_rounds >= rounds:
            raise ConfigError(
                f"strategy.warmup_rounds must be < train.rounds ({rounds}) so that some rounds "
                f"aggregate, got {options.warmup_rounds}; lower it or raise train.rounds"
            )
        if options.fixed_c is not None and options.fixed_c > experiment.data.num_clients:
            raise ConfigError(
                f"strategy.fixed_c must be <= data.num_clients ({experiment.data.num_clients}), "
                f"got {options.fixed_c}; lower it or unset it"
            )

    # ---------------------------------------------------------------- state
    def setup(self) -> None:
        self.layers = modules_by_layer(list(self.module_shapes))
        self.current_round = 0
        self.tree: np.ndarray | None = None
        self.tree_partitions: list[int] = []  # partition ids in tree order (leaf i = tree_partitions[i])
        self.cuts: dict[int, int] = {}  # block -> c*_l
        self.membership: dict[int, dict[int, int]] = {}  # block -> partition -> cluster
        self.cluster_experts: dict[str, dict[int, Factors]] = {}
        self.external_experts: dict[str, dict[int, Factors]] = {}
        self.fallback: dict[str, Factors] = {}  # everyone's mean, for a client the tree never saw
        self.head: Payload = {}
        self.distances: dict[int, np.ndarray] = {}

    @property
    def warming_up(self) -> bool:
        return self.current_round <= self.options.warmup_rounds

    def configure_train(
        self, server_round: int, arrays: Any, config: ConfigRecord, grid: Grid
    ) -> list[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))  # runs setup() once
        self.current_round = server_round  # expected_upload depends on the phase
        return messages

    def weights(self, uploads: list[ClientUpload]) -> np.ndarray:
        if self.options.weights == "uniform":
            return np.full(len(uploads), 1.0 / len(uploads))
        return super().weights(uploads)

    # ---------------------------------------------------------------- messages
    def download(self, node_id: int, server_round: int) -> Payload:
        if server_round <= self.options.warmup_rounds or not self.cluster_experts:
            return {}  # warm-up: local-only training from the common seeded initial adapter
        rank = self.profiles[node_id].rank
        partition = self.partition_of(node_id)
        cluster_factors: dict[str, Factors] = {}
        external_factors: dict[str, Factors] = {}
        for layer, modules in self.layers.items():
            cluster = self.membership.get(layer, {}).get(partition, NO_CLUSTER)
            for module in modules:
                expert = self.cluster_experts.get(module, {}).get(cluster, self.fallback[module])
                cluster_factors[module] = fit_rank(expert, rank)
                external = self.external_experts.get(module, {}).get(cluster)
                if external is not None:
                    external_factors[module] = fit_rank(external, rank)
        payload = join_payload(cluster_factors, self.head)
        payload.update({EXTERNAL_PREFIX + k: v for k, v in join_payload(external_factors).items()})
        return payload

    def expected_upload(self, node_id: int) -> dict[str, tuple[int, ...]]:
        if self.current_round < self.options.warmup_rounds:
            return {}  # early warm-up rounds: nothing needs to travel
        return self.lora_shapes(self.profiles[node_id].rank, send_A=True, send_B=True)

    # ---------------------------------------------------------------- aggregation
    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        if server_round < self.options.warmup_rounds:
            return
        if server_round == self.options.warmup_rounds:
            self.build_tree([u.partition_id for u in uploads], [split_payload(u.payload)[0] for u in uploads])
        factors = [split_payload(u.payload)[0] for u in uploads]
        w = self.weights(uploads)
        position = {p: i for i, p in enumerate(self.tree_partitions)}
        in_tree = [i for i, u in enumerate(uploads) if u.partition_id in position]
        clusters = {
            module: np.array([self.membership[layer][uploads[i].partition_id] for i in in_tree])
            for layer, modules in self.layers.items()
            for module in modules
        }
        if in_tree:
            new_cluster, new_external = tree_aggregate([factors[i] for i in in_tree], w[in_tree], clusters)
            for module in new_cluster:  # a cluster without uploads this round keeps its experts
                self.cluster_experts.setdefault(module, {}).update(new_cluster[module])
                self.external_experts.setdefault(module, {}).update(new_external[module])
        self.fallback = {m: mean_factors([f[m] for f in factors], w) for m in self.module_shapes}
        if self.sends_head:
            self.head = weighted_average([head_only(u.payload) for u in uploads], w)

    def build_tree(self, partitions: list[int], factors: list[dict[str, Factors]]) -> None:
        """Distances, the global tree and the per-block cuts and memberships (once)."""
        self.tree_partitions = partitions
        n = len(partitions)
        missing = sorted(set(map(self.partition_of, self.profiles)) - set(partitions))
        if missing:
            log(WARNING, "fedtreelora: clients %s sent no warm-up upload; they get everyone's mean", missing)
        self.distances = layer_distances(
            [{m: f.B for m, f in fs.items()} for fs in factors], self.layers, self.options.layer_distance
        )
        per_layer = list(self.distances.values())
        if self.options.independent_layers and self.options.fixed_c is not None:
            cuts = [min(self.options.fixed_c, n)] * len(per_layer)
            labels = [cut_tree(build_tree(D), c, n) for D, c in zip(per_layer, cuts)]
        elif self.options.independent_layers:
            cuts, labels = independent_cuts(per_layer, self.options.tau)
        else:
            self.tree = build_tree(global_distance(self.distances))
            if self.options.fixed_c is not None:
                cuts = [min(self.options.fixed_c, n)] * len(per_layer)
            else:
                cuts = layer_cuts(self.tree, per_layer, self.options.tau, self.options.K)
            labels = [cut_tree(self.tree, c, n) for c in cuts]
        for layer, c, labels_l in zip(self.layers, cuts, labels):
            self.cuts[layer] = int(c)
            self.membership[layer] = {p: int(cluster) for p, cluster in zip(partitions, labels_l)}
        log(INFO, "fedtreelora: tree over %d clients, cuts per block %s", n, list(self.cuts.values()))

    def global_payload(self) -> Payload | None:
        return None  # personalised: global accuracy is the clients' models on the global test

    # ---------------------------------------------------------------- results
    def tree_facts(self) -> dict[str, Any]:
        """The cut c*_l of every block (shallow to deep) and block -> partition -> cluster."""
        return {
            "cuts": [self.cuts[layer] for layer in self.layers],
            "clusters": {
                str(layer): {str(p): c for p, c in members.items()} for layer, members in self.membership.items()
            },
        }

    def round_extra(self, server_round: int) -> dict[str, Any]:
        if server_round < self.options.warmup_rounds or not self.cuts:
            return {"phase": "warmup" if server_round <= self.options.warmup_rounds else "no tree"}
        phase = "warmup" if server_round == self.options.warmup_rounds else "tree"
        return {"phase": phase, **self.tree_facts()}

    def save_artifacts(self, out_dir: Path) -> dict[str, Any]:
        """``tree.json`` and ``tree_cuts.png`` (dendrogram + cut per block); the cuts and
        memberships also go into the results' strategy info."""
        if not self.cuts:
            return {}
        info = {
            **self.tree_facts(),
            "tree_partitions": self.tree_partitions,
            "linkage": None if self.tree is None else self.tree.tolist(),
            "distances": {str(layer): D.round(6).tolist() for layer, D in self.distances.items()},
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "tree.json").write_text(json.dumps(info, indent=1))
        plot_tree_cuts(self.tree, self.tree_partitions, info["cuts"], out_dir / "tree_cuts.png")
        return {"fedtreelora": {k: info[k] for k in ("cuts", "clusters", "tree_partitions")}}


def fit_rank(f: Factors, rank: int) -> Factors:
    """Zero-pad or truncate to ``rank`` (a client takes the first r_k components)."""
    return truncate_rank(pad_rank(f, max(rank, f.rank)), rank)


def plot_tree_cuts(tree: np.ndarray | None, partitions: list[int], cuts: list[int], path: Path) -> None:
    """Dendrogram of the global tree (left) and the number of clusters per block (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy.cluster.hierarchy import dendrogram

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if tree is not None:
        dendrogram(tree, labels=[f"client {p}" for p in partitions], ax=left)
        left.set_ylabel("average-linkage distance")
    left.set_title("global tree (after warm-up)")
    right.step(range(len(cuts)), cuts, where="mid", marker="o")
    right.set_xlabel("transformer block (shallow -> deep)")
    right.set_ylabel("clusters c*_l")
    right.set_xticks(range(len(cuts)))
    right.set_yticks(range(1, max(cuts) + 1))
    right.set_title("layer-wise cut")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
