"""A silo's own data: a CSV / JSONL / JSON file or a ``datasets.save_to_disk`` folder.

In a deployment a silo points its SuperNode at its data with the node config
(``flower-supernode --node-config "partition-id=0 data-path='/data/silo.csv'"``) instead of
using a simulated partition of ``[data].source``. The file is read with the experiment's
``data.text_column`` / ``data.label_column`` and split into train / val / test with the
experiment's ``data.test_fraction`` / ``data.val_fraction``; the experiment's label noise
(``data.label_noise``, ``data.noise_rate``) is applied to the training labels, as in simulation.

The label set must be the server's: the model's classification head and the server's global test
set come from the experiment's ``[data].source``. In a deployment the server sends its class names
with every message (``label-names``), and :class:`SiloFederation` stands in for the simulated
federation: the silo never reads ``[data].source`` (nor WordNet) unless a method without a global
model asks it to evaluate on the global test set. A label in the silo's file must be one of those
class names, or an integer class id in ``[0, num_classes)``; anything else is a one-line
:class:`DataError`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import datasets
import numpy as np

from fedlora.data.federated import ClientData, FederatedData, build_federated_data, client_data
from fedlora.data.sources import DataError, label_features, read_local
from fedlora.schema import DataConfig


class SiloFederation:
    """The federation as a silo with its own data sees it: the server's label names; the simulated
    federation of ``[data].source`` (its global test set) only when asked for, read then."""

    def __init__(self, cfg: DataConfig, label_names: list[str]) -> None:
        self.cfg = cfg
        self.label_names = list(label_names)

    def _federation(self) -> FederatedData:
        try:
            return build_federated_data(self.cfg)
        except DataError as error:
            raise DataError(f"this silo trains on its own data, but the run asks it for the global test set of "
                            f"data.source {self.cfg.source!r}, which it cannot read: {error}") from None

    @property
    def global_test(self) -> datasets.Dataset:
        """The server's global test set (a method without a global model evaluates every client on it)."""
        return self._federation().global_test

    @property
    def clients(self) -> list[ClientData]:
        return self._federation().clients


def load_silo_data(path: str | Path, cfg: DataConfig, label_names: list[str], partition_id: int) -> ClientData:
    """The silo's data at ``path`` as this client's train / val / test (labels = ``label_names``)."""
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise DataError(f"node config data-path: {path} not found on this silo")
    mtime = path.stat().st_mtime_ns
    return _load_cached(str(path), mtime, cfg.model_dump_json(), tuple(label_names), partition_id)


@functools.lru_cache(maxsize=4)
def _load_cached(path: str, _mtime: int, cfg_json: str, label_names: tuple[str, ...], partition_id: int) -> ClientData:
    cfg = DataConfig.model_validate_json(cfg_json)
    where = f"data-path {path}"
    columns = read_local(Path(path), cfg.text_column, cfg.label_column, where)
    labels = encode_to_server_labels(columns.labels, columns.label_names, list(label_names), where)
    texts = ["" if text is None else str(text) for text in columns.texts]
    if len(texts) < 3:
        raise DataError(f"{where}: {len(texts)} examples; a silo needs at least 3 (train / val / test)")
    source = datasets.Dataset.from_dict({"text": texts, "label": labels}, features=label_features(list(label_names)))
    rows = np.arange(len(source))
    return client_data(partition_id, source, rows, np.asarray(labels, dtype=np.int64), cfg)


def encode_to_server_labels(raw: list[object], class_names: list[str] | None, label_names: list[str],
                            where: str) -> list[int]:
    """Map a silo's labels (class names, integer ids, or the ids of a ClassLabel column whose
    ``class_names`` are given) to the server's ids."""
    if class_names is not None:
        raw = [class_names[value] if isinstance(value, int) and 0 <= value < len(class_names) else value
               for value in raw]
    index = {name: i for i, name in enumerate(label_names)}
    encoded: list[int] = []
    unknown: set[str] = set()
    for value in raw:
        if isinstance(value, str) and value in index:
            encoded.append(index[value])
        elif isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < len(label_names):
            encoded.append(int(value))
        else:
            unknown.add(repr(value))
    if unknown:
        shown = ", ".join(sorted(unknown)[:5])
        raise DataError(
            f"{where}: labels {shown} are not in the server's label set {label_names} "
            f"(or ids 0..{len(label_names) - 1}); relabel the silo's data with those names"
        )
    return encoded
