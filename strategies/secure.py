"""Secure aggregation on the server: Flower's SecAgg+ server stages, ported to the Message API.

Flower 1.39's ``SecAggPlusWorkflow`` runs the four stages of SecAgg+ as a legacy workflow that
replaces the round loop. :class:`SecureRound` is the same protocol (the same messages, keys and
checks, Flower's primitives for the key agreement, Shamir sharing, masks and quantisation), driven
by a :class:`~fedlora.strategies.base.LoRAStrategy` round (``strategies/secure_round.py``):
``configure_train`` runs the setup and share-keys stages over the grid and returns the masking
stage's messages (fedlora's training messages plus Flower's record); ``aggregate_train`` sums the
masked vectors, runs the unmask stage and gets the weighted mean of the updates.

One change to Flower's server: a client that drops out during the setup or share-keys stage is
not "dead" at the unmask stage (Flower 1.39 asks the survivors for shares of its key they never
received, and the round halts after every client trained). Here the dead are the clients that
shared their keys and sent no valid masked vector; their pairwise masks are rebuilt with the
neighbours whose masked vectors were summed, the only masks in the sum.
"""

from __future__ import annotations

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
from flwr.common.secure_aggregation.ndarrays_arithmetic import parameters_mod
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.serverapp import Grid
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fedlora.protocol import wire_size
from fedlora.secagg import SecAggParams, neighbours, weight_factor
from fedlora.strategies.accounting import reply_wire_size, short

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


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
        ``params.max_weight``); the clients mask with these.
    size : int
        Entries of the vector every client masks (:func:`fedlora.secagg.canonical_shapes`).
    timeout : float, optional
        Seconds each stage waits for its replies (``federation.round_timeout``).
    """

    def __init__(self, params: SecAggParams, grid: Grid, server_round: int, weights: Mapping[int, float], size: int,
                 timeout: float | None = None) -> None:
        self.params, self.grid, self.server_round, self.timeout = params, grid, server_round, timeout
        self.weights, self.size = dict(weights), size
        self.sampled = frozenset(self.weights)
        ring = sorted(self.sampled)
        random.SystemRandom().shuffle(ring)  # Flower shuffles the ring too (the server picks it: no secret)
        self.neighbours = neighbours(ring, params.num_shares)
        self.active: set[int] = set(self.sampled)  # nodes still in the protocol
        self.shared: set[int] = set()  # nodes whose encrypted shares were forwarded (share-keys stage done)
        self.summed: set[int] = set()  # nodes whose masked vector is in the sum
        self.public_keys: dict[int, tuple[bytes, bytes]] = {}
        self.forward: dict[int, tuple[list[int], list[bytes]]] = {}  # destination -> (sources, ciphertexts)
        self.total: list[np.ndarray] = []  # the sum of the masked vectors, mod M: [weight factor (1,), entries]
        self.failed = ""  # the stage that halted the round, and why
        self.report: dict[str, Any] = {"sampled": len(self.sampled), "num_shares": params.num_shares,
                                       "threshold": params.threshold, "wire_bytes": {}, "seconds": {}}

    # ------------------------------------------------------------------ helpers
    def _exchange(self, stage: str, configs: Mapping[int, dict[str, Any]]) -> dict[int, ConfigRecord]:
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
        """Flower's check after a stage: every sampled node keeps at least ``threshold`` active
        neighbours (itself included), else the round halts."""
        short_of = [n for n in self.sampled if len(self.neighbours[n] & self.active) < self.params.threshold]
        if short_of:
            self.fail(stage, f"{len(short_of)} clients have fewer than {self.params.threshold} active neighbours "
                             f"({len(self.active)} of {len(self.sampled)} clients left)")
        return not short_of

    def fail(self, stage: str, reason: str) -> None:
        """Halt the round at ``stage`` (logged, and in the round's report; the first halt stays)."""
        if self.failed:
            return
        self.failed = f"{stage}: {reason}"
        self.report["failed_stage"] = self.failed
        log(WARNING, "secure aggregation halted, round %d, %s", self.server_round, self.failed)

    # ------------------------------------------------------------------ stage 0: setup
    def setup(self) -> bool:
        """Send the parameters; keep each replying node's two public keys."""
        p = self.params
        entries = {Key.SAMPLE_NUMBER: p.sampled, Key.SHARE_NUMBER: p.num_shares, Key.THRESHOLD: p.threshold,
                   Key.CLIPPING_RANGE: float(p.clipping_range), Key.TARGET_RANGE: p.quantization_range,
                   Key.MOD_RANGE: p.modulus_range, Key.MAX_WEIGHT: float(p.max_weight)}
        for node, record in self._exchange(Stage.SETUP, {node: entries for node in self.sampled}).items():
            pk1, pk2 = record.get(Key.PUBLIC_KEY_1), record.get(Key.PUBLIC_KEY_2)
            if isinstance(pk1, bytes) and isinstance(pk2, bytes):
                self.public_keys[node] = (pk1, pk2)
        self.active &= set(self.public_keys)
        return self._enough(Stage.SETUP)

    # ------------------------------------------------------------------ stage 1: share keys
    def share_keys(self) -> bool:
        """Send each node its active neighbours' public keys; forward each encrypted share to its
        destination (active destinations only, as Flower does)."""
        configs = {node: {str(v): list(self.public_keys[v]) for v in self.neighbours[node] & self.active}
                   for node in self.active}
        records = self._exchange(Stage.SHARE_KEYS, configs)
        self.forward = {node: ([], []) for node in self.active}
        for src, record in records.items():
            dsts, ctxts = record.get(Key.DESTINATION_LIST, []), record.get(Key.CIPHERTEXT_LIST, [])
            if not isinstance(dsts, list) or not isinstance(ctxts, list) or len(dsts) != len(ctxts):
                self.active.discard(src)
                continue
            for dst, ctxt in zip(dsts, ctxts):
                if dst in self.forward and dst in self.neighbours[src] and isinstance(ctxt, bytes):
                    self.forward[dst][0].append(src)
                    self.forward[dst][1].append(ctxt)
        self.shared = set(self.active)
        return self._enough(Stage.SHARE_KEYS)

    # ------------------------------------------------------------------ stage 2: collect masked vectors
    def masking_record(self, node: int) -> ConfigRecord | None:
        """Flower's record of the masking stage for ``node`` (its forwarded shares); None for a node
        that left the protocol (it is sent no training message)."""
        if node not in self.active:
            return None
        srcs, ctxts = self.forward[node]
        return ConfigRecord({Key.STAGE: Stage.COLLECT_MASKED_VECTORS, Key.CIPHERTEXT_LIST: list(ctxts),
                             Key.SOURCE_LIST: list(srcs)})

    def masked_vector(self, reply: Message) -> list[np.ndarray] | str:
        """The reply's masked vector ([weight factor (1,), entries (size,)], int64 in [0, M)), or
        why it is not one (then its sender counts as dropped: its masks are rebuilt)."""
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        raw = None if record is None else record.get(Key.MASKED_PARAMETERS)
        if not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(b, bytes) for b in raw):
            return "no masked vector"
        try:
            vector = [bytes_to_ndarray(cast(bytes, b)) for b in raw]
        except Exception as error:  # noqa: BLE001 - whatever a client's bytes make numpy raise
            return f"the masked vector cannot be read ({type(error).__name__})"
        if [v.shape for v in vector] != [(1,), (self.size,)] or any(v.dtype != np.int64 for v in vector):
            return f"a masked vector of shapes {[v.shape for v in vector]}, expected [(1,), ({self.size},)] int64"
        if any(v.min(initial=0) < 0 or v.max(initial=0) >= self.params.modulus_range for v in vector):
            return "masked values outside [0, modulus_range)"
        return vector

    def collect(self, replies: Mapping[int, Message]) -> dict[int, str]:
        """Sum the masked vectors of ``replies`` (node -> its valid training reply) modulo M;
        returns node -> why a reply's vector was left out. The round halts below the threshold."""
        left_out: dict[int, str] = {}
        total = [np.zeros(1, np.int64), np.zeros(self.size, np.int64)]
        for node, reply in sorted(replies.items()):
            vector = self.masked_vector(reply) if node in self.active else "it left the protocol before masking"
            if isinstance(vector, str):
                left_out[node] = vector
                continue
            total = [t + v for t, v in zip(total, vector)]
            self.summed.add(node)
        self.total = parameters_mod(total, self.params.modulus_range)
        self.active &= self.summed
        self.report["after_collect_masked_vectors"] = len(self.summed)
        self._enough(Stage.COLLECT_MASKED_VECTORS)
        return left_out

    # ------------------------------------------------------------------ stage 3: unmask
    def unmask(self) -> tuple[np.ndarray, float] | None:
        """Ask the summing nodes for the shares that remove the masks: the private-mask seeds of
        the summed nodes, the first private keys of the dead (shared keys, sent no valid vector).
        Returns the weighted mean of the summed updates (float64, ``size`` entries) and D, the
        sum of their weight ratios; None when the round halts."""
        if self.failed:
            return None
        started = time.perf_counter()
        dead = self.shared - self.summed
        self.report["dead_recovered"] = len(dead)
        configs = {node: {Key.ACTIVE_NODE_ID_LIST: sorted(self.neighbours[node] & self.summed),
                          Key.DEAD_NODE_ID_LIST: sorted(self.neighbours[node] & dead)} for node in self.summed}
        shares: dict[int, list[bytes]] = {node: [] for node in self.summed | dead}
        for node, record in self._exchange(Stage.UNMASK, configs).items():
            nids, values = record.get(Key.NODE_ID_LIST, []), record.get(Key.SHARE_LIST, [])
            if isinstance(nids, list) and isinstance(values, list) and len(nids) == len(values):
                asked = set(configs[node][Key.ACTIVE_NODE_ID_LIST]) | set(configs[node][Key.DEAD_NODE_ID_LIST])
                for owner, share in zip(nids, values):
                    if owner in asked and isinstance(share, bytes):
                        shares[cast(int, owner)].append(share)
        short_of = sorted(n for n, got in shares.items() if len(got) < self.params.threshold)
        if short_of:
            self.fail(Stage.UNMASK, f"fewer than {self.params.threshold} shares for {len(short_of)} clients")
            return None
        M, shape = self.params.modulus_range, cast(list[tuple[int, ...]], [(1,), (self.size,)])
        total = list(self.total)
        try:
            for node in sorted(shares):
                secret = combine_shares(shares[node])
                if node in self.summed:  # its private mask
                    total = [t - m for t, m in zip(total, pseudo_rand_gen(secret, M, shape))]
                    continue
                for other in sorted(self.neighbours[node] & self.summed):  # the dead node's pairwise masks in the sum
                    key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(self.public_keys[other][0]))
                    sign = 1 if node > other else -1
                    total = [t + sign * m for t, m in zip(total, pseudo_rand_gen(key, M, shape))]
        except Exception as error:  # noqa: BLE001 - shares a client sent that do not combine, or a key that does not load
            self.fail(Stage.UNMASK, f"the masks cannot be removed ({type(error).__name__}: {short(error, 120)})")
            return None
        total = parameters_mod(total, M)
        factor, entries = int(total[0][0]), total[1]
        T = self.params.quantization_range
        expected = sum(weight_factor(self.weights[n], self.params.max_weight, T) for n in self.summed)
        if factor != expected:
            self.fail(Stage.UNMASK, f"the masked weights add up to {factor}, not the {expected} the server chose")
            return None
        [summed] = dequantize([entries], self.params.clipping_range, T)
        summed = (summed - (len(self.summed) - 1) * self.params.clipping_range) * (T / factor)
        self.report["seconds"][Stage.UNMASK] = time.perf_counter() - started
        return summed, factor / T
