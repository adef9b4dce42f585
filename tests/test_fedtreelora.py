"""FedTreeLoRA: tree, layer-wise cuts, cluster / external experts, the client's mixing, runs."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import fedlora_run
from result_checks import assert_accuracies_add_up

from fedlora.config import ConfigError, DataConfig, ModelConfig, load_config
from fedlora.lora import Factors, join_payload, padded_average, split_payload
from fedlora.lora import average_factors as mean_factors
from fedlora.methods.fedtreelora import (
    build_tree,
    cut_score,
    cut_tree,
    global_distance,
    independent_cuts,
    layer_cuts,
    layer_distances,
    modules_by_layer,
    tree_aggregate,
)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["strategy.name=fedtreelora", "strategy.warmup_rounds=1", "train.rounds=3", "clients.ranks=[4,4,4]"]


def grouped_Bs(
    clients: int, shallow: int, deep: int, groups: int = 2, spread: float = 5.0, noise: float = 0.05, seed: int = 0
) -> tuple[list[dict[str, np.ndarray]], dict[int, list[str]]]:
    """Hand-made B (8, 2) per client for ``shallow`` + ``deep`` blocks (2 modules each): in the
    shallow blocks everyone is near one centre; in the deep ones client k is near centre k % groups."""
    rng = np.random.default_rng(seed)
    modules = [f"enc.layer.{l}.{m}" for l in range(shallow + deep) for m in ("query", "value")]
    centres = {m: rng.normal(size=(groups, 8, 2)) * spread for m in modules}
    Bs = []
    for k in range(clients):
        B = {}
        for m, c in centres.items():
            deep_block = int(m.split(".")[2]) >= shallow
            B[m] = c[k % groups if deep_block else 0] + noise * rng.normal(size=(8, 2))
        Bs.append(B)
    return Bs, modules_by_layer(modules)


def random_factors(clients: int, modules: list[str], rank: int = 2, seed: int = 0) -> list[dict[str, Factors]]:
    rng = np.random.default_rng(seed)
    return [
        {m: Factors(rng.normal(size=(rank, 6)).astype(np.float32), rng.normal(size=(5, rank)).astype(np.float32)) for m in modules}
        for _ in range(clients)
    ]


# ---------------------------------------------------------------- distances and tree
@pytest.mark.parametrize(
    "mode, expected",
    [
        ("module_mean", (np.sqrt(6 * 1) + np.sqrt(8 * 4)) / 2),  # mean of the per-module norms (spec)
        ("stacked", np.sqrt(6 * 1 + 8 * 4)),  # one norm of the stacked block
    ],
)
def test_layer_distance_by_hand(mode: str, expected: float) -> None:
    # Prepare: two clients, one block of two modules (3 x 2 and 4 x 2)
    Bs = [{"l.0.q": np.zeros((3, 2)), "l.0.v": np.zeros((4, 2))}, {"l.0.q": np.ones((3, 2)), "l.0.v": 2 * np.ones((4, 2))}]
    # Execute
    D = layer_distances(Bs, {0: ["l.0.q", "l.0.v"]}, mode)[0]
    # Assert: the hand value off the diagonal, symmetric, zero on the diagonal
    assert D[0, 1] == pytest.approx(expected) and D[1, 0] == D[0, 1] and D[0, 0] == 0.0


@pytest.mark.parametrize("lam0", [0.1, 0.5, 0.9])
def test_initial_mixing_weight_is_the_lam0_option(lam0: float) -> None:
    import torch

    from fedlora.clients.trainers.fedtreelora import initial_theta

    # Execute
    theta = initial_theta(4, lam0)
    # Assert: every block starts at lam = sigmoid(theta) = lam0
    assert torch.sigmoid(torch.from_numpy(theta)).numpy() == pytest.approx([lam0] * 4, abs=1e-6)


def test_modules_are_grouped_by_transformer_block() -> None:
    # Prepare / Execute
    layers = modules_by_layer(["bert.encoder.layer.1.v", "bert.encoder.layer.0.q", "bert.encoder.layer.1.q"])
    # Assert
    assert layers == {0: ["bert.encoder.layer.0.q"], 1: ["bert.encoder.layer.1.q", "bert.encoder.layer.1.v"]}


# ---------------------------------------------------------------- cuts
CUT_CASES = [  # clients, shallow blocks, deep blocks, expected cuts
    (6, 1, 1, [1, 2]),
    (6, 2, 2, [1, 1, 2, 2]),
    (4, 1, 3, [1, 2, 2, 2]),
    (8, 3, 1, [1, 1, 1, 2]),
]


@pytest.mark.parametrize(("clients", "shallow", "deep", "expected"), CUT_CASES)
def test_two_groups_in_deep_blocks_give_cuts_1_then_2(clients: int, shallow: int, deep: int, expected: list[int]) -> None:
    # Prepare: one group in the shallow blocks, two obvious groups in the deep ones
    Bs, layers = grouped_Bs(clients, shallow, deep)
    per_layer = layer_distances(Bs, layers)
    tree = build_tree(global_distance(per_layer))
    # Execute
    cuts = layer_cuts(tree, list(per_layer.values()), tau=0.1, K=2)
    # Assert: 1 in the trunk, 2 in the branches, never decreasing, and the deep cut is the groups
    assert cuts == expected
    assert all(a <= b for a, b in pairwise(cuts))
    labels = cut_tree(tree, 2, clients)
    assert all(labels[k] == labels[k % 2] for k in range(clients)) and labels[0] != labels[1]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("K", [1, 2, 3])
def test_cuts_never_decrease_and_stay_in_the_window(seed: int, K: int) -> None:
    # Prepare: random B, so that silhouettes vary from block to block
    rng = np.random.default_rng(seed)
    Bs = [{f"x.layer.{l}.q": rng.normal(size=(4, 2)) for l in range(6)} for _ in range(7)]
    per_layer = layer_distances(Bs, modules_by_layer(list(Bs[0])))
    tree = build_tree(global_distance(per_layer))
    # Execute
    cuts = layer_cuts(tree, list(per_layer.values()), tau=-1.0, K=K)
    # Assert: c*_l in [c*_(l-1), c*_(l-1) + K) with c*_0 = 1
    previous = 1
    for c in cuts:
        assert previous <= c < previous + K
        previous = c


def test_high_tau_keeps_one_cluster_everywhere() -> None:
    # Prepare: clear groups in every block, but tau above any silhouette (<= 1)
    Bs, layers = grouped_Bs(6, 0, 3)
    per_layer = layer_distances(Bs, layers)
    # Execute
    cuts = layer_cuts(build_tree(global_distance(per_layer)), list(per_layer.values()), tau=1.5, K=2)
    # Assert
    assert cuts == [1, 1, 1]


SCORE_CASES = [  # labels, expected kind of score
    ([0, 0, 0, 0], "tau"),
    ([0, 1, 2, 3], "-inf"),  # N clusters: silhouette undefined
    ([0, 0, 1, 1], "silhouette"),
]


@pytest.mark.parametrize(("labels", "kind"), SCORE_CASES)
def test_cut_score_is_tau_silhouette_or_minus_infinity(labels: list[int], kind: str) -> None:
    # Prepare: two tight pairs far apart
    points = np.array([[0.0], [0.1], [10.0], [10.1]])
    D = np.abs(points - points.T)
    # Execute
    score = cut_score(D, np.array(labels), tau=0.25)
    # Assert
    expected = {"tau": 0.25, "-inf": -np.inf}.get(kind)
    if expected is None:
        assert 0.9 < score <= 1.0
    else:
        assert score == expected


def test_independent_layers_may_get_coarser_with_depth() -> None:
    # Prepare: two groups in block 0, one group in block 1 (the reverse of a trunk)
    Bs_deep, _ = grouped_Bs(6, 0, 1, seed=1)
    Bs_flat, _ = grouped_Bs(6, 1, 0, seed=2)
    Bs = [{"m.layer.0.q": a["enc.layer.0.query"], "m.layer.1.q": b["enc.layer.0.query"]} for a, b in zip(Bs_deep, Bs_flat)]
    per_layer = layer_distances(Bs, modules_by_layer(list(Bs[0])))
    # Execute
    cuts, labels = independent_cuts(list(per_layer.values()), tau=0.3)
    # Assert: the ablation drops the never-coarser rule (tau 0.3 > the noise's best silhouette)
    assert cuts == [2, 1] and len(np.unique(labels[1])) == 1


# ---------------------------------------------------------------- aggregation
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [10.0, 30.0, 60.0]])
def test_one_cluster_everywhere_equals_fedit(weights: list[float]) -> None:
    # Prepare: hand-made factors of 3 clients; FedIT's aggregate of the same uploads
    modules = ["m.layer.0.q", "m.layer.1.q"]
    factors = random_factors(3, modules)
    fedit = split_payload(padded_average([join_payload(f) for f in factors], weights, rank=2))[0]
    # Execute: c = 1 in every block
    cluster, external = tree_aggregate(factors, weights, {m: np.zeros(3, dtype=int) for m in modules})
    # Assert: the single cluster expert is FedIT's A and B; no external expert exists
    for m in modules:
        np.testing.assert_allclose(cluster[m][0].A, fedit[m].A, rtol=1e-6)
        np.testing.assert_allclose(cluster[m][0].B, fedit[m].B, rtol=1e-6)
    assert external == {m: {} for m in modules}


def test_cluster_and_external_experts_are_means_inside_and_outside() -> None:
    # Prepare: 4 clients, block 0 one cluster, block 1 clusters {0, 1} and {2, 3}
    modules = ["m.layer.0.q", "m.layer.1.q"]
    factors = random_factors(4, modules, seed=3)
    w = np.array([1.0, 3.0, 2.0, 2.0])
    clusters = {"m.layer.0.q": np.array([0, 0, 0, 0]), "m.layer.1.q": np.array([0, 0, 1, 1])}
    # Execute
    cluster, external = tree_aggregate(factors, w, clusters)
    # Assert: A and B averaged separately, weighted by n, inside / outside each cluster
    deep = "m.layer.1.q"
    mean_A = lambda ks: sum(w[k] * factors[k][deep].A for k in ks) / w[ks].sum()
    mean_B = lambda ks: sum(w[k] * factors[k][deep].B for k in ks) / w[ks].sum()
    np.testing.assert_allclose(cluster[deep][0].A, mean_A([0, 1]), rtol=1e-5)
    np.testing.assert_allclose(cluster[deep][1].B, mean_B([2, 3]), rtol=1e-5)
    np.testing.assert_allclose(external[deep][0].B, mean_B([2, 3]), rtol=1e-5)
    np.testing.assert_allclose(external[deep][1].A, mean_A([0, 1]), rtol=1e-5)
    assert external["m.layer.0.q"] == {}


def test_mean_of_mixed_ranks_pads_like_fedit() -> None:
    # Prepare: ranks 1 and 3
    rng = np.random.default_rng(0)
    small = Factors(rng.normal(size=(1, 4)), rng.normal(size=(5, 1)))
    large = Factors(rng.normal(size=(3, 4)), rng.normal(size=(5, 3)))
    # Execute
    mean = mean_factors([small, large], [1.0, 1.0])
    # Assert: the padded rows / columns of the rank-1 client count as zeros
    np.testing.assert_allclose(mean.A[1:], large.A[1:] / 2, rtol=1e-5)
    assert mean.rank == 3


def protocol_pair(options: list[str]) -> tuple:
    """A FedTreeLoRA (warm-up 1 round) and a FedIT on hand-made shapes: blocks 0 and 1, one
    module each (d_out 6, d_in 5), a 2 x 6 head; 4 clients of rank 2, profiles set."""
    from types import SimpleNamespace

    from fedlora.strategies.fedit import FedIT
    from fedlora.strategies.fedtreelora import FedTreeLoRA

    common = ["train.rounds=3", "data.num_clients=4", "clients.ranks=[2,2,2,2]"]
    tree_options = ["strategy.name=fedtreelora", "strategy.warmup_rounds=1", *options]
    configs = {
        FedTreeLoRA: load_config(ROOT / "configs/smoke.toml", [*common, *tree_options]),
        FedIT: load_config(ROOT / "configs/smoke.toml", common),
    }
    shapes = {"x.layer.0.q": (6, 5), "x.layer.1.q": (6, 5)}
    initial = join_payload({m: Factors(np.zeros((2, 5), np.float32), np.zeros((6, 2), np.float32)) for m in shapes})
    initial["head::classifier.weight"] = np.zeros((2, 6), np.float32)
    profiles = {k: SimpleNamespace(partition_id=k, rank=2) for k in range(4)}
    pair = []
    for cls in (FedTreeLoRA, FedIT):
        strategy = cls(configs[cls], lambda r: initial, shapes)
        strategy.roster.profiles = dict(profiles)  # type: ignore[arg-type]
        strategy.roster.node_of = {k: 100 + k for k in profiles}
        strategy.setup()
        pair.append(strategy)
    return tuple(pair)


def protocol_uploads(rng: np.random.Generator, groups: list[int]) -> list:
    """Uploads whose B sits near one of two centres per client group (far apart)."""
    from fedlora.strategies.base import ClientUpload

    centres = rng.normal(size=(2, 6, 2)) * 10
    uploads = []
    for k, g in enumerate(groups):
        payload = {
            f"x.layer.{l}.q::{f}": (rng.normal(size=(2, 5)) if f == "A" else centres[g] + rng.normal(size=(6, 2)) * 0.01)
            for l in (0, 1) for f in "AB"
        }
        payload = {key: v.astype(np.float32) for key, v in payload.items()}
        payload["head::classifier.weight"] = np.full((2, 6), float(k), np.float32)
        uploads.append(ClientUpload(k, payload, num_examples=10 * (k + 1), metrics={}))
    return uploads


def test_fixed_c_1_sends_every_client_fedits_global_adapter() -> None:
    # Prepare: the same uploads for FedTreeLoRA (fixed_c = 1) and FedIT
    tree, fedit = protocol_pair(["strategy.fixed_c=1"])
    uploads = protocol_uploads(np.random.default_rng(0), [0, 0, 1, 1])
    # Execute: round 1 builds the tree (warm-up end), round 2 aggregates again
    for server_round in (1, 2):
        tree.aggregate(server_round, uploads)
        fedit.aggregate(server_round, uploads)
    # Assert: no external expert; every client's download is FedIT's global A, B and head
    for k in range(4):
        download = tree.download(k, 3, "train").payload
        assert set(download) == set(fedit.download(k, 3, "train").payload)
        for key, value in fedit.download(k, 3, "train").payload.items():
            np.testing.assert_allclose(download[key], value, rtol=1e-6)
    assert tree.round_extra(2)["cuts"] == [1, 1]


def test_groups_in_B_give_per_client_cluster_and_external_experts() -> None:
    # Prepare: two groups of clients with far-apart B in both blocks
    tree, _ = protocol_pair([])
    uploads = protocol_uploads(np.random.default_rng(1), [0, 1, 0, 1])
    # Execute
    tree.aggregate(1, uploads)
    download = tree.download(0, 2, "train").payload
    # Assert: block 0 already splits (the groups differ there too), clusters are the groups,
    # client 0 gets the mean of clients {0, 2} and, as external expert, the mean of {1, 3}
    extra = tree.round_extra(1)
    assert extra["cuts"] == [2, 2] and extra["phase"] == "warmup"
    assert extra["clusters"]["1"]["0"] == extra["clusters"]["1"]["2"] != extra["clusters"]["1"]["1"]
    w = np.array([10.0, 30.0])  # n of clients 0 and 2
    key = "x.layer.1.q::B"
    np.testing.assert_allclose(download[key], (w[0] * uploads[0].payload[key] + w[1] * uploads[2].payload[key]) / w.sum(), rtol=1e-5)
    w_ext = np.array([20.0, 40.0])  # n of clients 1 and 3
    expected = (w_ext[0] * uploads[1].payload[key] + w_ext[1] * uploads[3].payload[key]) / w_ext.sum()
    np.testing.assert_allclose(download["external::" + key], expected, rtol=1e-5)
    assert tree.global_payload() is None


def test_warmup_sends_nothing_and_expects_nothing_before_its_last_round() -> None:
    # Prepare
    tree, _ = protocol_pair(["strategy.warmup_rounds=2"])
    # Execute / Assert: round 1 of 2 warm-up rounds: no download, no upload expected
    assert tree.download(0, 1, "train").payload == {} and tree.download(0, 1, "train").expected() == {}
    assert "x.layer.0.q::B" in tree.download(0, 2, "train").expected()


# ---------------------------------------------------------------- options
OPTION_CASES = [  # overrides, message fragment
    (["strategy.warmup_rounds=3", "train.rounds=3"], "strategy.warmup_rounds must be < train.rounds (3)"),
    (["strategy.warmup_rounds=0"], "strategy.warmup_rounds"),
    (["strategy.fixed_c=9"], "strategy.fixed_c must be <= data.num_clients (3)"),
    (["strategy.weights=median"], "strategy.weights"),
    (["strategy.K=0"], "strategy.K"),
    (["strategy.lam0=1.0"], "strategy.lam0"),
    (["strategy.layer_distance=max"], "strategy.layer_distance"),
]


@pytest.mark.parametrize(("overrides", "message"), OPTION_CASES)
def test_bad_options_are_config_errors(overrides: list[str], message: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(ROOT / "configs/smoke.toml", ["strategy.name=fedtreelora", "train.rounds=4", *overrides])


# ---------------------------------------------------------------- client mixing
def test_client_mixes_experts_by_sigmoid_theta_and_theta_gets_gradient() -> None:
    # Prepare: a tiny model, an external expert on block 1 only, theta_1 = 0.7
    import torch

    from fedlora.clients.trainers.fedtreelora import add_external_expert, attach_mixer
    from fedlora.models import adapter_payload, build_model

    cfg = ModelConfig(path="tiny-bert", lora_rank=2, lora_alpha=4, lora_dropout=0.0, init="gaussian")
    model = build_model(cfg, 3, 2, seed=0)
    own = adapter_payload(model)
    rng = np.random.default_rng(0)
    external = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in own.items() if ".layer.1." in k}
    mixed = add_external_expert(model, external, cfg.lora_alpha, cfg.lora_dropout)
    theta = torch.nn.Parameter(torch.tensor([0.0, 0.7]))
    attach_mixer(model, theta, mixed)
    module = "bert.encoder.layer.1.attention.self.query"
    layer = model.get_submodule("base_model.model." + module)
    x = torch.randn(3, 32)
    # Execute
    h = layer(x)
    h.sum().backward()
    # Assert: h = W0 x + lam s B_c A_c x + (1 - lam) s B_e A_e x, s = alpha / r = 2
    lam = torch.sigmoid(torch.tensor(0.7))
    W0 = layer.base_layer
    A_c, B_c = (torch.from_numpy(own[f"{module}::{f}"]) for f in "AB")
    A_e, B_e = (torch.from_numpy(external[f"{module}::{f}"]) for f in "AB")
    expected = W0(x) + lam * 2 * x @ A_c.T @ B_c.T + (1 - lam) * 2 * x @ A_e.T @ B_e.T
    torch.testing.assert_close(h, expected, rtol=1e-4, atol=1e-4)
    assert theta.grad is not None and theta.grad[1] != 0 and theta.grad[0] == 0
    assert not layer.lora_A["external"].weight.requires_grad and layer.lora_A["default"].weight.requires_grad
    assert set(adapter_payload(model)) == set(own)  # the upload is the cluster expert only


FEDERATED: dict[str, object] = {}


def tree_trainer(overrides: list[str]):
    """FedTreeLoRA's client trainer for partition 0 of the smoke federation (tiny-bert, rank 4),
    in round 2, the first tree round after a 1-round warm-up; default options unless overridden."""
    from flwr.app import RecordDict

    from fedlora.clients.trainers.base import ClientJob
    from fedlora.clients.trainers.fedtreelora import FedTreeLoRATrainer
    from fedlora.data import build_federated_data
    from fedlora.profile import resolve_profile

    config = load_config(ROOT / "configs/smoke.toml", [*SMOKE, *overrides])
    key = config.data.model_dump_json()
    if key not in FEDERATED:  # built once per module: every trainer here reads the same federation
        FEDERATED[key] = build_federated_data(config.data)
    federated = FEDERATED[key]
    job = ClientJob(config, resolve_profile(config, {"partition-id": 0}), federated.client(0), federated,
                    RecordDict(), {"server-round": 2})
    return FedTreeLoRATrainer(job)


@pytest.fixture(scope="module")
def two_experts() -> dict[str, dict[str, np.ndarray]]:
    """A hand-made pair of experts for client 0: ``good`` = LoRA factors and head trained on the
    client's own training split (60 steps at lr 1e-2, so it lowers the local loss), ``noise`` =
    Gaussian factors with 5 times its RMS per matrix (a harmful expert) and the same head."""
    import torch

    from fedlora.models import adapter_payload
    from fedlora.training import train

    trainer = tree_trainer([])
    model = trainer.prepare({})
    loader = trainer.loader(trainer.job.data.train, "train", shuffle=True)
    train(model, loader, epochs=20, lr=1e-2, device=torch.device("cpu"), max_steps=60)
    good = adapter_payload(model)
    rng = np.random.default_rng(0)
    noise = {
        k: v if k.startswith("head::") else (5 * rng.standard_normal(v.shape) * np.sqrt(np.mean(v**2))).astype(np.float32)
        for k, v in good.items()
    }
    return {"good": good, "noise": noise}


def two_expert_download(experts: dict[str, dict[str, np.ndarray]], cluster: str, external: str) -> dict[str, np.ndarray]:
    """The download of a tree round: ``cluster`` as the client's own expert (and the head),
    ``external`` as the external expert in both blocks."""
    own = experts[cluster]
    return {**own, **{"external::" + k: v for k, v in experts[external].items() if not k.startswith("head::")}}


def mixed_loss(trainer, model, logit: float) -> float:
    """Client 0's training loss with lam = sigmoid(logit) in every block (theta restored after)."""
    from fedlora.training import evaluate

    saved = trainer.theta.detach().clone()
    trainer.theta.data.fill_(logit)
    loss = evaluate(model, trainer.loader(trainer.job.data.train, "train"), trainer.device).loss
    trainer.theta.data.copy_(saved)
    return loss


@pytest.mark.parametrize(
    "cluster, external, toward",
    [
        ("noise", "good", -1.0),  # the external expert lowers the loss: lam must fall
        ("good", "noise", +1.0),  # the cluster expert lowers the loss: lam must rise
    ],
)
def test_mixing_weight_moves_toward_the_expert_that_lowers_the_loss(
    two_experts: dict[str, dict[str, np.ndarray]], cluster: str, external: str, toward: float
) -> None:
    import math

    # Prepare: the default options (lam0 = 0.5, mixing_lr default), one round's download
    trainer = tree_trainer([])
    model = trainer.prepare(two_expert_download(two_experts, cluster, external))
    start = float(trainer.theta.detach()[0])
    # Assert: the premise: lam -> 1 (cluster expert alone) vs lam -> 0 (external alone)
    losses = {"cluster": mixed_loss(trainer, model, 20.0), "external": mixed_loss(trainer, model, -20.0)}
    good_side = "external" if external == "good" else "cluster"
    assert losses[good_side] < losses["cluster" if good_side == "external" else "external"] - 0.05
    # Execute: one local run (smoke: 5 steps of 16 examples)
    stats = trainer.fit(model)
    lam = trainer.train_metrics()
    # Assert: in both blocks theta moved toward the good expert, by far more than the LoRA
    # learning rate could move it in 5 steps (5 x 1e-3): theta has its own learning rate
    assert stats.steps == 5 and set(lam) == {"fedtreelora-lam-0", "fedtreelora-lam-1"}
    for block in (0, 1):
        moved = math.log(lam[f"fedtreelora-lam-{block}"] / (1 - lam[f"fedtreelora-lam-{block}"])) - start
        assert toward * moved > 0.1, f"block {block}: theta moved {moved:+.3f}"


def test_mixing_lr_zero_keeps_lam_at_lam0(two_experts: dict[str, dict[str, np.ndarray]]) -> None:
    # Prepare: the ablation "lam fixed at lam0", with a lam0 other than 0.5
    trainer = tree_trainer(["strategy.mixing_lr=0", "strategy.lam0=0.3"])
    model = trainer.prepare(two_expert_download(two_experts, "noise", "good"))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_B.default" in n}
    # Execute
    trainer.fit(model)
    # Assert: lam stays exactly lam0 while the cluster expert still trains
    assert trainer.train_metrics() == pytest.approx({"fedtreelora-lam-0": 0.3, "fedtreelora-lam-1": 0.3}, abs=1e-7)
    after = dict(model.named_parameters())
    assert any(not bool((after[n] == before[n]).all()) for n in before)


def test_theta_has_its_own_parameter_group_without_weight_decay(two_experts: dict[str, dict[str, np.ndarray]]) -> None:
    # Prepare
    trainer = tree_trainer(["strategy.mixing_lr=0.25", "train.weight_decay=0.1"])
    model = trainer.prepare(two_expert_download(two_experts, "noise", "good"))
    # Execute
    groups = trainer.parameter_groups(model, None)
    # Assert: theta only in the second group, at mixing_lr and without decay; LoRA keeps train.*
    assert len(groups) == 2 and groups[1] == {"params": [trainer.theta], "lr": 0.25, "weight_decay": 0.0}
    assert all(p is not trainer.theta for p in groups[0]["params"]) and set(groups[0]) == {"params"}
    # Assert: a round without an external expert (nothing mixed) trains no theta
    plain = tree_trainer([])
    assert len(plain.parameter_groups(plain.prepare({}), None)) == 1


def test_round_extra_records_lam_cuts_and_cluster_sizes_per_block() -> None:
    # Prepare: clients 0, 2 and 1, 3 form two groups in both blocks; clients report lam per block
    tree, _ = protocol_pair([])
    uploads = protocol_uploads(np.random.default_rng(1), [0, 1, 0, 1])
    tree.aggregate(1, uploads)  # warm-up end: the tree, cuts [2, 2]
    lam = {0: {0: 0.4, 1: 0.7}, 1: {0: 0.6, 1: 0.9}, 2: {1: 0.2}, 3: {}}  # client -> block -> lam
    for u in uploads:
        u.metrics.update({f"fedtreelora-lam-{b}": v for b, v in lam[u.partition_id].items()})
    # Execute
    tree.aggregate(2, uploads)
    extra = tree.round_extra(2)
    # Assert: lists per block and flat numbers, by hand
    assert extra["cuts"] == [2, 2] and extra["cluster_sizes"] == [[2, 2], [2, 2]]
    assert extra["lam_mean"] == pytest.approx([0.5, 0.6]) and extra["lam_min"] == [0.4, 0.2]
    assert extra["lam_max"] == [0.6, 0.9]
    assert extra["fedtreelora_lam_mean_b1"] == pytest.approx(0.6) and extra["fedtreelora_lam_min_b0"] == 0.4
    assert extra["fedtreelora_lam_mean"] == pytest.approx((0.4 + 0.7 + 0.6 + 0.9 + 0.2) / 5)
    assert extra["fedtreelora_lam_min"] == 0.2 and extra["fedtreelora_lam_max"] == 0.9
    assert extra["fedtreelora_cut_b0"] == 2.0 and extra["fedtreelora_clusters_b1"] == 2.0
    assert extra["fedtreelora_cluster_size_min_b0"] == extra["fedtreelora_cluster_size_max_b1"] == 2.0
    flat = {k: v for k, v in extra.items() if k.startswith("fedtreelora_")}
    assert all(isinstance(v, float) for v in flat.values())


def test_the_tree_recovers_three_planted_groups_from_their_updates() -> None:
    # Prepare: 9 clients in 3 contiguous task groups (as data.partition = 'grouped' deals them): one
    # shared centre in the shallow block, one centre per group in the 3 deep blocks
    from fedlora.data.federated import client_groups
    from fedlora.methods.fedtreelora import FedTreeLoRAOptions, grow_tree, tree_agreement

    Bs, layers = grouped_Bs(9, shallow=1, deep=3, groups=3)  # client k near centre k % 3 in deep blocks
    order = sorted(range(9), key=lambda k: (k % 3, k))  # leaf i = client order[i]: groups now contiguous
    groups = client_groups(DataConfig(num_clients=9, partition="grouped", num_groups=3))
    # Execute
    _, _, cuts, labels = grow_tree([Bs[k] for k in order], layers, FedTreeLoRAOptions(K=3))
    agreement = tree_agreement({block: dict(enumerate(lab.tolist())) for block, lab in zip(layers, labels)}, groups)
    # Assert: one cluster in the trunk (ARI 0 against 3 groups), exactly the groups in every deep block
    assert groups == {i: i // 3 for i in range(9)}
    assert cuts == [1, 3, 3, 3]
    assert agreement == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}


def test_round_extra_records_the_agreement_with_planted_groups() -> None:
    # Prepare: task groups {0, 1} and {2, 3}; the clients' B make clusters {0, 2} and {1, 3}
    tree, _ = protocol_pair(["data.partition=grouped", "data.num_groups=2"])
    uploads = protocol_uploads(np.random.default_rng(1), [0, 1, 0, 1])
    tree.aggregate(1, uploads)
    # Execute
    extra = tree.round_extra(1)
    # Assert: ARI by hand: every contingency cell holds 1 client, so index 0, expected 2 * 2 / 6,
    # maximum 2: (0 - 2/3) / (2 - 2/3) = -0.5, in both blocks
    assert extra["tree_ari"] == pytest.approx([-0.5, -0.5])
    assert extra["fedtreelora_ari_b0"] == pytest.approx(-0.5) and extra["fedtreelora_ari_b1"] == pytest.approx(-0.5)
    # ... and no agreement is recorded where there are no planted groups
    plain, _ = protocol_pair([])
    plain.aggregate(1, uploads)
    assert "tree_ari" not in plain.round_extra(1)


def test_update_distances_equal_raw_ones_when_every_client_downloaded_the_same_B() -> None:
    # Prepare: grouped uploads; a shared download S (the warm-up's average, before the tree is built)
    # and per-group downloads (what clients start from once clusters have their own experts)
    from fedlora.methods.fedtreelora import layer_distances, update_of

    Bs, layers = grouped_Bs(6, shallow=1, deep=2, groups=2)
    rng = np.random.default_rng(3)
    shared = {m: rng.normal(size=(8, 2)) for m in Bs[0]}
    per_group = [{m: rng.normal(size=(8, 2)) for m in Bs[0]} for _ in range(2)]
    # Execute
    raw = layer_distances(Bs, layers)
    same_start = layer_distances([{m: update_of(B[m], shared[m]) for m in B} for B in Bs], layers)
    own_start = layer_distances([{m: update_of(B[m], per_group[k % 2][m]) for m in B} for k, B in enumerate(Bs)],
                                layers)
    # Assert: a start every client shares cancels in every difference B_i - B_j, so 'update' and
    # 'raw' build the same tree when it is built once after the warm-up (docs/algorithms.md); they
    # differ only when clients started from different B (a tree rebuilt after clusters formed)
    for layer in layers:
        np.testing.assert_allclose(same_start[layer], raw[layer], rtol=1e-12, atol=1e-12)
    assert not np.allclose(own_start[1], raw[1])


def test_update_of_subtracts_the_downloaded_B_fitted_to_the_uploads_rank() -> None:
    from fedlora.methods.fedtreelora import update_of

    B = np.arange(12, dtype=np.float32).reshape(6, 2)
    wide = np.ones((6, 3), np.float32)  # rank 3 downloaded, rank 2 trained: its first 2 columns
    narrow = np.ones((6, 1), np.float32)  # rank 1 downloaded: zero-padded to 2
    assert np.array_equal(update_of(B, wide), B - 1)
    assert np.array_equal(update_of(B, narrow), B - np.array([1.0, 0.0], np.float32))
    assert update_of(B, None) is B


@pytest.mark.parametrize(("distance", "expected"), [("raw", [0, 1, 0, 1]), ("update", [0, 0, 1, 1])])
def test_a_rebuilt_tree_clusters_the_raw_factors_or_the_rounds_updates(distance: str, expected: list[int]) -> None:
    # Prepare: the warm-up groups clients {0, 2} and {1, 3} (B far apart); in round 2 each client
    # starts from its cluster's expert and moves by an update that groups {0, 1} and {2, 3}
    tree, _ = protocol_pair([f"strategy.tree_distance={distance}", "strategy.rebuild_every=1"])
    rng = np.random.default_rng(3)
    tree.aggregate(1, protocol_uploads(rng, [0, 1, 0, 1]))
    sent = {p: tree.download(p, 2, "train") for p in range(4)}
    downloads = {p: split_payload(download.payload)[0] for p, download in sent.items()}
    moves = rng.normal(size=(2, 6, 2))  # one update direction per new group
    uploads = protocol_uploads(rng, [0, 1, 0, 1])
    for upload, group in zip(uploads, [0, 0, 1, 1]):
        upload.download = sent[upload.partition_id]  # what the base attaches to a reply it reads
        for module in ("x.layer.0.q", "x.layer.1.q"):
            start = downloads[upload.partition_id][module].B
            upload.payload[f"{module}::B"] = (start + moves[group] + rng.normal(size=(6, 2)) * 0.01).astype(np.float32)
    # Execute
    tree.aggregate(2, uploads)
    extra = tree.round_extra(2)
    # Assert: rebuilt; the clusters follow the raw factors (the warm-up's groups) or the updates
    labels = [tree.membership[1][p] for p in range(4)]
    assert extra["tree_rebuilt"] == 1.0
    assert (labels[0] == labels[1]) == (expected[0] == expected[1])
    assert (labels[0] == labels[2]) == (expected[0] == expected[2]) and labels[0] != labels[3]


def test_cluster_sizes_and_missing_lam_of_a_block_without_mixing() -> None:
    from fedlora.methods.fedtreelora import mechanism_extra

    # Execute: block 0 one cluster of 5 (nobody mixes it), block 1 clusters of 3, 1 and 1
    extra = mechanism_extra({0: 1, 1: 3}, {0: dict.fromkeys(range(5), 0), 1: {0: 0, 1: 0, 2: 2, 3: 0, 4: 1}}, {1: [0.25]})
    # Assert
    assert extra["cluster_sizes"] == [[5], [3, 1, 1]] and extra["lam_mean"] == [None, 0.25]
    assert "fedtreelora_lam_mean_b0" not in extra and extra["fedtreelora_cluster_size_min_b1"] == 1.0
    assert extra["fedtreelora_cluster_size_max_b0"] == 5.0 and extra["fedtreelora_lam_max"] == 0.25


# ---------------------------------------------------------------- data
def test_grouped_partition_gives_disjoint_class_blocks() -> None:
    # Prepare
    from fedlora.data import build_federated_data

    cfg = DataConfig(max_examples=1200, global_test_size=200, num_clients=6, partition="grouped", num_groups=2)
    # Execute
    counts = build_federated_data(cfg).label_counts()
    # Assert: clients 0-2 only see classes 0-3, clients 3-5 only classes 4-7
    assert counts[:3, 4:].sum() == 0 and counts[3:, :4].sum() == 0
    assert (counts.sum(axis=1) > 0).all()


def test_grouped_partition_rejects_more_groups_than_clients() -> None:
    from fedlora.data import DataError, build_federated_data

    with pytest.raises(DataError, match="data.num_groups must be <="):
        build_federated_data(DataConfig(max_examples=600, global_test_size=100, num_clients=3, partition="grouped", num_groups=4))


# ---------------------------------------------------------------- end to end
@pytest.mark.e2e
def test_inprocess_smoke_records_cuts_and_plots_the_tree(tmp_path: Path) -> None:
    # Prepare
    from fedlora.app.runner import run_inprocess

    config = load_config(ROOT / "configs/smoke.toml", SMOKE)
    # Execute
    run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: round 1 is the (only) warm-up round: nothing down; every round has metrics
    rounds = results["rounds"]
    assert rounds[0]["bytes_down"] == 0 and rounds[0]["bytes_up"] > 0
    assert rounds[1]["bytes_down"] > 0 and rounds[1]["extra"]["phase"] == "tree"
    cuts = rounds[-1]["extra"]["cuts"]
    assert len(cuts) == 2 and all(1 <= a <= b for a, b in pairwise(cuts))
    assert set(rounds[-1]["extra"]["clusters"]["0"]) == {"0", "1", "2"}
    assert [rounds[-1]["extra"][f"fedtreelora_cut_b{b}"] for b in (0, 1)] == cuts
    assert [sum(sizes) for sizes in rounds[-1]["extra"]["cluster_sizes"]] == [3, 3]
    for record in rounds:
        assert_accuracies_add_up(record, config.data.global_test_size)
    assert results["strategy_info"]["fedtreelora"]["cuts"] == cuts
    assert (tmp_path / "tree_cuts.png").stat().st_size > 0 and (tmp_path / "tree.json").is_file()


@pytest.mark.slow
def test_cli_run(tmp_path: Path) -> None:
    # Prepare / Execute: the CLI, in process (Ray: tests/test_run.py, tests/test_ray_cluster.py; gRPC:
    # tests/test_deploy_strategies.py)
    proc = fedlora_run(tmp_path, *SMOKE, args=("--engine", "inprocess"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Assert
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["final"]["failures"] == 0 and len(results["rounds"]) == 3
    assert (tmp_path / "tree_cuts.png").is_file()


# ---------------------------------------------------------------- the per-method config
SIZE_KEYS = {"data.max_examples", "data.global_test_size", "train.rounds", "federation.evaluate_every", "output.dir",
             "train.precision"}  # the scenario pins fp32 for its records; the user's config runs the machine's best


def flat(config: object) -> dict[str, object]:
    """``section.key -> value`` of a validated config (defaults included)."""
    return {f"{section}.{key}": value for section, values in config.model_dump().items() for key, value in values.items()}


def test_method_config_is_its_scenario_at_a_smaller_size() -> None:
    # Prepare: the config a user reaches for first, and the fidelity scenario
    config = flat(load_config(ROOT / "configs/fedtreelora.toml"))
    scenario = flat(load_config(ROOT / "configs/scenarios/fedtreelora.toml"))
    # Assert: every key equals the scenario's (grouped partition, local heads, warm-up, strategy
    # options, training) except the size; and it is smaller
    differing = sorted(k for k in scenario if config[k] != scenario[k])
    assert set(differing) <= SIZE_KEYS, differing
    assert config["data.max_examples"] < scenario["data.max_examples"] and config["train.rounds"] < scenario["train.rounds"]
    assert config["model.head"] == "local" and config["data.partition"] == "grouped"
