"""A silo's own data (node config ``data-path``): file formats, label checks, the real ClientApp."""

from __future__ import annotations

import json
import re
from pathlib import Path

import datasets
import pytest

from fedlora.config import DataConfig, load_config
from fedlora.data import DataError, build_federated_data
from fedlora.data.silo import load_silo_data

CFG = DataConfig(max_examples=600, global_test_size=100, num_clients=3, label_noise="symmetric", noise_rate=0.2)
N_ROWS = 60


def server_labels() -> list[str]:
    return build_federated_data(CFG).label_names


def rows(labels: list[str]) -> list[dict[str, object]]:
    """``N_ROWS`` examples cycling over ``labels`` (text names its label, so it is learnable)."""
    return [{"text": f"an example about {labels[i % len(labels)]} number {i}", "label": labels[i % len(labels)]}
            for i in range(N_ROWS)]  # fmt: skip


def write_csv(path: Path, data: list[dict[str, object]]) -> Path:
    path = path / "silo.csv"
    path.write_text("text,label\n" + "".join(f'"{r["text"]}",{r["label"]}\n' for r in data), encoding="utf-8")
    return path


def write_jsonl(path: Path, data: list[dict[str, object]]) -> Path:
    path = path / "silo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return path


def write_saved(path: Path, data: list[dict[str, object]]) -> Path:
    path = path / "silo_dataset"
    datasets.Dataset.from_list(data).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("writer", [write_csv, write_jsonl, write_saved], ids=["csv", "jsonl", "save_to_disk"])
def test_silo_file_becomes_client_splits_with_server_labels(tmp_path: Path, writer) -> None:
    # Prepare: a silo file whose labels are the server's class names
    names = server_labels()
    path = writer(tmp_path, rows(names))

    # Execute
    data = load_silo_data(path, CFG, names, partition_id=1)

    # Assert: every row in exactly one split, the server's label set, fractions and noise applied
    assert len(data.train) + len(data.val) + len(data.test) == N_ROWS
    assert len(data.test) == round(CFG.test_fraction * N_ROWS)
    assert len(data.val) == round(CFG.val_fraction * N_ROWS)
    for split in (data.train, data.val, data.test):
        assert split.features["label"].names == names
    assert 0.0 < data.realised_noise_rate < 0.5  # the experiment's symmetric noise, train only
    assert data.train["clean_label"][:] != data.train["label"][:]


def test_integer_label_ids_are_accepted(tmp_path: Path) -> None:
    # Prepare: ids instead of names
    names = server_labels()
    data = [{"text": f"text {i}", "label": i % len(names)} for i in range(N_ROWS)]

    # Execute
    client = load_silo_data(write_jsonl(tmp_path, data), CFG, names, partition_id=0)

    # Assert
    assert sorted(set(client.test["label"][:]) | set(client.train["clean_label"][:])) == list(range(len(names)))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"text": "x", "label": "not-a-server-class"}] * 10, "not in the server's label set"),
        ([{"text": "x", "label": 99}] * 10, "not in the server's label set"),
        ([{"body": "x", "label": "a"}] * 10, "column 'text' (data.text_column) not found"),
        ([{"text": "x", "label": 0}] * 2, "at least 3"),
    ],
    ids=["unknown-name", "id-out-of-range", "missing-text-column", "too-small"],
)
def test_bad_silo_data_is_one_line_error(tmp_path: Path, content: list[dict[str, object]], message: str) -> None:
    # Prepare
    path = write_jsonl(tmp_path, content)

    # Execute / Assert
    with pytest.raises(DataError, match=re.escape(message)) as error:
        load_silo_data(path, CFG, server_labels(), partition_id=0)
    assert "\n" not in str(error.value)


def test_missing_data_path_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="not found on this silo"):
        load_silo_data(tmp_path / "nope.csv", CFG, server_labels(), partition_id=0)


@pytest.mark.e2e
def test_clientapp_trains_on_a_silo_data_path(tmp_path: Path) -> None:
    # Prepare: the smoke experiment; client 2 declares its own data file in its node config
    from fedlora.app.runner import run_inprocess
    from fedlora.simulations.inprocess import node_configs

    config = load_config("configs/smoke.toml", ["train.rounds=1"])
    names = build_federated_data(config.data).label_names
    silo = write_csv(tmp_path, rows(names))
    configs = node_configs(config.data.num_clients)
    configs[2] = {**configs[2], "data-path": str(silo)}

    # Execute
    writer = run_inprocess(config, tmp_path / "run", configs)

    # Assert: the silo trained on its N_ROWS examples (train split) and its profile says where they are
    results = writer.to_dict()
    profile = results["strategy_info"]["clients"]["2"]
    assert profile["data_path"] == str(silo)
    assert profile["num_train_examples"] == N_ROWS - round(0.2 * N_ROWS) - round(0.1 * N_ROWS)
    assert results["rounds"][0]["clients"] == 3
    assert "import-seconds" in results["rounds"][0]["per_client"]["2"]
