"""Federated data: a held-out global test set plus one train / val / test split per client.

``build_federated_data`` loads the source, carves a stratified ``global_test`` that no client
trains on, and partitions the rest with a flwr-datasets partitioner (IID, Dirichlet label skew,
pathological k-classes-per-client, or grouped: client groups with disjoint class blocks and
Dirichlet skew within a group). That partition index (the source rows of every client) is all an
idle client costs: a client's train / val / test split (same label mix) and its datasets, with
label noise injected into its *training* labels only, are built when that client is first asked
for (:meth:`FederatedData.client`), in the process that asks, and each client's build depends on
its own rows and seed only, so the order in which clients are asked does not matter.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
import warnings
from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow as pa
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    PathologicalPartitioner,
)

from fedlora.data.instructions import load_instructions
from fedlora.data.noise import apply_label_noise
from fedlora.data.sources import DataError, load_source, split_indices
from fedlora.schema import DataConfig, is_instruction_data

logger = logging.getLogger(__name__)


@dataclass
class ClientData:
    """One client's data; only ``train`` labels may be noisy."""

    partition_id: int
    train: datasets.Dataset  # text, label (possibly noisy), clean_label, is_noisy
    val: datasets.Dataset  # text, label (clean)
    test: datasets.Dataset  # text, label (clean): local personalised test split
    realised_noise_rate: float


class FederatedData:
    """Every client's data plus the global test set (clean labels, disjoint from every client).

    Holds the source, the global test set and the partition index (each client's source rows);
    a client's datasets are built on first use (:meth:`client`) and the most recent
    :attr:`CACHED_CLIENTS` are kept, so a process that serves a few clients of a large federation
    never builds the others.
    """

    CACHED_CLIENTS = 64  # built clients kept per process (a rebuilt client is identical)

    def __init__(self, cfg: DataConfig, source: datasets.Dataset, labels: np.ndarray,
                 client_rows: list[np.ndarray], global_test: datasets.Dataset) -> None:
        self.cfg = cfg
        self.label_names: list[str] = list(source.features["label"].names)
        self.global_test = global_test
        self._source = source
        self._labels = labels
        self._rows = client_rows  # partition index: client -> its source rows
        self._cache: collections.OrderedDict[int, ClientData] = collections.OrderedDict()
        self._all: list[ClientData] | None = None
        self.built: set[int] = set()  # clients whose datasets this process has built

    @property
    def num_clients(self) -> int:
        return len(self._rows)

    def _check(self, partition_id: int) -> None:
        if not 0 <= partition_id < self.num_clients:
            raise DataError(
                f"partition_id must be in [0, {self.num_clients}) for data.num_clients="
                f"{self.num_clients}, got {partition_id}"
            )

    def client(self, partition_id: int) -> ClientData:
        """The data of client ``partition_id`` (0-based), built on first use."""
        self._check(partition_id)
        if self._all is not None:
            return self._all[partition_id]
        if partition_id in self._cache:
            self._cache.move_to_end(partition_id)
            return self._cache[partition_id]
        data = client_data(partition_id, self._source, self._rows[partition_id], self._labels, self.cfg)
        if self.cfg.shuffle_test_labels:
            data = dataclasses.replace(data, test=_shuffle_labels(data.test, self.cfg.seed + 1 + partition_id))
        self.built.add(partition_id)
        self._cache[partition_id] = data
        while len(self._cache) > self.CACHED_CLIENTS:
            self._cache.popitem(last=False)
        return data

    def num_train_examples(self, partition_id: int) -> int:
        """``len(client(partition_id).train)``, from the partition index alone (nothing is built)."""
        self._check(partition_id)
        n = len(self._rows[partition_id])
        n_test, n_val = split_sizes(n, self.cfg)
        return n - n_test - n_val

    @property
    def clients(self) -> list[ClientData]:
        """Every client's data (builds and keeps them all: statistics, plots, the pooled reference)."""
        if self._all is None:
            self._all = [self.client(k) for k in range(self.num_clients)]
            self._cache.clear()
        return self._all

    def partitions(self) -> ClientPartitions:
        """The clients' training splits as a flwr-datasets Partitioner (for its statistics and plots)."""
        return ClientPartitions(self)

    def label_counts(self) -> np.ndarray:
        """(num_clients, num_classes) counts of clean training labels (flwr-datasets' compute_counts)."""
        from flwr_datasets.metrics import compute_counts

        return np.asarray(compute_counts(self.partitions(), "clean_label").to_numpy())


class ClientPartitions(Partitioner):  # type: ignore[misc]  # flwr-datasets ships no type information
    """A fedlora federation's client training splits seen as a flwr-datasets Partitioner.

    fedlora's partitions come from flwr-datasets partitioners (or, for ``grouped``, from one per
    group), so this adapter only hands the finished splits back to flwr-datasets' tools
    (``flwr_datasets.metrics.compute_counts``, ``flwr_datasets.visualization.plot_label_distributions``).
    Its ``dataset`` is the clients' training splits concatenated, in client order.
    """

    def __init__(self, federated: FederatedData) -> None:
        super().__init__()
        self._clients = federated.clients  # builds every client
        self.dataset = datasets.concatenate_datasets([c.train for c in self._clients])

    @property
    def num_partitions(self) -> int:
        return len(self._clients)

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        return self._clients[partition_id].train


def build_federated_data(cfg: DataConfig) -> FederatedData:
    """Build (or fetch from the in-process cache) the federated data described by ``cfg``.

    The result is shared by every caller in the process: derive new datasets from it
    (``with_format``, ``map``, ``select``), never change it in place (``set_format``).
    """
    return _build_cached(cfg.model_dump_json())


@functools.lru_cache(maxsize=8)
def _build_cached(config_json: str) -> FederatedData:
    started = time.perf_counter()
    cfg = DataConfig.model_validate_json(config_json)
    source = load_instructions(cfg) if is_instruction_data(cfg) else load_source(cfg)
    source = _flat(source)
    labels = np.asarray(source["label"][:], dtype=np.int64)
    pool_rows, global_test_rows = _hold_out_global_test(labels, cfg)
    client_rows = [pool_rows[rows] for rows in _partition(labels[pool_rows], cfg)]
    for partition_id, rows in enumerate(client_rows):  # fail now, not when the client is first asked
        n_test, n_val = split_sizes(len(rows), cfg)
        if len(rows) - n_test - n_val <= 0:
            raise _empty_train(partition_id, len(rows))
    logger.info(
        "build_federated_data: %d clients (%s), pool %d, global test %d, %.2f s",
        len(client_rows),
        cfg.partition,
        len(pool_rows),
        len(global_test_rows),
        time.perf_counter() - started,
    )
    global_test = source.select(np.sort(global_test_rows))
    if cfg.shuffle_test_labels:
        global_test = _shuffle_labels(global_test, cfg.seed)
    return FederatedData(cfg, source, labels, client_rows, global_test)


def _shuffle_labels(split: datasets.Dataset, seed: int) -> datasets.Dataset:
    """The split with its labels permuted (audit of model selection: test scores become noise)."""
    permuted = np.random.default_rng(seed).permutation(np.asarray(split["label"][:], dtype=np.int64))
    return split.map(lambda _, i: {"label": int(permuted[i])}, with_indices=True)


def _hold_out_global_test(labels: np.ndarray, cfg: DataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Source rows of (training pool, stratified global test of ``cfg.global_test_size``)."""
    if cfg.global_test_size >= len(labels):
        raise DataError(
            f"data.global_test_size ({cfg.global_test_size}) must be smaller than the "
            f"{len(labels)} examples of '{cfg.source}'; lower it or raise data.max_examples"
        )
    # The pool rows come back shuffled: IidPartitioner takes contiguous shards, and the sources
    # are ordered (WordNet by synset offset), so the pool must not keep the source order.
    return split_indices(labels, cfg.global_test_size, cfg.seed)


def _make_partitioner(cfg: DataConfig, pool_size: int) -> Partitioner:
    if cfg.partition == "iid":
        return IidPartitioner(num_partitions=cfg.num_clients)
    if cfg.partition == "dirichlet":
        # flwr-datasets resamples until every partition has min_partition_size examples (10
        # tries): keep that reachable on tiny pools.
        min_size = min(10, pool_size // (2 * cfg.num_clients))
        return DirichletPartitioner(
            num_partitions=cfg.num_clients,
            partition_by="label",
            alpha=cfg.dirichlet_alpha,
            min_partition_size=min_size,
            self_balancing=False,
            seed=cfg.seed,
        )
    # 'deterministic': client i gets classes i, i+1, ... (mod C), so classes are evenly covered.
    return PathologicalPartitioner(
        num_partitions=cfg.num_clients,
        partition_by="label",
        num_classes_per_partition=cfg.classes_per_client,
        class_assignment_mode="deterministic",
        seed=cfg.seed,
    )


def _partition(pool_labels: np.ndarray, cfg: DataConfig) -> list[np.ndarray]:
    """Positions in the pool of each client's examples, from the configured partitioner.

    The partitioner sees a (label, row) table in "arrow" format: flwr-datasets runs
    ``np.array(dataset["label"])``, which on a datasets 4.x lazy column iterates row by row
    (~4 s for 55k rows); an arrow column converts at once.
    """
    where = f"cannot split {len(pool_labels)} examples into data.num_clients={cfg.num_clients}"
    if cfg.num_clients > len(pool_labels):
        raise DataError(f"{where}: lower data.num_clients or raise data.max_examples")
    if cfg.partition == "grouped":
        return _grouped_partition(pool_labels, cfg)
    return _load_partitions(_make_partitioner(cfg, len(pool_labels)), pool_labels, cfg, where)


def _load_partitions(partitioner: Partitioner, labels: np.ndarray, cfg: DataConfig, where: str) -> list[np.ndarray]:
    """Positions in ``labels`` of every partition of ``partitioner``."""
    int64 = datasets.Value("int64")
    index = datasets.Dataset.from_dict(
        {"label": labels, "row": np.arange(len(labels))},
        features=datasets.Features({"label": int64, "row": int64}),
    )
    partitioner.dataset = index.with_format("arrow")
    try:
        with warnings.catch_warnings():  # a Dirichlet draw short of min_partition_size is redrawn, as
            # it should be; flwr-datasets warns at each redraw (a failure still raises, below)
            warnings.filterwarnings("ignore", message="The specified min_partition_size", category=UserWarning)
            return [np.asarray(partitioner.load_partition(i)["row"]) for i in range(partitioner.num_partitions)]
    except (ValueError, IndexError) as error:
        message = " ".join(str(error).split())
        raise DataError(f"{where} with data.partition='{cfg.partition}': {message}") from None


def client_groups(cfg: DataConfig) -> dict[int, int] | None:
    """Partition id -> task group under ``data.partition = 'grouped'`` (contiguous groups of
    clients, as :func:`_grouped_partition` deals them); None for the other partitions."""
    if cfg.partition != "grouped":
        return None
    return {int(client): group for group, clients in enumerate(_group_members(cfg)) for client in clients}


def _group_members(cfg: DataConfig) -> list[np.ndarray]:
    return np.array_split(np.arange(cfg.num_clients), cfg.num_groups)


def _grouped_partition(pool_labels: np.ndarray, cfg: DataConfig) -> list[np.ndarray]:
    """'grouped': the classes are cut into ``num_groups`` contiguous disjoint blocks (sizes
    ``class_blocks``, or equal) and the clients into ``num_groups`` contiguous groups; group g's
    clients share the examples of class block g, split among them by a flwr-datasets Dirichlet
    partitioner (label skew)."""
    classes = np.unique(pool_labels)
    if not cfg.num_groups <= min(len(classes), cfg.num_clients):
        raise DataError(
            f"data.num_groups must be <= the {len(classes)} classes and data.num_clients="
            f"{cfg.num_clients}, got {cfg.num_groups}; lower data.num_groups"
        )
    class_blocks = _class_blocks(classes, cfg)
    members = _group_members(cfg)
    partitions: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * cfg.num_clients
    for group, (block, clients) in enumerate(zip(class_blocks, members)):
        rows = np.flatnonzero(np.isin(pool_labels, block))  # positions in the pool
        where = f"cannot split the {len(rows)} examples of group {group} among {len(clients)} clients"
        if len(clients) == 1:
            parts = [np.arange(len(rows))]
        else:
            partitioner = DirichletPartitioner(
                num_partitions=len(clients),
                partition_by="label",
                alpha=cfg.dirichlet_alpha,
                min_partition_size=min(10, len(rows) // (2 * len(clients))),
                self_balancing=False,
                seed=cfg.seed + group,
            )
            parts = _load_partitions(partitioner, pool_labels[rows], cfg, where)
        for client, part in zip(clients, parts):
            partitions[client] = rows[part]
    return partitions


def _class_blocks(classes: np.ndarray, cfg: DataConfig) -> list[np.ndarray]:
    """The classes cut into ``num_groups`` contiguous blocks: ``data.class_blocks`` sizes, or equal."""
    if not cfg.class_blocks:
        return np.array_split(classes, cfg.num_groups)
    if len(cfg.class_blocks) != cfg.num_groups or sum(cfg.class_blocks) != len(classes) or min(cfg.class_blocks) < 1:
        raise DataError(
            f"data.class_blocks must hold data.num_groups={cfg.num_groups} positive sizes that sum to the "
            f"{len(classes)} classes of the pool, got {cfg.class_blocks}"
        )
    return np.split(classes, np.cumsum(cfg.class_blocks)[:-1])


def split_sizes(n: int, cfg: DataConfig) -> tuple[int, int]:
    """(test, validation) examples of a client partition of ``n`` examples; the rest trains."""
    n_test = min(max(round(cfg.test_fraction * n), 0), n)
    return n_test, min(round(cfg.val_fraction * n), n - n_test)


def _empty_train(partition_id: int, n: int) -> DataError:
    return DataError(
        f"client {partition_id} has an empty train split ({n} examples in its "
        "partition): lower data.num_clients or raise data.max_examples"
    )


def client_data(
    partition_id: int,
    source: datasets.Dataset,
    rows: np.ndarray,
    labels: np.ndarray,
    cfg: DataConfig,
) -> ClientData:
    """Split one client's source ``rows`` into train / val / test (same label mix), add noise."""
    seed = cfg.seed + partition_id
    n_test, n_val = split_sizes(len(rows), cfg)
    rest, test = split_indices(labels[rows], n_test, seed)
    train, val = split_indices(labels[rows[rest]], n_val, seed)
    train_rows, val_rows = np.sort(rows[rest[train]]), np.sort(rows[rest[val]])
    test_rows = np.sort(rows[test])
    if len(train_rows) == 0:
        raise _empty_train(partition_id, len(rows))
    train_data, noise_rate = _noisy_train(_take(source, train_rows), cfg, seed)
    return ClientData(
        partition_id=partition_id,
        train=train_data,
        val=_take(source, val_rows),
        test=_take(source, test_rows),
        realised_noise_rate=noise_rate,
    )


def _take(source: datasets.Dataset, rows: np.ndarray) -> datasets.Dataset:
    """``source.select(rows)`` as a new in-memory table (Arrow's ``take``), with a random
    fingerprint. ``select`` adds an indices mapping and ``from_dict`` encodes every value in
    Python: together about 15 ms of a client's first use, which at 1,000 clients is paid by
    almost every sampled client (``benchmarks/scale.py``); this is the same table in about 1 ms."""
    return _dataset(_arrow(source).take(rows), source.features)


def _arrow(source: datasets.Dataset) -> pa.Table:
    """The rows of ``source`` as a plain Arrow table (its indices mapping applied)."""
    table = source.data.table
    if source._indices is not None:  # a select()ed source: gather its rows once
        table = table.take(source._indices.column(0))
    return table


def _flat(source: datasets.Dataset) -> datasets.Dataset:
    """``source`` as one table every client's splits are Arrow takes from (:func:`_take`): an
    in-memory source, or the rows a subsample selected, as one contiguous in-memory table (a
    ``select``ed source would otherwise gather its indices at every take); a memory-mapped source
    read whole (a hub dataset without ``max_examples``) stays memory-mapped, so memory stays what
    the run reads."""
    from datasets.table import InMemoryTable

    if source._indices is None and not isinstance(source.data, InMemoryTable):
        return source
    return _dataset(_arrow(source).combine_chunks(), source.features)


def _dataset(table: pa.Table, features: datasets.Features) -> datasets.Dataset:
    from datasets.fingerprint import generate_random_fingerprint
    from datasets.table import InMemoryTable

    return datasets.Dataset(
        InMemoryTable(table), info=datasets.DatasetInfo(features=features), fingerprint=generate_random_fingerprint()
    )


def _noisy_train(
    train: datasets.Dataset, cfg: DataConfig, seed: int
) -> tuple[datasets.Dataset, float]:
    """Replace ``label`` by its noisy version; keep ``clean_label`` and ``is_noisy`` (and every other
    column: ``text``, or an instruction's ``prompt`` and ``response``)."""
    label_feature = train.features["label"]
    clean = np.asarray(train["label"][:], dtype=np.int64)
    noisy, flipped = apply_label_noise(
        clean, cfg.label_noise, cfg.noise_rate, label_feature.num_classes, seed
    )
    others = [name for name in train.column_names if name != "label"]
    features = datasets.Features(
        {
            **{name: train.features[name] for name in others},
            "label": label_feature,
            "clean_label": label_feature,
            "is_noisy": datasets.Value("bool"),
        }
    )
    table = _arrow(train)
    columns = {**{name: table.column(name) for name in others}, "label": pa.array(noisy, pa.int64()),
               "clean_label": pa.array(clean, pa.int64()), "is_noisy": pa.array(flipped, pa.bool_())}
    return _dataset(pa.table(columns), features), float(flipped.mean())
