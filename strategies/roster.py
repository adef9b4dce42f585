"""Who takes part: the clients' profiles by partition id, their node ids, refusals and ranks.

The server learns profiles only from the clients (a query message before the first training
round), never from a config it could not have in a real deployment. Everything a strategy keeps
per client is keyed by partition id; node ids (random per run) appear only here, where messages
are addressed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from logging import INFO, WARNING, getLogger
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedlora import protocol
from fedlora.profile import ClientProfile
from fedlora.version import __version__

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


class NoClientError(RuntimeError):
    """No client could take part (every profile refused, or every query failed)."""


class MixedRanksError(RuntimeError):
    """A same-rank method with mixed declared ranks under ``clients.mixed_rank_policy = refuse``."""


class MissingClientsError(RuntimeError):
    """Fewer SuperNodes than clients (``data.num_clients``) connected within ``federation.connect_timeout``."""


class PreflightError(RuntimeError):
    """A deployment's silo cannot take part (another fedlora or Flower, unreadable data, a client the
    strategy cannot use): the run is refused before its first round, one line per silo."""


def missing_clients_line(expected: int, connected: int, waited: float) -> str:
    """One line: how many SuperNodes the experiment needs, how many came, and how to set them."""
    return (f"the experiment needs {expected} SuperNodes, one per client (data.num_clients = {expected}); "
            f"{connected} connected within {waited:g} s (federation.connect_timeout). Flower's local simulation: add "
            f"--federation-config \"num-supernodes={expected}\" to flwr run (or once: flwr federation "
            f"simulation-config --num-supernodes {expected}); a deployment: start the missing SuperNodes")


def wait_for_nodes(grid: Grid, expected: int, timeout: float) -> list[int]:
    """The connected node ids once ``expected`` nodes are connected, polling every second for up to
    ``timeout`` s (a line when the count changes); :class:`MissingClientsError` if fewer came."""
    started = time.monotonic()
    shown = -1
    while len(node_ids := list(grid.get_node_ids())) < expected:
        waited = time.monotonic() - started
        if waited >= timeout:
            raise MissingClientsError(missing_clients_line(expected, len(node_ids), timeout))
        if len(node_ids) != shown:
            log(INFO, "query: waiting for clients, %d of %d connected (up to %g s)", len(node_ids), expected, timeout)
            shown = len(node_ids)
        time.sleep(min(1.0, max(0.0, timeout - waited)))
    return node_ids


class ClientRoster:
    """The accepted clients (partition id -> profile, node id) and the refused ones.

    Which partition a node holds: with a binding (:meth:`bind`: node id -> partition, set by whoever
    knows the nodes' identities: a deployment's operator from the keys the SuperLink authenticates,
    the in-process engine from the node configs it wrote) the binding's, and a node whose profile
    claims another partition, or that has none, is refused and logged; without one (Flower's own
    simulation engine, which writes every node config itself) the partition the profile names. Either
    way a second node claiming a partition already held is refused and logged.
    """

    def __init__(self) -> None:
        self.profiles: dict[int, ClientProfile] = {}  # partition id -> profile (accepted only)
        self.node_of: dict[int, int] = {}  # partition id -> node id (this run)
        self.refused: dict[str, str] = {}  # "partition <k>" or "node <n>" -> reason
        self.refused_partitions: list[int] = []
        self.seen_nodes: set[int] = set()  # every node id asked for its profile
        self._partition_of: dict[int, int] = {}  # node id -> partition id (the reverse of node_of)
        self.bound: dict[int, int] = {}  # node id -> the partition its identity holds (empty: no binding)
        self.names: dict[int, str] = {}  # node id -> the silo's name (a deployment's operator names them)
        self.strict = False  # a deployment: a silo that cannot take part refuses the run (PreflightError)
        self.announce: dict[str, Any] = {}  # entries every query carries beside the experiment
        self.preflight: list[str] = []  # this query's lines about silos that cannot take part
        self.binding_source: Callable[[], Mapping[int, int]] | None = None  # the engine's binding, read again

    def bind(self, partitions: Mapping[int, int], names: Mapping[int, str] | None = None,
             strict: bool = False, source: Callable[[], Mapping[int, int]] | None = None) -> None:
        """Bind node ids to partitions (``names``: the silos' names, for the lines); ``strict``:
        refuse the run when a bound silo cannot take part (:class:`PreflightError`); ``source``: where
        the binding comes from when it can change during the run (a simulation engine that restarts
        a node under a new id gives it its partition's node config: read again when new nodes join)."""
        self.bound = {int(node): int(partition) for node, partition in partitions.items()}
        self.binding_source = source
        self.names = {int(node): str(name) for node, name in (names or {}).items()}
        self.strict = strict

    def who(self, node_id: int) -> str:
        """``silo NAME (node N)`` where the operator named it, else ``node N``."""
        name = self.names.get(node_id)
        return f"silo {name} (node {node_id})" if name else f"node {node_id}"

    def __bool__(self) -> bool:
        return bool(self.profiles)

    @property
    def partitions(self) -> list[int]:
        """Accepted partition ids, sorted."""
        return sorted(self.profiles)

    def partition_of(self, node_id: int) -> int:
        partition = self._partition_of.get(node_id)
        if partition is None or self.node_of.get(partition) != node_id:  # node_of changed: rebuild the reverse map
            self._partition_of = {node: partition for partition, node in self.node_of.items()}
            partition = self._partition_of.get(node_id)
        if partition is None:
            raise KeyError(f"node {node_id} is not an accepted client")
        return partition

    def declared_examples(self, partition: int) -> int:
        """The training examples client ``partition`` declared when it joined (0: none declared)."""
        return self.profiles[partition].num_train_examples

    def rank(self, partition: int) -> int:
        return self.profiles[partition].rank

    def query(self, grid: Grid, experiment_json: str, expected: int, timeout: float,
              check_profile: Callable[[ClientProfile], str], connect_timeout: float) -> None:
        """Wait for ``expected`` nodes (up to ``connect_timeout`` s: :class:`MissingClientsError`
        with fewer), ask each for its profile (replies within ``timeout`` s), keep the ones
        ``check_profile`` accepts ('' = accepted)."""
        node_ids = wait_for_nodes(grid, expected, connect_timeout)
        self.preflight = []
        for reply in self._ask(grid, node_ids, experiment_json, timeout):
            node_id = reply.metadata.src_node_id
            profile = read_profile(reply)
            if isinstance(profile, str):
                self._refuse_node(node_id, profile, preflight=True)
                continue
            claim = self.claim_problem(node_id, profile.partition_id)
            if claim:
                self._refuse_node(node_id, claim)
                continue
            problem = version_problem(profile) or check_profile(profile)
            if problem:
                self.refused[f"partition {profile.partition_id}"] = f"{profile.partition_id}: {problem}"
                self.refused_partitions.append(profile.partition_id)
                log(WARNING, "query: refusing client %d: %s", profile.partition_id, problem)
                self.preflight.append(f"{self.who(node_id)}, partition {profile.partition_id}: {problem}")
                continue
            self.profiles[profile.partition_id] = profile
            self.node_of[profile.partition_id] = node_id
        if self.strict and self.preflight:
            raise PreflightError("; ".join(self.preflight))
        if not self.profiles:
            raise NoClientError("no client accepted: " + "; ".join(self.refused.values()))

    def claim_problem(self, node_id: int, claimed: int) -> str:
        """Why ``node_id`` may not hold the partition its profile claims ('' = it may): the partition
        its identity is bound to is another (or it has none), or another node holds it already."""
        if self.bound:
            bound = self.bound.get(node_id)
            if bound is None:
                return f"claims partition {claimed}, but no partition is bound to its identity (not a silo of this federation)"
            if bound != claimed:
                return f"claims partition {claimed}, but its identity is bound to partition {bound}"
        if claimed in self.profiles:  # a second node claiming a partition: the first keeps it
            return f"claims partition {claimed}, already held by node {self.node_of[claimed]}"
        return ""

    def _refuse_node(self, node_id: int, reason: str, preflight: bool = False) -> None:
        self.refused[f"node {node_id}"] = reason
        log(WARNING, "query: %s: %s", self.who(node_id), reason)
        if preflight:
            self.preflight.append(f"{self.who(node_id)}: {reason}")

    def refresh(self, grid: Grid, experiment_json: str, timeout: float) -> list[int]:
        """Ask nodes that connected since the last query who they are; an accepted partition
        that comes back on a new node (a restarted SuperNode) is addressed there from now on, with
        the profile accepted at the start. A partition never seen before is refused (strategies
        set up their per-client state for the clients of the first query). Returns the partitions
        re-bound. Costs one ``get_node_ids`` call when nobody new connected."""
        new = [n for n in grid.get_node_ids() if n not in self.seen_nodes]
        if new and self.binding_source is not None:
            self.bound = {int(node): int(partition) for node, partition in self.binding_source().items()}
        rebound = []
        for reply in self._ask(grid, new, experiment_json, timeout) if new else []:
            node_id = reply.metadata.src_node_id
            profile = read_profile(reply)
            if isinstance(profile, str):
                log(WARNING, "query: new node %d: %s", node_id, profile)
                continue
            partition = profile.partition_id
            if self.bound and self.bound.get(node_id) != partition:  # not the identity of that partition
                self._refuse_node(node_id, self.claim_problem(node_id, partition))
                continue
            if partition in self.profiles:
                log(INFO, "query: client %d is back, as node %d (was %d)", partition, node_id, self.node_of[partition])
                self.node_of[partition] = node_id
                rebound.append(partition)
            elif f"partition {partition}" not in self.refused:
                self.refused[f"partition {partition}"] = f"{partition}: joined after the first round"
                self.refused_partitions.append(partition)
                log(WARNING, "query: refusing client %d: it joined after the first round", partition)
        return rebound

    def _ask(self, grid: Grid, node_ids: list[int], experiment_json: str, timeout: float) -> list[Message]:
        """One QUERY message per node (carrying the experiment); the replies."""
        self.seen_nodes.update(node_ids)
        entries = {**self.announce, protocol.EXPERIMENT: experiment_json}
        queries = [
            Message(content=RecordDict({protocol.CONFIG_RECORD: ConfigRecord(entries)}),
                    dst_node_id=node_id, message_type=MessageType.QUERY)
            for node_id in node_ids
        ]
        return list(grid.send_and_receive(queries, timeout=timeout))

    def settle_common_rank(self, refuse: bool, method_name: str) -> int:
        """One rank for a same-rank method: the smallest declared rank (never above a client's
        own budget), or :class:`MixedRanksError` with ``refuse``. Returns 0 when ranks agree."""
        ranks = sorted({p.rank for p in self.profiles.values()})
        if len(ranks) < 2:
            return 0
        if refuse:
            raise MixedRanksError(
                f"strategy '{method_name}' needs one LoRA rank for every client, clients declared "
                f"{ranks}; use flexlora, hetlora, flora or fedhera, or clients.mixed_rank_policy=smallest"
            )
        for profile in self.profiles.values():
            profile.rank = ranks[0]
        log(WARNING, "query: '%s' needs one rank, clients declared %s: every client trains at rank %d "
            "(clients.mixed_rank_policy=smallest)", method_name, ranks, ranks[0])
        return ranks[0]


def profile_problem(profile: ClientProfile, module_shapes: Mapping[str, tuple[int, int]], num_clients: int,
                    secure: bool = False) -> str:
    """Why a client cannot take part ('' if it can): its partition outside ``[0, num_clients)``,
    a rank the adapted modules cannot hold, a negative example count, budgets that are not
    positive finite numbers, or (``secure``: a run with secure aggregation) a client that does not
    declare it can mask its update (``secure-aggregation`` in its profile's capabilities)."""
    max_rank = min(min(shape) for shape in module_shapes.values())
    if secure and protocol.SECURE_AGGREGATION not in profile.capabilities:
        return ("its client cannot take part in secure aggregation (its profile does not declare "
                f"'{protocol.SECURE_AGGREGATION}'): run fedlora's ClientApp there, or turn secure_aggregation.enabled off")
    if not 0 <= profile.partition_id < num_clients:
        return f"partition {profile.partition_id} outside [0, {num_clients}) (data.num_clients)"
    if not 1 <= profile.rank <= max_rank:
        return f"unsupported rank {profile.rank} (must be in [1, {max_rank}] for this model)"
    if profile.num_train_examples < 0:
        return f"negative num_train_examples {profile.num_train_examples}"
    bad = sorted(key for key, value in profile.budgets.items() if not (math.isfinite(value) and value > 0))
    if bad:
        return f"budgets {bad[:3]} are not positive finite numbers"
    return ""


def version_problem(profile: ClientProfile) -> str:
    """Why a client running another fedlora or Flower version cannot take part ('' = the server's
    versions): the server and every client must run the same installed fedlora (the FAB carries no
    code) on the same Flower. A profile that does not name its Flower (an older fedlora) is
    checked on fedlora alone."""
    if profile.fedlora_version != __version__:
        runs = f"runs fedlora {profile.fedlora_version}" if profile.fedlora_version else "does not say which fedlora it runs"
        return f"it {runs}, this server runs fedlora {__version__}: install the same fedlora on every node"
    flower = flower_version()
    if profile.flower_version and profile.flower_version != flower:
        return (f"it runs Flower {profile.flower_version}, this server runs Flower {flower}: install the same "
                "Flower on every node (make install installs the lock's)")
    return ""


def flower_version() -> str:
    """The installed Flower's version."""
    from importlib.metadata import version

    return version("flwr")


def read_profile(reply: Message) -> ClientProfile | str:
    """The profile a query reply carries, or why there is none (an error reply, a missing record,
    JSON that is not a profile): never an exception, whatever the node sent."""
    if reply.has_error():
        return f"query failed: {' '.join(str(reply.error.reason).split())[:300]}"
    record = reply.content.config_records.get(protocol.PROFILE_RECORD)
    text = record.get(protocol.PROFILE_JSON) if record is not None else None
    if not isinstance(text, str):
        return "its query reply carries no profile"
    try:
        return ClientProfile.model_validate_json(text)
    except ValueError as error:  # pydantic's ValidationError is a ValueError
        return f"its profile is not valid: {' '.join(str(error).split())[:300]}"
