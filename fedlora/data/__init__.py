"""fedlora data layer: sources, federated partitioning (flwr-datasets) and label noise."""

from fedlora.data.federated import ClientData, FederatedData, build_federated_data
from fedlora.data.noise import NOISE_KINDS, apply_label_noise
from fedlora.data.sources import (
    LEXICOGRAPHER_FILES,
    WORDNET_TASKS,
    DataError,
    load_source,
    split_indices,
)

__all__ = [
    "LEXICOGRAPHER_FILES",
    "NOISE_KINDS",
    "WORDNET_TASKS",
    "ClientData",
    "DataError",
    "FederatedData",
    "apply_label_noise",
    "build_federated_data",
    "load_source",
    "split_indices",
]
