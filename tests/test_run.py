"""End to end: the real ClientApp and ServerApp, in process and on Flower's simulation engine."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from cli_helpers import assert_only_fedlora_lines, fedlora_run
from result_checks import assert_accuracies_add_up, is_fraction_of

from fedlora.app.runner import run_inprocess
from fedlora.config import load_config

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
ROUND_KEYS = {"round", "global_accuracy", "personalized_accuracy", "train_loss", "bytes_up", "bytes_down", "clients", "failures", "seconds"}


def assert_results_contract(results: dict, rounds: int) -> None:
    assert {"strategy", "config", "rounds", "final"} <= set(results)
    assert len(results["rounds"]) == rounds
    for record in results["rounds"]:
        assert ROUND_KEYS <= set(record)
        assert record["clients"] > 0
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])  # every round evaluates
    assert ROUND_KEYS | {"bytes_total"} <= set(results["final"])
    assert results["final"]["bytes_total"] == sum(r["bytes_up"] + r["bytes_down"] for r in results["rounds"])


def test_inprocess_fedit_counts_exact_bytes(tmp_path: Path) -> None:
    # Prepare: 3 clients of rank 4 send A (4 x d_in), B (d_out x 4) for every module, plus the head
    config = load_config(ROOT / "configs/smoke.toml", ["clients.ranks=[4, 4, 4]"])
    # Execute
    writer = run_inprocess(config, tmp_path)
    results = writer.to_dict()
    # Assert
    assert_results_contract(results, config.train.rounds)
    adapter = writer.rounds[0]
    per_client = 2 * 2 * (4 * 32 + 32 * 4) * 4 + (8 * 32 + 8) * 4  # 2 layers x (query, value), float32
    assert adapter.bytes_up == adapter.bytes_down == 3 * per_client
    assert (tmp_path / "adapters/global/adapter_config.json").is_file()
    assert (tmp_path / "accuracy_vs_round.png").is_file()
    # Assert: the classes by name, in the head's order (WordNet 3.0's 8 largest noun files, in file order)
    assert results["id2label"] == {
        "0": "noun.act", "1": "noun.animal", "2": "noun.artifact", "3": "noun.communication", "4": "noun.location",
        "5": "noun.person", "6": "noun.plant", "7": "noun.state"}


def test_received_accuracy_is_the_previous_aggregate_on_the_local_test_splits(tmp_path: Path) -> None:
    # Prepare: FedIT, mixed ranks (each client receives the global factors cut to its rank), every
    # client trains and is evaluated every round
    config = load_config(ROOT / "configs/smoke.toml", ["train.rounds=3"])
    # Execute
    rounds = run_inprocess(config, tmp_path).to_dict()["rounds"]
    # Assert: the model a client receives in round t is the one it is evaluated with after round t - 1,
    # on the same local test split: the two accuracies agree exactly, client by client
    for before, after in itertools.pairwise(rounds):
        assert after["received_accuracy"] == pytest.approx(before["personalized_accuracy"], abs=1e-12)
        assert after["received_accuracy_unweighted"] == pytest.approx(before["personalized_accuracy_unweighted"], abs=1e-12)
    # round 1: the common initial adapter on each client's local test split (its evaluation rows count them)
    assert is_fraction_of(rounds[0]["received_accuracy"], int(sum(r["num-examples"] for r in rounds[0]["per_client"].values())))


@pytest.mark.slow
def test_ray_simulation_writes_valid_results(tmp_path: Path) -> None:
    # Execute: the CLI on Flower's simulation engine (Ray backend)
    proc = fedlora_run(tmp_path)
    # Assert
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert_results_contract(results, 2)
    assert results["config"]["output"]["dir"] == str(tmp_path)
    assert "final global accuracy" in proc.stdout
    # Assert: quiet on Ray too (actors included): fedlora's lines only, stderr empty (tests/test_quiet.py)
    assert_only_fedlora_lines(proc.stdout, rounds=2)
    assert proc.stderr == "", proc.stderr[-3000:]


def test_each_simulated_client_asks_ray_for_its_gpu_fraction_and_a_machine_without_one_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fedlora.app.runner import backend_config, check_ray_resources
    from fedlora.config import ConfigError

    # Prepare: a quarter of a GPU per client (four clients share one)
    config = load_config("configs/smoke.toml", ["federation.num_gpus=0.25", "federation.num_cpus=1"])
    # Assert: Flower's Ray backend gets it as each client's resources (its client_resources keys)
    assert backend_config(config, tmp_path)["client_resources"] == {"num_cpus": 1, "num_gpus": 0.25}
    # Assert: a machine with one CUDA GPU takes it; one without, or a fraction above its count, is one line
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_ray_resources(config)
    with pytest.raises(ConfigError, match=r"has 1 CUDA GPU; set federation.num_gpus = 0 \(CPU\) or at most 1"):
        check_ray_resources(load_config("configs/smoke.toml", ["federation.num_gpus=2"]))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ConfigError, match="this machine has no CUDA GPU"):
        check_ray_resources(config)
    # Assert: a cluster owns its resources: not checked here
    check_ray_resources(load_config("configs/smoke.toml", ["federation.num_gpus=0.25",
                                                           'federation.ray_address="127.0.0.1:6379"']))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "strategy.name=nope"], "unknown strategy"),
        (["--set", "model.path=/no/such/model"], "model path not found"),
        (["--set", "model.lora_rank=-1"], "model.lora_rank"),
        (["--set", "data.noise_rate=1.5"], "data.noise_rate"),
        (["--set", "data.bogus=1"], "unknown config key"),
        (["--set", "data.source=/no/such/file.csv"], "not found"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = fedlora_run(tmp_path, args=tuple(args), timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_unreadable_data_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    proc = fedlora_run(tmp_path / "o", f"data.source={bad}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1


def test_a_classifier_checkpoint_with_another_head_size_loads_with_a_fresh_head(tmp_path: Path, caplog) -> None:
    import logging

    from transformers import BertConfig, BertForSequenceClassification

    from fedlora.backbones import TINY_BERT, load_tokenizer
    from fedlora.config import ModelConfig
    from fedlora.models import build_model

    # Prepare: a fine-tuned 2-label classifier checkpoint (tiny BERT, MiniLM's tokenizer)
    config = BertConfig(vocab_size=load_tokenizer("tiny-bert").vocab_size, **TINY_BERT)
    config.num_labels = 2
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    load_tokenizer("tiny-bert").save_pretrained(tmp_path)
    # Execute: an 8-topic task on it
    with caplog.at_level(logging.INFO, logger="fedlora.backbones"):
        model = build_model(ModelConfig(path=str(tmp_path), lora_rank=2), num_labels=8, rank=2)
    # Assert: loaded, with an 8-way head, and one line says so
    assert model.base_model.model.classifier.modules_to_save["default"].out_features == 8
    assert sum("the head is new" in r.getMessage() for r in caplog.records) == 1


def test_wire_bytes_are_the_serialised_messages_of_the_run(tmp_path: Path) -> None:
    from flwr.common.serde import message_to_proto

    from fedlora.app.server import run_server
    from fedlora.clients.app import app as client_app
    from fedlora.simulations.inprocess import InProcessGrid, node_configs

    # Prepare: an engine that serialises every message it carries, as a gRPC transport would
    sent: dict[tuple[int, str], int] = {}

    class SerialisingGrid(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            replies = list(super().send_and_receive(messages, timeout=timeout))
            if messages and messages[0].metadata.message_type != "query":
                server_round = int(messages[0].content.config_records["config"]["server-round"])
                for message in messages + replies:
                    kind = "eval" if message.metadata.message_type == "evaluate" else (
                        "down" if any(message is m for m in messages) else "up")
                    key = (server_round, kind)
                    sent[key] = sent.get(key, 0) + len(message_to_proto(message).SerializeToString())
            return replies

    config = load_config(ROOT / "configs/smoke.toml", ["faults.corrupt_rate=0.5", "faults.seed=3"])
    # Execute: a run where some uploads are malformed and rejected (their bytes still crossed the wire)
    writer = run_server(SerialisingGrid(client_app, node_configs(3)), config, tmp_path)
    # Assert: the ledger's wire figures are the serialised messages, within 1 %
    assert sum(r.rejected for r in writer.rounds) > 0
    for record in writer.rounds:
        for kind, value in (("down", record.wire_bytes_down), ("up", record.wire_bytes_up), ("eval", record.wire_bytes_eval)):
            assert value == pytest.approx(sent[(record.round, kind)], rel=0.01), (record.round, kind)
        assert record.wire_bytes_down > record.bytes_down  # arrays plus config, keys and metadata
