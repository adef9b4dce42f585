"""FFA-LoRA, FedSA-LoRA, local and FedDPA: known answers of each aggregation rule on hand-made
factors, the protocol (what goes down and up, malformed uploads rejected), and end-to-end rounds
with mixed ranks whose byte ledger equals exactly what each method sends."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from result_checks import assert_accuracies_add_up
from strategy_helpers import small_strategy

from fedlora.clients.trainers.base import LOCAL_STATE_KEY
from fedlora.config import ConfigError, load_config
from fedlora.lora import from_array_record, nested_A, payload_bytes, split_payload
from fedlora.methods.fedsa_lora import rowwise_average
from fedlora.methods.ffa_lora import aggregate_B, download_B
from fedlora.simulations.inprocess import InProcessGrid, node_configs
from fedlora.strategies.base import ClientUpload
from fedlora.strategies.feddpa import FedDPA
from fedlora.strategies.fedsa_lora import FedSALoRA
from fedlora.strategies.ffa_lora import FFALoRA
from fedlora.strategies.local import LocalOnly
from fedlora.strategies.validation import check_upload

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
RANKS = [2, 4, 8]  # forced below, so the ledger is known whatever smoke.toml declares
TINY_MODULES = 4  # tiny-bert: 2 layers x (query, value), 32 x 32 each
TINY_DIM = 32
HEAD_BYTES = (8 * TINY_DIM + 8) * 4  # noun8 classifier weight + bias, float32
ROUND_KEYS = {"round", "global_accuracy", "personalized_accuracy", "train_loss", "bytes_up", "bytes_down", "clients", "failures", "seconds"}


# ------------------------------------------------------------------------------ shared nested A
@pytest.mark.parametrize("module, d_in, small, large", [("m", 5, 1, 4), ("bert.layer.0.query", 32, 2, 8), ("x", 3, 3, 3)])
def test_nested_A_is_a_prefix_of_the_larger_rank(module: str, d_in: int, small: int, large: int) -> None:
    # Execute
    A_small, A_large = nested_A(module, small, d_in, seed=7), nested_A(module, large, d_in, seed=7)
    # Assert: same rows, identical on a second draw, within peft's kaiming-uniform bound
    assert np.array_equal(A_small, A_large[:small])
    assert np.array_equal(A_large, nested_A(module, large, d_in, seed=7))
    assert np.abs(A_large).max() <= 1.0 / np.sqrt(d_in)
    assert not np.array_equal(A_large, nested_A(module, large, d_in, seed=8))


def test_build_model_draws_identical_adapters_for_one_seed() -> None:
    # Prepare / Execute: two builds, as on two clients (or a client and the server)
    from fedlora.config import ModelConfig
    from fedlora.models import adapter_payload, build_model

    cfg = ModelConfig(path="tiny-bert", lora_rank=4)
    first, second = (adapter_payload(build_model(cfg, 8, 4, seed=3)) for _ in range(2))
    # Assert
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)


# ------------------------------------------------------------------------------ FFA-LoRA rule
@pytest.mark.parametrize(
    "Bs, weights, R, expected",
    [
        # equal ranks: the plain example-weighted mean of B
        ([np.ones((2, 2)), 3 * np.ones((2, 2))], [1, 3], 2, 2.5 * np.ones((2, 2))),
        # ranks 1 and 2: 0.5 * (2/1) * pad([1; 2]) + 0.5 * (2/2) * [[2, 4], [6, 8]]
        ([np.array([[1.0], [2.0]]), np.array([[2.0, 4.0], [6.0, 8.0]])], [1, 1], 2, np.array([[2.0, 2.0], [5.0, 4.0]])),
        # one client: unchanged
        ([np.array([[1.0, -1.0]])], [5], 2, np.array([[1.0, -1.0]])),
    ],
)
def test_ffa_aggregate_B_known_answers(Bs: list[np.ndarray], weights: list[float], R: int, expected: np.ndarray) -> None:
    # Execute
    B = aggregate_B([{"m": b} for b in Bs], weights, R)["m"]
    # Assert
    assert B.shape == expected.shape
    assert np.allclose(B, expected)


def test_ffa_download_truncates_and_rescales() -> None:
    # Prepare
    B = np.array([[2.0, 2.0], [5.0, 4.0]], np.float32)
    # Execute / Assert: rank 1 of R = 2 gets (1/2) B[:, :1]; rank R gets B itself
    assert np.allclose(download_B(B, 1), [[1.0], [2.5]])
    assert np.array_equal(download_B(B, 2), B)


@pytest.mark.parametrize("ranks, weights, alpha", [([2, 4, 8], [0.2, 0.3, 0.5], 16.0), ([3, 3], [0.5, 0.5], 8.0)])
def test_ffa_average_is_the_exact_average_of_the_updates(ranks: list[int], weights: list[float], alpha: float) -> None:
    # Prepare: the shared nested A and random B_k at each client's rank
    rng = np.random.default_rng(0)
    R, d_out, d_in = max(ranks), 6, 5
    A = nested_A("m", R, d_in, seed=0).astype(np.float64)
    Bs = [rng.standard_normal((d_out, r)) for r in ranks]
    # Execute
    B = aggregate_B([{"m": b} for b in Bs], weights, R)["m"]
    # Assert: s_R B A = sum_k p_k s_k B_k A[:r_k]  (unlike FedIT's separate means)
    expected = sum(p * (alpha / r) * b @ A[:r] for p, r, b in zip(weights, ranks, Bs))
    assert np.allclose((alpha / R) * B.astype(np.float64) @ A, expected, atol=1e-5)


# ------------------------------------------------------------------------------ FedSA-LoRA rule
@pytest.mark.parametrize(
    "As, weights, previous, expected",
    [
        # equal ranks: the plain weighted mean of A
        ([np.ones((2, 3)), 3 * np.ones((2, 3))], [0.25, 0.75], np.zeros((2, 3)), 2.5 * np.ones((2, 3))),
        # ranks 1 and 2: row 0 is held by both (mean 2), row 1 by the rank-2 client only (5)
        ([np.array([[1.0, 1.0]]), np.array([[3.0, 3.0], [5.0, 5.0]])], [0.5, 0.5], np.zeros((2, 2)),
         np.array([[2.0, 2.0], [5.0, 5.0]])),
        # a row nobody uploaded this round keeps its previous value
        ([np.array([[1.0, 2.0]])], [1.0], np.array([[0.0, 0.0], [7.0, 7.0]]), np.array([[1.0, 2.0], [7.0, 7.0]])),
    ],
)
def test_fedsa_rowwise_average_known_answers(
    As: list[np.ndarray], weights: list[float], previous: np.ndarray, expected: np.ndarray
) -> None:
    # Execute
    A = rowwise_average(As, weights, previous)
    # Assert
    assert np.allclose(A, expected)


# ------------------------------------------------------------------------------ protocol


def upload(k: int, payload: dict[str, np.ndarray], n: int) -> ClientUpload:
    return ClientUpload(partition_id=k, payload=payload, num_examples=n, metrics={})


def head(value: float) -> dict[str, np.ndarray]:
    return {"head::classifier.weight": np.full((2, 6), value, np.float32)}


def test_ffa_round_downloads_B_only_at_each_rank() -> None:
    # Prepare: ranks 1 and 2, 10 and 30 examples
    strategy = small_strategy(FFALoRA, [1, 2])
    uploads = [upload(0, {"m::B": np.ones((6, 1), np.float32)} | head(1.0), 10),
               upload(1, {"m::B": np.full((6, 2), 2.0, np.float32)} | head(3.0), 30)]
    # Execute
    first = strategy.download(0, 1, "train").payload
    strategy.aggregate(1, uploads)
    down0, down1 = strategy.download(0, 2, "train").payload, strategy.download(1, 2, "train").payload
    # Assert: B = 0.25 * 2 * pad(1) + 0.75 * 2 -> columns [2, 1.5]; rank 1 gets (1/2) [2]
    assert set(first) == {"m::B", "head::classifier.weight"} and not first["m::B"].any()
    assert np.allclose(down1["m::B"], np.tile([2.0, 1.5], (6, 1)))
    assert np.allclose(down0["m::B"], 1.0)
    assert np.allclose(down0["head::classifier.weight"], 2.5)
    payload = strategy.global_payload()
    assert np.array_equal(payload["m::A"], nested_A("m", 2, 5, seed=0))  # the shared frozen A


def test_fedsa_round_sends_A_keeps_no_B_and_has_no_global_model() -> None:
    # Prepare
    strategy = small_strategy(FedSALoRA, [1, 2])
    uploads = [upload(0, {"m::A": np.ones((1, 5), np.float32)} | head(1.0), 10),
               upload(1, {"m::A": np.full((2, 5), 2.0, np.float32)} | head(3.0), 30)]
    # Execute
    first = strategy.download(1, 1, "train").payload
    strategy.aggregate(1, uploads)
    down0, down1 = strategy.download(0, 2, "train").payload, strategy.download(1, 2, "train").payload
    # Assert: row 0 = 0.25 * 1 + 0.75 * 2, row 1 = 2 (client 1 only); rank 1 gets row 0
    assert np.array_equal(first["m::A"], nested_A("m", 2, 5, seed=0))
    assert np.allclose(down1["m::A"], [[1.75] * 5, [2.0] * 5])
    assert np.allclose(down0["m::A"], [[1.75] * 5])
    assert "m::B" not in down1 and strategy.global_payload() is None


def test_feddpa_round_averages_the_global_branch_only() -> None:
    # Prepare: the global branch g has one rank (model.lora_rank = 4) whatever the client ranks
    strategy = small_strategy(FedDPA, [1, 2])
    g = [{"m::A": np.full((4, 5), a, np.float32), "m::B": np.full((6, 4), b, np.float32)} for a, b in ((1.0, 2.0), (3.0, 6.0))]
    # Execute
    strategy.aggregate(1, [upload(0, g[0] | head(1.0), 10), upload(1, g[1] | head(3.0), 30)])
    down = strategy.download(0, 2, "train").payload
    # Assert: A = 0.25 * 1 + 0.75 * 3, B = 0.25 * 2 + 0.75 * 6, separately
    assert np.allclose(down["m::A"], 2.5) and np.allclose(down["m::B"], 5.0)
    assert np.allclose(down["head::classifier.weight"], 2.5)
    assert strategy.global_payload() is down


@pytest.mark.parametrize(
    "cls, rank, good, bad",
    [
        (FFALoRA, 2, {"m::B": (6, 2)}, {"m::A": (2, 5), "m::B": (6, 2)}),  # A must not travel
        (FedSALoRA, 2, {"m::A": (2, 5)}, {"m::A": (2, 5), "m::B": (6, 2)}),  # B must not travel
        (FedDPA, 2, {"m::A": (4, 5), "m::B": (6, 4)}, {"m::A": (2, 5), "m::B": (6, 2)}),  # g at rank 4
        (LocalOnly, 2, {}, {"m::A": (2, 5)}),  # nothing travels
    ],
)
def test_the_download_expects_the_methods_upload_and_rejects_anything_else(
    cls: type, rank: int, good: dict[str, tuple[int, ...]], bad: dict[str, tuple[int, ...]]
) -> None:
    # Prepare
    strategy = small_strategy(cls, [rank])
    head_shape = {} if cls is LocalOnly else {"head::classifier.weight": (2, 6)}
    make = lambda shapes: {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    # Execute
    expected = strategy.download(0, 2, "train").expected()
    # Assert
    assert check_upload(make(good | head_shape), expected) == ""
    assert check_upload(make(bad | head_shape), expected) != ""


@pytest.mark.parametrize("cls, name, otherwise", [(FFALoRA, "ffa_lora", "pad"), (FedSALoRA, "fedsa_lora", "nested")])
def test_refuse_option_stops_at_setup_on_mixed_ranks(cls: type, name: str, otherwise: str) -> None:
    # Execute / Assert: the message names the method, the ranks, the option and the fix
    with pytest.raises(RuntimeError) as refused:
        small_strategy(cls, [2, 4], ["strategy.mixed_ranks=refuse"])
    assert str(refused.value) == (f"{name} with strategy.mixed_ranks='refuse' needs one rank for every client, "
                                  f"got ranks [2, 4]; set strategy.mixed_ranks='{otherwise}'")
    small_strategy(cls, [2, 2], ["strategy.mixed_ranks=refuse"])  # one rank: fine


@pytest.mark.parametrize("name, init, why", [
    ("ffa_lora", "pissa", "ffa_lora draws its frozen A itself"),
    ("ffa_lora", "gaussian", "ffa_lora draws its frozen A itself"),
    ("fedsa_lora", "pissa", "fedsa_lora starts every client from one rank-nested A"),
])
def test_shared_nested_A_methods_refuse_another_init(name: str, init: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(SMOKE, [f"strategy.name={name}", f"model.init={init}"])
    assert str(refused.value).endswith(f"{why} (kaiming-uniform, B = 0); model.init must be 'kaiming', got '{init}'")


@pytest.mark.parametrize("cls", [FFALoRA, FedSALoRA, FedDPA, LocalOnly])
def test_local_head_never_travels(cls: type) -> None:
    # Prepare
    strategy = small_strategy(cls, [2], ["model.head=local"])
    # Execute
    down, up = strategy.download(0, 1, "train").payload, strategy.download(0, 2, "train").expected()
    # Assert
    assert not [k for k in [*down, *up] if k.startswith("head::")]


def test_feddpa_refuses_a_global_rank_larger_than_the_layers() -> None:
    with pytest.raises(ConfigError, match="strategy.global_rank"):
        small_strategy(FedDPA, [2], ["strategy.global_rank=6"])


# ------------------------------------------------------------------------------ end to end
class RecordingGrid(InProcessGrid):
    """The in-process grid, remembering every training message and reply."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.log: list[dict[str, Any]] = []

    def _deliver(self, message: Any) -> Any:
        reply = super()._deliver(message)
        if message.metadata.message_type == "train":
            self.log.append({
                "node": message.metadata.dst_node_id,
                "down": from_array_record(message.content["arrays"]),
                "up": {} if reply.has_error() else from_array_record(reply.content["arrays"]),
            })
        return reply


def run_recorded(tmp_path: Path, name: str) -> tuple[Any, RecordingGrid]:
    from fedlora.app.server import run_server
    from fedlora.clients.app import app as client_app

    config = load_config(SMOKE, [f"strategy.name={name}", f"clients.ranks={RANKS}"])
    grid = RecordingGrid(client_app, node_configs(config.data.num_clients))
    return run_server(grid, config, tmp_path), grid


def kept_state(out: Path, partition: int) -> Any:
    """The newest state client ``partition`` kept in the run ``out`` (its checkpoint file)."""
    from flwr.app import RecordDict

    from fedlora.checkpoint import CLIENTS_DIR, checkpoint_dir, restore_client_state

    state = RecordDict()
    assert restore_client_state(checkpoint_dir(out) / CLIENTS_DIR, partition, 10**6, state) > 0
    return state


def factor_bytes(rank: int) -> int:
    return TINY_MODULES * rank * TINY_DIM * 4  # one factor (A: r x 32 or B: 32 x r), float32


# bytes one client sends (= receives) per round, by client rank
LEDGER = {
    "ffa_lora": lambda r: factor_bytes(r) + HEAD_BYTES,  # B + head
    "fedsa_lora": lambda r: factor_bytes(r) + HEAD_BYTES,  # A + head
    "feddpa": lambda r: 2 * factor_bytes(4) + HEAD_BYTES,  # g (A, B) at model.lora_rank 4 + head
    "local": lambda r: 0,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LEDGER))
def test_round_trip_contract_and_exact_byte_ledger(tmp_path: Path, name: str) -> None:
    # Execute: smoke, ranks 2 / 4 / 8, 2 rounds, every client every round
    writer, grid = run_recorded(tmp_path, name)
    results = writer.to_dict()
    # Assert: the results.json contract
    assert {"strategy", "config", "rounds", "final"} <= set(results) and len(results["rounds"]) == 2
    assert all(ROUND_KEYS <= set(record) for record in results["rounds"])
    assert ROUND_KEYS | {"bytes_total"} <= set(results["final"])
    # Assert: the global accuracy says who measured it: the server (a global model) or the clients
    from fedlora.app.runner import final_scores

    by_clients = name in {"fedsa_lora", "local"}
    assert results["strategy_info"]["global_accuracy_from"] == ("clients" if by_clients else "server")
    assert final_scores(results).startswith("final global (clients) accuracy " if by_clients else "final global accuracy ")
    per_round = sum(LEDGER[name](r) for r in RANKS)
    for record in writer.rounds:
        assert record.failures == 0 and record.clients == 3
        assert record.bytes_up == record.bytes_down == per_round
    assert results["final"]["bytes_total"] == 2 * 2 * per_round
    # Assert: the ledger is what crossed the grid, key by key
    assert sum(payload_bytes(e["up"]) + payload_bytes(e["down"]) for e in grid.log) == 2 * 2 * per_round
    suffixes = {"ffa_lora": {"::B"}, "fedsa_lora": {"::A"}, "feddpa": {"::A", "::B"}, "local": set()}[name]
    for entry in grid.log:
        assert {k[-3:] for k in entry["up"] if not k.startswith("head::")} == suffixes
    for record in results["rounds"]:  # the clients' evaluation replies add up to the round's accuracies
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])
    # Assert: what each client kept after its last round (simulation: in its checkpoint file only)
    for k, rank in enumerate(RANKS):
        assert len(grid.contexts[1000 + k].state) == 0
        kept = from_array_record(kept_state(tmp_path, k)[LOCAL_STATE_KEY])
        factors, _ = split_payload({key: v for key, v in kept.items() if not key.startswith("local::")})
        for module, f in factors.items():
            assert f.A.shape == (4 if name == "feddpa" else rank, TINY_DIM)
            if name == "ffa_lora":  # A never trained: still the shared seeded init
                assert np.array_equal(f.A, nested_A(module, rank, TINY_DIM, seed=0))
            if name == "fedsa_lora":  # B_k trained locally and never replaced by a download
                assert np.abs(f.B).max() > 0
        if name == "feddpa":  # the local branch at the client's own rank, under local:: keys
            local, _ = split_payload({key.removeprefix("local::"): v for key, v in kept.items() if key.startswith("local::")})
            assert len(local) == TINY_MODULES and {f.A.shape for f in local.values()} == {(rank, TINY_DIM)}


@pytest.mark.slow
def test_feddpa_clients_save_both_branches_loadable_with_peft(tmp_path: Path) -> None:
    # Prepare: a FedDPA run saves adapters/client_<k> (g + head) with l in its local/ subfolder
    import torch
    from peft import PeftModel

    from fedlora.backbones import base_classifier

    run_recorded(tmp_path, "feddpa")
    folder = tmp_path / "adapters/client_2"
    # Execute
    model = PeftModel.from_pretrained(copy.deepcopy(base_classifier("tiny-bert", 8, 0)), str(folder))
    model.load_adapter(str(folder / "local"), adapter_name="local")
    model.base_model.set_adapter(["default", "local"])
    # Assert: l has the client's own rank (8), both branches trained (B != 0), the forward sums both
    layer = model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert layer.lora_A["local"].weight.shape == (RANKS[2], TINY_DIM)
    assert layer.lora_A["default"].weight.shape == (4, TINY_DIM)
    assert layer.lora_B["local"].weight.abs().max() > 0 and layer.lora_B["default"].weight.abs().max() > 0
    model.eval()
    x = torch.randn(3, TINY_DIM)
    with torch.no_grad():
        branches = sum(layer.scaling[a] * layer.lora_B[a](layer.lora_A[a](x)) for a in ("default", "local"))
        assert torch.allclose(layer(x), layer.base_layer(x) + branches, atol=1e-6)


# ------------------------------------------------------------------------------ FedDPA instance weighting
@pytest.mark.parametrize(
    "embeddings, reference, weight_max, expected",
    [
        ([[1.0, 0.0]], [[2.0, 0.0], [3.0, 0.0]], 0.5, [0.5]),  # same direction: cos 1 -> weight_max
        ([[0.0, 1.0]], [[1.0, 0.0]], 1.0, [0.0]),  # orthogonal: 0
        ([[1.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]], 1.0, [2**-0.5]),  # mean of two cos(45 deg)
        ([[-1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0]], 0.8, [0.0, 0.8]),  # negative similarity clipped to 0
    ],
)
def test_feddpa_instance_weights_known_answers(
    embeddings: list[list[float]], reference: list[list[float]], weight_max: float, expected: list[float]
) -> None:
    import torch

    from fedlora.clients.trainers.feddpa import instance_weights

    # Execute
    w = instance_weights(torch.tensor(embeddings), torch.tensor(reference), weight_max)
    # Assert
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)


def test_feddpa_branch_hooks_scale_each_branch_per_example() -> None:
    # Prepare: a tiny-bert with g (rank 4) and l (rank 2) both active, B != 0
    import torch
    from peft import LoraConfig

    from fedlora.clients.trainers.feddpa import LOCAL_BRANCH, branch_scale_hooks, instance_weighted
    from fedlora.config import ModelConfig
    from fedlora.models import build_model

    model = build_model(ModelConfig(path="tiny-bert", lora_rank=4, lora_dropout=0.0), 8, 4, seed=0)
    model.add_adapter(LOCAL_BRANCH, LoraConfig(r=2, lora_alpha=16, target_modules=["query", "value"]))
    model.base_model.set_adapter(["default", LOCAL_BRANCH])
    torch.manual_seed(0)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    model.eval()
    layer = model.base_model.model.bert.encoder.layer[0].attention.self.query
    x = torch.randn(2, 5, 32)  # (batch, seq, d_in)
    s_g, s_l = torch.tensor([0.3, 1.7]), torch.tensor([2.0, 0.1])
    # Execute
    handles = branch_scale_hooks(model, {"default": s_g, LOCAL_BRANCH: s_l})
    with torch.no_grad():
        scaled = layer(x)
    for handle in handles:
        handle.remove()
    # Assert: W0 x + s_g(x) dW_g x + s_l(x) dW_l x, per example; hooks gone afterwards
    with torch.no_grad():
        delta = {a: layer.scaling[a] * layer.lora_B[a](layer.lora_A[a](x)) for a in ("default", LOCAL_BRANCH)}
        expected = layer.base_layer(x) + s_g.view(-1, 1, 1) * delta["default"] + s_l.view(-1, 1, 1) * delta[LOCAL_BRANCH]
        assert torch.allclose(scaled, expected, atol=1e-6)
        assert torch.allclose(layer(x), layer.base_layer(x) + delta["default"] + delta[LOCAL_BRANCH], atol=1e-6)
        # w = 1/2 for every input (reference = the inputs' own embeddings, weight_max 1/2): the plain sum
        inputs = {"input_ids": torch.randint(0, 1000, (1, 6)), "attention_mask": torch.ones(1, 6, dtype=torch.long)}
        from fedlora.clients.trainers.feddpa import mean_embedding

        wrapper = instance_weighted(model, mean_embedding(model, inputs), 0.5)
        assert torch.allclose(wrapper(**inputs).logits, model(**inputs).logits, atol=1e-5)


@pytest.mark.slow
def test_feddpa_instance_weighting_runs_and_reports_its_weights(tmp_path: Path) -> None:
    # Execute
    from fedlora.app.runner import run_inprocess

    config = load_config(SMOKE, ["strategy.name=feddpa", "strategy.instance_weighting=true", "strategy.weight_max=0.8",
                                 "output.save_adapters=false"])
    results = run_inprocess(config, tmp_path).to_dict()
    # Assert: every client evaluated with its instance weights, within [0, weight_max]
    per_client = results["rounds"][-1]["per_client"]
    assert len(per_client) == 3
    assert all(0.0 <= metrics["dpa-mean-weight"] <= 0.8 for metrics in per_client.values())


def test_feddpa_rejects_a_weight_max_outside_the_unit_interval() -> None:
    with pytest.raises(ConfigError, match="strategy.weight_max"):
        load_config(SMOKE, ["strategy.name=feddpa", "strategy.weight_max=1.5"])
