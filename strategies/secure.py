"""Secure aggregation on the server: Flower's SecAgg+ server stages, ported to the Message API.

Flower 1.39's ``SecAggPlusWorkflow`` runs the four stages of SecAgg+ as a legacy workflow that
replaces the round loop. :class:`SecureRound` is the same protocol (the same messages, keys and
checks, Flower's primitives for the key agreement, Shamir sharing and quantisation), driven by a
:class:`~fedlora.strategies.base.LoRAStrategy` round (``strategies/secure_round.py``):
``configure_train`` runs the setup and share-keys stages over the grid and returns the masking
stage's messages (fedlora's training messages plus the SecAgg+ record); ``aggregate_train`` sums
the masked vectors, runs the unmask stage and gets the weighted mean of the updates. The clients
run fedlora's port of Flower's client mod (``clients/secure.py``); the masks on both sides are
:func:`fedlora.secagg.mask` (ChaCha20 under the whole 256-bit key).

No client can stop a round: each stage checks each client's contribution on its own and goes on
with the others while every client still in the protocol keeps threshold-many neighbours.

- setup: both public keys must be SECP384R1 keys, different, and proven held
  (:func:`fedlora.secagg.check_possession`): a bad, copied or shared key names its sender;
- share keys: the encrypted shares must be addressed to exactly the sender's neighbours, one each,
  with a commitment to every share and to its mask seed: a wrong, missing or duplicate destination
  names its sender, who leaves the round before anyone masks with it;
- masking: the weight factor travels in the clear and must be the one of the client's declared
  examples (a tampered weight names its sender), the masked vector must be the right shape and
  range and never seen before (a replay of an earlier round's vector names its sender); such a
  client is treated as dropped out: its masks are removed with its key's shares. A client that
  cannot use a neighbour's shares says so (``secagg-complaints``: a dispute the server cannot
  settle, recorded); those shares are not asked for, and a client whose shares too many neighbours
  refuse cannot be unmasked: it is left out and named;
- unmask: each share is checked against its owner's commitment before use (a random, copied or
  duplicated share names its sender), any threshold-many valid shares reconstruct a secret, and
  the reconstruction is checked against the owner's seed commitment or public key.

Every client named (``culprits``) is left out of the rest of the run by the strategy
(``strategies/secure_round.py``). One change to Flower's server, kept from before: a client that
drops out during the setup or share-keys stage is not "dead" at the unmask stage (Flower 1.39 asks
the survivors for shares of its key they never received, and the round halts after every client
trained). Here the dead are the clients that shared their keys and sent no valid masked vector.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Mapping
from logging import WARNING, getLogger
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedlora import protocol, secagg
from fedlora.protocol import wire_size
from fedlora.secagg import SecAggParams, neighbours
from fedlora.strategies.accounting import reply_wire_size, short

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show
COMMITMENT_PAIR = 2 * secagg.DIGEST_BYTES  # a holder's seed-share and key-share commitments


class SecureRound:
    """One round of SecAgg+ between the server and the sampled clients (module docstring).

    Parameters
    ----------
    params : SecAggParams
        The round's parameters (:func:`fedlora.secagg.choose_params`).
    grid : Grid
        The grid the setup, share-keys and unmask stages are sent over.
    server_round : int
        The round (the messages' ``group_id``).
    weights : Mapping[int, float]
        Node id -> the aggregation weight the server chose for that sampled client (at most
        ``params.max_weight``); the clients check it against their own count and mask with it.
    counts : Mapping[int, int]
        Node id -> the training examples that client declared when it joined (sent to every client).
    weighting : str
        'examples' (the share rule on ``counts``) or 'uniform' (:func:`fedlora.secagg.weight_ratio`).
    size : int
        Entries of the vector every client masks (:func:`fedlora.secagg.canonical_shapes`).
    timeout : float, optional
        Seconds each stage waits for its replies (``federation.round_timeout``).
    max_share : float
        ``faults.max_client_share``, the share rule's bound.
    low_threshold : bool
        Whether the operator allowed a threshold at most half of the shares.
    history : set of str, optional
        Digests of the masked vectors of earlier rounds (a vector seen again is a replay).
    """

    def __init__(self, params: SecAggParams, grid: Grid, server_round: int, weights: Mapping[int, float],
                 counts: Mapping[int, int], weighting: str, size: int, timeout: float | None = None, *,
                 max_share: float = 1.0, low_threshold: bool = False, history: set[str] | None = None) -> None:
        self.params, self.grid, self.server_round, self.timeout = params, grid, server_round, timeout
        self.weights, self.counts, self.weighting, self.size = dict(weights), dict(counts), weighting, size
        self.max_share, self.low_threshold, self.history = max_share, low_threshold, history or set()
        self.sampled = frozenset(self.weights)
        nodes = sorted(self.counts)
        self.factors = {n: round(secagg.weight_ratio([self.counts[m] for m in nodes], i, max_share, weighting)
                                 * params.quantization_range)
                        for i, n in enumerate(nodes)}  # what each client's clear weight factor must be (as it computes it)
        ring = sorted(self.sampled)
        random.SystemRandom().shuffle(ring)  # Flower shuffles the ring too (the server picks it: no secret)
        self.neighbours = neighbours(ring, params.num_shares)
        server_sk, server_pk = generate_key_pairs()  # this round's key, for the clients' proofs of possession
        self.server_sk, self.server_pk = private_key_to_bytes(server_sk), public_key_to_bytes(server_pk)
        self.active: set[int] = set(self.sampled)  # nodes still in the protocol
        self.shared: set[int] = set()  # nodes whose encrypted shares were forwarded (share-keys stage done)
        self.summed: set[int] = set()  # nodes whose masked vector is in the sum
        self.public_keys: dict[int, tuple[bytes, bytes]] = {}
        self.ciphertexts: dict[int, dict[int, bytes]] = {}  # source -> destination -> its encrypted shares
        self.commitments: dict[int, dict[int, bytes]] = {}  # owner -> holder -> seed- and key-share commitments
        self.seed_commitments: dict[int, bytes] = {}
        self.complaints: dict[int, set[int]] = {}  # node -> the sources whose shares it could not use
        self.culprits: dict[int, str] = {}  # node -> what it did (left out of the rest of the run)
        self.total = np.zeros(size, np.int64)  # the sum of the summed masked vectors, mod M
        self.revealed: set[int] = set()  # dropped nodes whose pairwise keys their summed neighbours reveal
        self.failed = ""  # the stage that halted the round, and why
        self.report: dict[str, Any] = {"sampled": len(self.sampled), "num_shares": params.num_shares,
                                       "threshold": params.threshold, "mask_generator": secagg.MASK_GENERATOR,
                                       "wire_bytes": {}, "seconds": {}, "culprits": {}, "disputes": []}

    # ------------------------------------------------------------------ helpers
    def _exchange(self, stage: str, configs: Mapping[int, Mapping[str, Any]]) -> dict[int, ConfigRecord]:
        """Send each node its stage record and return the records of the replies that came and
        are not errors (the others leave :attr:`active`)."""
        started = time.perf_counter()
        messages = [Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage, **entries})}),
                            dst_node_id=node, message_type=MessageType.TRAIN, group_id=str(self.server_round))
                    for node, entries in configs.items()]
        sent = sum(wire_size(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=self.timeout))
        records: dict[int, ConfigRecord] = {}
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                log(WARNING, "secure aggregation, %s: node %d failed: %s", stage, node, short(reply.error.reason))
            elif node in configs and RECORD_KEY_CONFIGS in reply.content.config_records:
                records[node] = reply.content.config_records[RECORD_KEY_CONFIGS]
        self.active &= set(records)
        self.report["wire_bytes"][stage] = {"down": sent, "up": sum(reply_wire_size(r) for r in replies)}
        self.report["seconds"][stage] = time.perf_counter() - started
        self.report[f"after_{stage}"] = len(self.active)
        return records

    def _enough(self, stage: str) -> bool:
        """After a stage: every node still in the protocol keeps at least ``threshold`` active
        neighbours (itself included), else the round halts (Flower's check, over the nodes that
        are still in: a node that left before sharing its keys has no mask to remove)."""
        short_of = [n for n in self.active if len(self.neighbours[n] & self.active) < self.params.threshold]
        if short_of or not self.active:
            self.fail(stage, f"{len(short_of)} clients have fewer than {self.params.threshold} active neighbours "
                             f"({len(self.active)} of {len(self.sampled)} clients left)")
        return not short_of and bool(self.active)

    def fail(self, stage: str, reason: str) -> None:
        """Halt the round at ``stage`` (logged, and in the round's report; the first halt stays)."""
        if self.failed:
            return
        self.failed = f"{stage}: {reason}"
        self.report["failed_stage"] = self.failed
        log(WARNING, "secure aggregation halted, round %d, %s", self.server_round, self.failed)

    def blame(self, node: int, stage: str, what: str) -> None:
        """Name ``node`` as the sender of a contribution the protocol cannot use (``what``, at
        ``stage``): it leaves the protocol now, and the strategy leaves it out of the rest of the
        run. The first reason stays."""
        self.active.discard(node)
        if node in self.culprits:
            return
        self.culprits[node] = f"{stage}: {what}"
        self.report["culprits"][str(node)] = self.culprits[node]
        log(WARNING, "secure aggregation, round %d: node %d %s", self.server_round, node, self.culprits[node])

    # ------------------------------------------------------------------ stage 0: setup
    def setup(self) -> bool:
        """Send the parameters; keep each replying node's two public keys once they check out."""
        p = self.params
        nodes = sorted(self.sampled)
        entries = {Key.SAMPLE_NUMBER: p.sampled, Key.SHARE_NUMBER: p.num_shares, Key.THRESHOLD: p.threshold,
                   Key.CLIPPING_RANGE: float(p.clipping_range), Key.TARGET_RANGE: p.quantization_range,
                   Key.MOD_RANGE: p.modulus_range, Key.MAX_WEIGHT: float(p.max_weight),
                   protocol.SECAGG_GENERATOR: secagg.MASK_GENERATOR, protocol.SECAGG_SERVER_KEY: self.server_pk,
                   protocol.SECAGG_NODES: nodes, protocol.SECAGG_COUNTS: [int(self.counts[n]) for n in nodes],
                   protocol.SECAGG_MAX_SHARE: float(self.max_share), protocol.SECAGG_WEIGHTING: self.weighting,
                   protocol.SECAGG_LOW_THRESHOLD: self.low_threshold}
        holders: dict[bytes, list[int]] = {}
        for node, record in self._exchange(Stage.SETUP, {node: entries for node in nodes}).items():
            problem = self._keys_problem(node, record)
            if problem:
                self.blame(node, Stage.SETUP, problem)
                continue
            self.public_keys[node] = cast(tuple[bytes, bytes], (record[Key.PUBLIC_KEY_1], record[Key.PUBLIC_KEY_2]))
            for key in self.public_keys[node]:
                holders.setdefault(key, []).append(node)
        for key, nodes_of_key in holders.items():  # two nodes proving one key hold one private key: both named
            for node in nodes_of_key if len(nodes_of_key) > 1 else ():
                self.blame(node, Stage.SETUP, f"holds the same public key as node(s) {sorted(set(nodes_of_key) - {node})}")
        self.active &= set(self.public_keys) - set(self.culprits)
        return self._enough(Stage.SETUP)

    def _keys_problem(self, node: int, record: ConfigRecord) -> str:
        """Why ``node``'s public keys cannot be used ('' if they can)."""
        pk1, pk2 = record.get(Key.PUBLIC_KEY_1), record.get(Key.PUBLIC_KEY_2)
        problem = secagg.public_key_problem(pk1) or secagg.public_key_problem(pk2)
        if problem:
            return f"sent a public key that is {problem}"
        if pk1 == pk2:
            return "sent the same public key twice"
        try:
            proven = secagg.check_possession(node, cast(bytes, pk1), cast(bytes, pk2), record.get(protocol.SECAGG_PROOF),
                                             self.server_sk)
        except (ValueError, TypeError):
            proven = False
        return "" if proven else "sent public keys it cannot prove it holds (another client's, or made up)"

    # ------------------------------------------------------------------ stage 1: share keys
    def share_keys(self) -> bool:
        """Send each node its active neighbours' public keys; keep the encrypted shares and
        commitments of each node whose reply checks out (:meth:`_shares_problem`)."""
        keyed = set(self.active)
        configs = {node: {str(v): list(self.public_keys[v]) for v in self.neighbours[node] & keyed}
                   for node in sorted(keyed)}
        for src, record in self._exchange(Stage.SHARE_KEYS, configs).items():
            problem = self._shares_problem(src, record, self.neighbours[src] & keyed)
            if problem:
                self.blame(src, Stage.SHARE_KEYS, problem)
                continue
            dsts, ciphertexts = record[Key.DESTINATION_LIST], record[Key.CIPHERTEXT_LIST]
            self.ciphertexts[src] = dict(zip(cast(list[int], dsts), cast(list[bytes], ciphertexts), strict=True))
            holders, commitments = record[protocol.SECAGG_HOLDERS], record[protocol.SECAGG_COMMITMENTS]
            self.commitments[src] = dict(zip(cast(list[int], holders), cast(list[bytes], commitments), strict=True))
            self.seed_commitments[src] = cast(bytes, record[protocol.SECAGG_SEED_COMMITMENT])
        self.active &= set(self.ciphertexts)
        self.shared = set(self.active)
        return self._enough(Stage.SHARE_KEYS)

    @staticmethod
    def _shares_problem(src: int, record: ConfigRecord, keyed: set[int]) -> str:
        """Why ``src``'s share-keys reply cannot be used ('' if it can): its encrypted shares must go to
        exactly its neighbours that were sent keys (``keyed``, itself included), one each, each a
        ciphertext of bounded size, with a commitment for every holder and one for its seed."""
        dsts, ciphertexts = record.get(Key.DESTINATION_LIST), record.get(Key.CIPHERTEXT_LIST)
        holders, commitments = record.get(protocol.SECAGG_HOLDERS), record.get(protocol.SECAGG_COMMITMENTS)
        if not all(isinstance(v, list) for v in (dsts, ciphertexts, holders, commitments)):
            return "sent no lists of destinations, ciphertexts, holders and commitments"
        dsts, holders = cast(list[Any], dsts), cast(list[Any], holders)
        expected = sorted(keyed - {src})
        if any(isinstance(d, bool) or not isinstance(d, int) for d in dsts) or sorted(dsts) != expected:
            return (f"addressed its shares to {sorted(set(map(str, dsts)))[:6]}, not once to each of its neighbours "
                    f"{expected[:6]} (a wrong, missing or duplicate destination)")
        if len(cast(list[Any], ciphertexts)) != len(dsts) or not all(
                isinstance(c, bytes) and 0 < len(c) <= secagg.MAX_CIPHERTEXT_BYTES for c in cast(list[Any], ciphertexts)):
            return f"sent {len(cast(list[Any], ciphertexts))} ciphertexts for {len(dsts)} destinations, or one that is no ciphertext"
        if any(isinstance(h, bool) or not isinstance(h, int) for h in holders) or sorted(holders) != sorted(keyed):
            return "committed to shares for other holders than its neighbours"
        if len(cast(list[Any], commitments)) != len(holders) or not all(
                isinstance(c, bytes) and len(c) == COMMITMENT_PAIR for c in cast(list[Any], commitments)):
            return "sent commitments that are not one 64-byte pair per holder"
        seed = record.get(protocol.SECAGG_SEED_COMMITMENT)
        if not isinstance(seed, bytes) or len(seed) != secagg.DIGEST_BYTES:
            return "sent no commitment to its mask seed"
        return ""

    # ------------------------------------------------------------------ stage 2: collect masked vectors
    def masking_record(self, node: int) -> ConfigRecord | None:
        """The SecAgg+ record of the masking stage for ``node``: the shares of its active neighbours
        (whose replies checked out: both directions of every pair exist), their commitments for it,
        and its weight; None for a node that left the protocol (it is sent no training message)."""
        if node not in self.active:
            return None
        srcs = sorted((self.neighbours[node] & self.active) - {node})
        return ConfigRecord({Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                             Key.CIPHERTEXT_LIST: [self.ciphertexts[s][node] for s in srcs], Key.SOURCE_LIST: srcs,
                             protocol.SECAGG_COMMITMENTS: [self.commitments[s][node] for s in srcs],
                             protocol.SECAGG_WEIGHT: float(self.weights[node])})

    def masked_vector(self, node: int, reply: Message) -> tuple[np.ndarray, set[int]] | str:
        """The reply's masked entries (int64 in [0, M), ``size`` of them) and the sources it could
        not use the shares of, or what is wrong with the reply (its sender is then named)."""
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        raw = None if record is None else record.get(Key.MASKED_PARAMETERS)
        if not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(b, bytes) for b in raw):
            return "sent no masked vector"
        try:
            factor, entries = (bytes_to_ndarray(cast(bytes, b)) for b in raw)
        except Exception as error:  # noqa: BLE001 - whatever a client's bytes make numpy raise
            return f"sent a masked vector that cannot be read ({type(error).__name__})"
        if factor.shape != (1,) or entries.shape != (self.size,) or not factor.dtype == entries.dtype == np.int64:
            return f"sent a masked vector of shapes {[factor.shape, entries.shape]}, not [(1,), ({self.size},)] int64"
        if int(factor[0]) != self.factors[node]:
            return (f"sent the weight factor {int(factor[0])}, not the {self.factors[node]} of the examples it declared "
                    "(a tampered weight)")
        if entries.min(initial=0) < 0 or entries.max(initial=0) >= self.params.modulus_range:
            return "sent masked values outside [0, modulus_range)"
        complaints = cast(ConfigRecord, record).get(protocol.SECAGG_COMPLAINTS, [])
        sources = (self.neighbours[node] & self.shared) - {node}
        if not isinstance(complaints, list) or not set(complaints) <= sources:
            return "complained about nodes that sent it no shares"
        return entries, set(cast(list[int], complaints))

    def collect(self, replies: Mapping[int, Message]) -> dict[int, str]:
        """Check the masked vectors of ``replies`` (node -> its valid training reply), decide which
        can be unmasked, and sum those modulo M; returns node -> why a reply's vector was left
        out. The round halts when too few remain or a dropped node's masks cannot be removed."""
        left_out: dict[int, str] = {}
        vectors: dict[int, np.ndarray] = {}
        for node, reply in sorted(replies.items()):
            if node not in self.active:
                left_out[node] = "it left the protocol before masking"
                continue
            parsed = self.masked_vector(node, reply)
            if isinstance(parsed, str):
                self.blame(node, Stage.COLLECT_MASKED_VECTORS, parsed)
                left_out[node] = parsed
                continue
            vectors[node], self.complaints[node] = parsed
        for node in self._replays(vectors):
            left_out[node] = self.culprits[node]
            del vectors[node]
        self.report["disputes"] = [f"node {v} could not use the shares of node {u}"
                                   for v, owners in sorted(self.complaints.items()) if v in vectors for u in sorted(owners)]
        self.summed = self._unmaskable(set(vectors))
        for node in set(vectors) - self.summed:
            left_out[node] = self.culprits.get(node, "too few of its neighbours hold its shares")
        total = np.zeros(self.size, np.int64)
        for node in sorted(self.summed):
            total = np.mod(total + vectors[node], self.params.modulus_range)
        self.total = total
        self.report["masked_digests"] = sorted(hashlib.sha256(vectors[n].tobytes()).hexdigest() for n in vectors)
        self.active &= self.summed
        self.report["after_collect_masked_vectors"] = len(self.summed)
        self._enough(Stage.COLLECT_MASKED_VECTORS)
        self.revealed = {d for d in self.shared - self.summed
                         if self.neighbours[d] & self.summed and len(self._holders(d, self.summed)) < self.params.threshold}
        return left_out

    def _replays(self, vectors: Mapping[int, np.ndarray]) -> list[int]:
        """The nodes whose masked vector was seen before: in an earlier round (a replay: named) or
        from another node this round (one copied the other: both named)."""
        seen: dict[str, list[int]] = {}
        for node, vector in vectors.items():
            seen.setdefault(hashlib.sha256(vector.tobytes()).hexdigest(), []).append(node)
        replays = []
        for digest, nodes in seen.items():
            for node in nodes:
                if digest in self.history:
                    self.blame(node, Stage.COLLECT_MASKED_VECTORS, "sent a masked vector of an earlier round (a replay)")
                elif len(nodes) > 1:
                    self.blame(node, Stage.COLLECT_MASKED_VECTORS,
                               f"sent the same masked vector as node(s) {sorted(set(nodes) - {node})} (a copy)")
                else:
                    continue
                replays.append(node)
        return replays

    def _holders(self, owner: int, summed: set[int]) -> set[int]:
        """The summed neighbours of ``owner`` that hold a share of its secrets they could use."""
        return {w for w in self.neighbours[owner] & summed if owner not in self.complaints.get(w, set())}

    def _unmaskable(self, candidates: set[int]) -> set[int]:
        """The candidates whose mask seed threshold-many summed neighbours can help reconstruct (a
        node whose shares too many neighbours could not use is left out and named), to a fixed point."""
        summed = set(candidates)
        changed = True
        while changed:
            changed = False
            for node in sorted(summed):
                if len(self._holders(node, summed)) < self.params.threshold:
                    summed.discard(node)
                    refused = sum(node in self.complaints.get(w, set()) for w in self.neighbours[node] & candidates)
                    if refused:
                        self.blame(node, Stage.COLLECT_MASKED_VECTORS,
                                   f"dealt shares that {refused} of its neighbours could not use: it cannot be unmasked")
                    changed = True
        return summed

    # ------------------------------------------------------------------ stage 3: unmask
    def unmask(self) -> tuple[np.ndarray, float] | None:
        """Ask the summed nodes for the shares that remove the masks: of the mask seeds of the
        summed nodes, of the first private keys of the dead (shared keys, not summed). Each share
        is checked against its owner's commitment; any threshold-many valid ones reconstruct.
        Returns the weighted mean of the summed updates (float64, ``size`` entries) and D, the sum
        of their weight ratios; None when the round halts."""
        if self.failed:
            return None
        started = time.perf_counter()
        dead = self.shared - self.summed - self.revealed
        self.report["dead_recovered"] = len({d for d in dead | self.revealed if self.neighbours[d] & self.summed})
        self.report["keys_revealed_for"] = sorted(self.revealed)
        configs: dict[int, dict[str, list[int]]] = {
            node: {Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[node] & self.summed),
                   Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[node] & dead),
                   protocol.SECAGG_REVEAL: sorted(self.neighbours[node] & self.revealed)} for node in sorted(self.summed)}
        shares: dict[int, dict[int, bytes]] = {node: {} for node in self.summed | dead}
        pairwise: dict[tuple[int, int], bytes] = {}  # (dropped node, summed neighbour) -> their pairwise key
        for holder, record in self._exchange(Stage.UNMASK, configs).items():
            asked = set(configs[holder][Key.ACTIVE_NODE_ID_LIST]) | set(configs[holder][Key.DEAD_NODE_ID_LIST])
            problem = (self._read_shares(holder, record, asked, shares)
                       or self._read_revealed(holder, record, configs[holder][protocol.SECAGG_REVEAL], pairwise))
            if problem:
                self.blame(holder, Stage.UNMASK, problem)
        secrets = self._reconstruct(shares, dead, pairwise)
        if secrets is None:
            return None
        M, T = self.params.modulus_range, self.params.quantization_range
        total = self.total.copy()
        for (node, other), key in sorted(pairwise.items()):  # a revealed pair's mask, as the dead node's key would give
            total += (1 if node > other else -1) * secagg.mask(key, M, self.size)
        for node, secret in secrets.items():
            if node in self.summed:  # its private mask
                total -= secagg.mask(secret, M, self.size)
                continue
            private = bytes_to_private_key(secret)
            for other in sorted(self.neighbours[node] & self.summed):  # the dead node's pairwise masks in the sum
                key = generate_shared_key(private, bytes_to_public_key(self.public_keys[other][0]))
                total += (1 if node > other else -1) * secagg.mask(key, M, self.size)
        entries = np.mod(total, M)
        factor = sum(self.factors[n] for n in self.summed)
        [summed] = dequantize([entries], self.params.clipping_range, T)
        summed = (summed - (len(self.summed) - 1) * self.params.clipping_range) * (T / factor)
        self.report["seconds"][Stage.UNMASK] = time.perf_counter() - started
        return summed, factor / T

    def _read_shares(self, holder: int, record: ConfigRecord, asked: set[int],
                     shares: dict[int, dict[int, bytes]]) -> str:
        """Keep each share of ``holder``'s reply that matches its owner's commitment; what is wrong
        with the reply ('' if nothing): a share that matches no commitment (random, or another's),
        two shares of one node, a node it was not asked for."""
        nids, values = record.get(Key.NODE_ID_LIST, []), record.get(Key.SHARE_LIST, [])
        if not isinstance(nids, list) or not isinstance(values, list) or len(nids) != len(values):
            return "sent no aligned lists of node ids and shares"
        seen: set[int] = set()
        for owner, share in zip(nids, values):
            if isinstance(owner, bool) or not isinstance(owner, int) or owner not in asked or not isinstance(share, bytes):
                return f"sent a share of node {owner!r}, which it was not asked for"
            if owner in seen:
                return f"sent two shares of node {owner} (a duplicate)"
            seen.add(owner)
            kind, half = ("seed", 0) if owner in self.summed else ("key", 1)
            committed = self.commitments[owner].get(holder, b"")[half * secagg.DIGEST_BYTES:(half + 1) * secagg.DIGEST_BYTES]
            if secagg.share_commitment(kind, owner, holder, share) != committed:
                return f"sent a share of node {owner}'s {kind} that does not match its commitment (random, or another's)"
        for owner, share in zip(nids, values):
            shares[cast(int, owner)][holder] = cast(bytes, share)
        return ""

    def _read_revealed(self, holder: int, record: ConfigRecord, reveal: list[int],
                       pairwise: dict[tuple[int, int], bytes]) -> str:
        """Keep ``holder``'s pairwise key with each node of ``reveal``; what is wrong ('' if nothing).
        Nothing can check such a key on its own: a wrong one makes the unmasked mean garbage, which
        :func:`fedlora.secagg.mean_problem` refuses."""
        keys = record.get(protocol.SECAGG_REVEALED, [])
        if not isinstance(keys, list) or len(keys) != len(reveal) or not all(
                isinstance(k, bytes) and len(k) == 44 for k in keys):
            return f"revealed {len(keys) if isinstance(keys, list) else 0} pairwise keys for {len(reveal)} dropped nodes"
        for node, key in zip(reveal, keys):
            pairwise[(node, holder)] = cast(bytes, key)
        return ""

    def _reconstruct(self, shares: Mapping[int, Mapping[int, bytes]], dead: set[int],
                     pairwise: Mapping[tuple[int, int], bytes]) -> dict[int, bytes] | None:
        """Each needed secret from threshold-many of its valid shares, checked against its owner's
        seed commitment (a mask seed) or public key (a private key); None (the round halts) when
        one has too few valid shares or does not reconstruct, or a summed neighbour of a node in
        :attr:`revealed` did not reveal its pairwise key with it."""
        t, secrets = self.params.threshold, {}
        needed = sorted(self.summed) + sorted(d for d in dead if self.neighbours[d] & self.summed)
        missing = [(d, w) for d in sorted(self.revealed) for w in sorted(self.neighbours[d] & self.summed)
                   if (d, w) not in pairwise]
        if missing:
            self.fail(Stage.UNMASK, f"node {missing[0][1]} did not reveal its pairwise key with dropped node {missing[0][0]}")
            return None
        for owner in needed:
            valid = [shares[owner][h] for h in sorted(shares[owner]) if h not in self.culprits]
            if len(valid) < t:
                self.fail(Stage.UNMASK, f"fewer than {t} valid shares for node {owner}")
                return None
            try:
                secret = combine_shares(valid[:t])
                if owner in self.summed:
                    good = secagg.seed_commitment(owner, secret) == self.seed_commitments[owner]
                else:
                    good = public_key_to_bytes(bytes_to_private_key(secret).public_key()) == self.public_keys[owner][0]
            except (ValueError, TypeError):
                good = False
            if not good:
                self.blame(owner, Stage.UNMASK, "dealt shares that do not reconstruct the secret it committed to")
                self.fail(Stage.UNMASK, f"the shares of node {owner} do not reconstruct its secret")
                return None
            secrets[owner] = secret
        return secrets
