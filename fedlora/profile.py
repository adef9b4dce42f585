"""What a client declares about itself: its partition, LoRA rank and resource budgets.

In simulation the profile comes from the experiment config (``[clients]``) by partition id; in a
deployment the silo's own node config (``flower-supernode --node-config "rank=4 ..."``)
overrides it. Either way the server learns profiles only from the clients (a query message before
the first training round), never from a config it could not have in a real deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from fedlora import protocol
from fedlora.schema import ClientsConfig, ExperimentConfig
from fedlora.secagg import MASK_GENERATOR
from fedlora.version import __version__

MAX_DECLARED = int(protocol.MAX_COUNT)  # any whole number a profile declares (10**12: no sum of them overflows)


class ClientProfile(BaseModel):
    """A client's self-description, sent in reply to the server's query. Every whole number is
    bounded by the protocol's maxima when the profile is read, before any arithmetic on it: a profile
    declaring 10**400 examples is refused in one line (strategies/roster.py), never an overflow later."""

    model_config = ConfigDict(extra="forbid")

    # Every whole number bounded by the protocol's maxima (|x| <= 10**12), at most 128 budgets: what
    # the values mean (a partition of this run, a rank the model can hold, a count >= 0, budgets positive
    # and finite) is the server's check of a profile it read (strategies/roster.py), naming the client
    partition_id: int = Field(ge=-MAX_DECLARED, le=MAX_DECLARED, description="Data partition this client holds (simulation).")
    rank: int = Field(ge=-MAX_DECLARED, le=MAX_DECLARED, description="LoRA rank this client trains.")
    num_train_examples: int = Field(
        0, ge=-MAX_DECLARED, le=MAX_DECLARED, description="Training examples held (aggregation weight), at most 10**12."
    )
    budgets: dict[Annotated[str, Field(max_length=protocol.MAX_METRIC_KEY_LENGTH)], float] = Field(
        default_factory=dict, max_length=protocol.MAX_METRIC_KEYS,
        description="Resource budgets (e.g. FedHera's download bytes / time / memory units).",
    )
    data_path: str = Field("", max_length=4096, description="Silo-local data folder/file, if not simulated.")
    fedlora_version: str = Field(
        "", max_length=64,
        description="The fedlora version the client runs; the server refuses a client whose version differs from its own."
    )
    secure_masks: str = Field(
        "", max_length=64,
        description="The mask generator of the client's secure-aggregation mod (fedlora.secagg.MASK_GENERATOR); "
        "a secure federation refuses a client that declares another (Flower's own mod seeds its masks with 32 "
        "bits of the key).",
    )
    flower_version: str = Field(
        "", description="The Flower version the client runs ('' = not said); the server refuses another than its own."
    )
    capabilities: list[str] = Field(
        default_factory=list,
        description="What the client's ClientApp can do beyond training (fedlora.protocol.CAPABILITIES, e.g. "
        "'secure-aggregation'); a run that needs one refuses a client that does not declare it.",
    )


def tier_ranks(tiers: Mapping[str, float], num_clients: int) -> list[int]:
    """Ranks for clients 0..n-1 from {rank: share}, largest-remainder rounding, in client order."""
    ordered = sorted(((int(rank), share) for rank, share in tiers.items()), key=lambda t: t[0])
    exact = [share * num_clients for _, share in ordered]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: num_clients - sum(counts)]:
        counts[i] += 1
    return [rank for (rank, _), count in zip(ordered, counts) for _ in range(count)]


def largest_remainder_counts(shares: list[float], num_clients: int) -> list[int]:
    """How many of ``num_clients`` each share gets (largest remainder rounding)."""
    exact = [share * num_clients for share in shares]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: num_clients - sum(counts)]:
        counts[i] += 1
    return counts


def configured_budgets(clients: ClientsConfig, partition_id: int, num_clients: int) -> dict[str, float]:
    """The budgets ``clients.budget_tiers`` give client ``partition_id`` (tiers in listed order)."""
    if not clients.budget_tiers:
        return {}
    counts = largest_remainder_counts([tier.share for tier in clients.budget_tiers], num_clients)
    tiers = [tier for tier, count in zip(clients.budget_tiers, counts) for _ in range(count)]
    return tiers[partition_id].budgets()


def configured_rank(clients: ClientsConfig, default_rank: int, partition_id: int, num_clients: int) -> int:
    """The rank the experiment config gives client ``partition_id``."""
    if clients.ranks:
        return clients.ranks[partition_id]
    if clients.rank_tiers:
        return tier_ranks(clients.rank_tiers, num_clients)[partition_id]
    return default_rank


def _number(value: Any) -> float:
    return float(value) if not isinstance(value, str) else float(value.strip())


def resolve_profile(config: ExperimentConfig, node_config: Mapping[str, Any]) -> ClientProfile:
    """Profile of this node: config defaults by partition id, overridden by the node config."""
    partition_id = int(node_config.get(protocol.NODE_PARTITION_ID, 0))
    num_clients = config.data.num_clients
    if not 0 <= partition_id < num_clients:
        raise ValueError(f"{protocol.NODE_PARTITION_ID} {partition_id} outside [0, {num_clients})")
    rank = configured_rank(config.clients, config.model.lora_rank, partition_id, num_clients)
    if protocol.NODE_RANK in node_config:
        rank = int(_number(node_config[protocol.NODE_RANK]))
    budgets = configured_budgets(config.clients, partition_id, num_clients)
    budgets |= {
        key.removeprefix(protocol.NODE_BUDGET_PREFIX): _number(value)
        for key, value in node_config.items()
        if str(key).startswith(protocol.NODE_BUDGET_PREFIX)
    }
    return ClientProfile(
        partition_id=partition_id,
        rank=rank,
        budgets=budgets,
        data_path=str(node_config.get(protocol.NODE_DATA_PATH, "")),
        fedlora_version=__version__,
        secure_masks=MASK_GENERATOR,
    )
