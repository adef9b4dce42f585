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

No client can stop a round: each stage checks each client's contribution on its own
(``strategies/secure_checks.py``: keys proven held, shares addressed to exactly the neighbours and
committed to, a clear weight factor, no replayed vector, shares matching their commitments) and goes
on with the others while every client still in the protocol keeps threshold-many neighbours. A
client that cannot use a neighbour's shares says so (``secagg-complaints``, a dispute recorded);
those shares are not asked for, and a client whose shares too many neighbours refuse is left out.
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
from fedlora.strategies.secure_checks import (
    copies,
    holders,
    keys_problem,
    read_masked,
    read_revealed,
    read_shares,
    reconstruct,
    shares_problem,
    unmaskable,
)

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


class SecureRound:
    """One round of SecAgg+ between the server and the sampled clients (module docstring).

    ``params``: the round's parameters (:func:`fedlora.secagg.choose_params`); ``weights``: node id ->
    the aggregation weight the server chose (at most W; each client checks it); ``counts``: node id ->
    the examples it declared when it joined, weighed by ``weighting`` ('examples': the share rule of
    bound ``max_share``; 'uniform') as :func:`fedlora.secagg.weight_ratio` does; ``size``: entries of
    the vector every client masks; ``timeout``: seconds each stage waits; ``low_threshold``: the
    operator allowed a threshold at most half of the shares; ``history``: digests of earlier rounds'
    masked vectors (a vector seen again is a replay).
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
            problem = keys_problem(node, record, self.server_sk)
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

    # ------------------------------------------------------------------ stage 1: share keys
    def share_keys(self) -> bool:
        """Send each node its active neighbours' public keys; keep the encrypted shares and
        commitments of each node whose reply checks out (:meth:`_shares_problem`)."""
        keyed = set(self.active)
        configs = {node: {str(v): list(self.public_keys[v]) for v in self.neighbours[node] & keyed}
                   for node in sorted(keyed)}
        for src, record in self._exchange(Stage.SHARE_KEYS, configs).items():
            problem = shares_problem(src, record, self.neighbours[src] & keyed)
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
            record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
            parsed = read_masked(record, self.size, self.params.modulus_range, self.factors[node],
                                 (self.neighbours[node] & self.shared) - {node})
            if isinstance(parsed, str):
                self.blame(node, Stage.COLLECT_MASKED_VECTORS, parsed)
                left_out[node] = parsed
                continue
            vectors[node], self.complaints[node] = parsed
        for node, why in sorted(copies(vectors, self.history).items()):
            self.blame(node, Stage.COLLECT_MASKED_VECTORS, why)
            left_out[node] = why
            del vectors[node]
        self.report["disputes"] = [f"node {v} could not use the shares of node {u}"
                                   for v, owners in sorted(self.complaints.items()) if v in vectors for u in sorted(owners)]
        self.summed, refused = unmaskable(set(vectors), self.neighbours, self.complaints, self.params.threshold)
        for node, count in sorted(refused.items()):
            self.blame(node, Stage.COLLECT_MASKED_VECTORS,
                       f"dealt shares that {count} of its neighbours could not use: it cannot be unmasked")
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
        self.revealed = {d for d in self.shared - self.summed if self.neighbours[d] & self.summed
                         and len(holders(d, self.summed, self.neighbours, self.complaints)) < self.params.threshold}
        return left_out

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
            held, problem = read_shares(holder, record, asked, self.summed, self.commitments)
            keys, problem = ({}, problem) if problem else read_revealed(record, configs[holder][protocol.SECAGG_REVEAL])
            if problem:
                self.blame(holder, Stage.UNMASK, problem)
                continue
            for owner, share in held.items():
                shares[owner][holder] = share
            pairwise.update({(node, holder): key for node, key in keys.items()})
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
            valid = [shares[owner][h] for h in sorted(shares[owner])]
            if len(valid) < t:
                self.fail(Stage.UNMASK, f"fewer than {t} valid shares for node {owner}")
                return None
            secret = reconstruct(owner, valid, t, self.seed_commitments[owner] if owner in self.summed else None,
                                 self.public_keys[owner][0])
            if secret is None:
                self.blame(owner, Stage.UNMASK, "dealt shares that do not reconstruct the secret it committed to")
                self.fail(Stage.UNMASK, f"the shares of node {owner} do not reconstruct its secret")
                return None
            secrets[owner] = secret
        return secrets
