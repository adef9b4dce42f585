"""The client side of secure aggregation: fedlora's port of Flower's ``secaggplus_mod`` around
fedlora's training handler (docs/secure-aggregation.md).

Flower 1.39's mod expands every mask with ``pseudo_rand_gen``, numpy's MT19937 seeded with 32 bits
of the 32-byte key, and cannot be given another generator; it also trusts the server's weight and
stops at the first bad share. So fedlora carries a port of it here: the same four stages, the same
messages and Flower's own checks of them (``check_stage``, ``check_configs``), Flower's key
agreement, Shamir sharing, share encryption and quantisation, with these changes:

- **masks** from :func:`fedlora.secagg.mask`: ChaCha20 keyed by the whole 256-bit pairwise key or
  private seed, on both sides (the server's port, ``strategies/secure.py``, removes them with it);
- **setup**: the client checks the round's parameters (the generator, a threshold above half of the
  shares unless the operator allowed less, the counts table) and proves it holds its two private
  keys (:func:`fedlora.secagg.possession_proof`), so the server can name a client that copies
  another's keys;
- **share keys**: it publishes a commitment to each share and to its mask seed, and puts the
  digest of the round's parameters (:func:`fedlora.secagg.transcript`) inside every share it
  encrypts;
- **masking**: a share that does not decrypt, is not addressed to it, carries another digest or
  does not match its owner's commitment is set aside and its owner listed in the reply
  (``secagg-complaints``) instead of stopping the client; the client still masks with every source
  (a pairwise mask needs the neighbour's public key, not its share). It refuses to mask when fewer
  than threshold of its neighbours (itself included) were sent the parameters it was sent, and when
  the server's weight departs from the weight of its own example count under the share rule
  (:func:`fedlora.secagg.weight_ratio`). Its weight factor travels in the clear (the server knows
  it: the counts are the ones the clients declared when they joined); the update is masked;
- **unmask**: it refuses a request that names a node both alive and dead, leaves itself out of
  the alive, or names a node it holds no share of; it sends only shares it verified.

Two mods of ``@app.train(mods=[secure_when_asked, masked_update, clipping_when_asked])``:
:func:`secure_when_asked` (outermost) runs the port on a training message that carries the SecAgg+
record (``secaggplus_configs``) and drops its state (private keys, seeds, shares) after the unmask
stage or a refusal; :func:`masked_update` (inside it) runs fedlora's handler and hands the port the
update to mask (upload minus download, A and B zero-padded to the round's largest rank, clipped to
``secagg-clip``, refused beyond ``secagg-range``). The reply that leaves carries the metrics and the
masked integers, never the upload.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from cryptography.fernet import InvalidToken
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import check_configs, check_stage
from flwr.common import ndarray_to_bytes
from flwr.common.secure_aggregation.crypto.shamir import create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, encrypt, generate_shared_key
from flwr.common.secure_aggregation.quantization import quantize
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.supercore.primitives.asymmetric import (
    bytes_to_private_key,
    bytes_to_public_key,
    generate_key_pairs,
    private_key_to_bytes,
    public_key_to_bytes,
)

from fedlora import protocol, secagg

CallNext = Callable[[Message, Context], Message]
UPDATE_RECORD = "secagg_update"  # the reply's update vector, from masked_update to the port (never sent)
_SETUP_KEYS = (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD, Key.CLIPPING_RANGE, Key.TARGET_RANGE,
               Key.MOD_RANGE, Key.MAX_WEIGHT, protocol.SECAGG_GENERATOR, protocol.SECAGG_SERVER_KEY,
               protocol.SECAGG_NODES, protocol.SECAGG_COUNTS, protocol.SECAGG_MAX_SHARE, protocol.SECAGG_WEIGHTING,
               protocol.SECAGG_LOW_THRESHOLD)


class Refusal(ValueError):
    """The client refuses the round (an error reply: for the server, a dropout at this stage)."""


# ------------------------------------------------------------------ the state between stages
@dataclass
class SecureState:
    """What the client keeps between the stages of a round (in ``context.state``, Flower's
    ``secaggplus_state`` record: a SuperNode keeps it between a deployment's ClientApp processes)."""

    stage: str = Stage.UNMASK  # the stage done last (Flower's: a new round starts at setup)
    nid: int = 0
    sample_num: int = 0
    share_num: int = 0
    threshold: int = 0
    clipping_range: float = 0.0
    target_range: int = 0
    mod_range: int = 0
    max_weight: float = 0.0
    nodes: list[int] = field(default_factory=list)  # the sampled clients, and the counts they declared
    counts: list[int] = field(default_factory=list)
    max_share: float = 1.0
    weighting: str = "examples"
    digest: bytes = b""  # the transcript of the setup stage's parameters
    sk1: bytes = b""
    pk1: bytes = b""
    sk2: bytes = b""
    pk2: bytes = b""
    rd_seed: bytes = b""
    neighbours: list[int] = field(default_factory=list)  # the share-keys stage's public keys, in its order
    pk1s: list[bytes] = field(default_factory=list)
    pk2s: list[bytes] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)  # the masking stage's sources (masked with)
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # owner -> its verified share, held here
    key_shares: dict[int, bytes] = field(default_factory=dict)

    @classmethod
    def load(cls, record: ConfigRecord | None) -> SecureState:
        state = cls()
        if not record:
            return state
        for name in ("seed_shares", "key_shares"):
            keys, values = record.get(f"{name}:K", []), record.get(f"{name}:V", [])
            setattr(state, name, dict(zip(cast(list[int], keys), cast(list[bytes], values), strict=True)))
        for name, value in record.items():
            if ":" not in name and name in cls.__dataclass_fields__:
                setattr(state, name, list(value) if isinstance(value, list) else value)
        return state

    def record(self) -> ConfigRecord:
        entries: dict[str, Any] = {}
        for name, value in vars(self).items():
            if isinstance(value, dict):
                entries[f"{name}:K"], entries[f"{name}:V"] = list(value), list(value.values())
            else:
                entries[name] = value
        return ConfigRecord(entries)

    def public_keys(self) -> dict[int, tuple[bytes, bytes]]:
        return {nid: (pk1, pk2) for nid, pk1, pk2 in zip(self.neighbours, self.pk1s, self.pk2s, strict=True)}


# ------------------------------------------------------------------ the mods
def secure_when_asked(msg: Message, context: Context, call_next: CallNext) -> Message:
    """fedlora's SecAgg+ port when the message carries the SecAgg+ record, else nothing; after the
    unmask stage, or when the client refuses a stage, the port's state leaves the node's state (it
    holds private keys and shares, and a non-empty state would keep a client's kept state from
    being restored from its checkpoint)."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if msg.metadata.message_type != MessageType.TRAIN or configs is None:
        return call_next(msg, context)
    stage = configs.get(Key.STAGE)
    try:
        reply = secaggplus(msg, context, call_next)
    except Exception:
        context.state.config_records.pop(RECORD_KEY_STATE, None)
        raise
    if stage == Stage.UNMASK:
        context.state.config_records.pop(RECORD_KEY_STATE, None)
    return reply


def masked_update(msg: Message, context: Context, call_next: CallNext) -> Message:
    """fedlora's training handler, its update handed to the port (module docstring).

    Before the handler: the SecAgg+ record leaves the message (Flower's ``fixedclipping_mod``
    refuses a message with more than one config record) and the port's state leaves the node's
    state (kept out of the handler and of the client's checkpoint; the port saves it again after).
    A reply whose update cannot be masked (:func:`fedlora.secagg.update_vector`: arrays that do not
    match the download, NaN, an entry beyond the clipping range) raises: an error reply, a dropout of
    the round that the protocol absorbs."""
    if msg.content.config_records.get(RECORD_KEY_CONFIGS) is None:
        return call_next(msg, context)
    from fedlora.lora import from_array_record
    from fedlora.secagg import update_vector

    del msg.content.config_records[RECORD_KEY_CONFIGS]
    context.state.config_records.pop(RECORD_KEY_STATE, None)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    config = msg.content.config_records[protocol.CONFIG_RECORD]
    vector = update_vector(from_array_record(reply.content.array_records[protocol.ARRAYS_RECORD]),
                           from_array_record(msg.content.array_records[protocol.ARRAYS_RECORD]),
                           int(protocol.number(config[protocol.SECAGG_PAD_RANK])),
                           protocol.number(config[protocol.SECAGG_CLIP]),
                           protocol.number(config[protocol.SECAGG_RANGE]))
    reply.content.array_records[UPDATE_RECORD] = ArrayRecord({"update": Array(vector)})
    return reply


def secaggplus(msg: Message, context: Context, call_next: CallNext) -> Message:
    """One stage of SecAgg+ (Flower's ``secaggplus_mod``, ported: module docstring)."""
    state = SecureState.load(context.state.config_records.get(RECORD_KEY_STATE))
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    check_stage(state.stage, configs)  # Flower's: the stages come in their order (setup restarts)
    stage = cast(str, configs.pop(Key.STAGE))
    check_configs(stage, configs)  # Flower's: the entries of the stage, their types
    content = RecordDict()
    if stage == Stage.SETUP:
        answer = _setup(state, configs, msg.metadata.dst_node_id)
    elif stage == Stage.SHARE_KEYS:
        answer = _share_keys(state, configs)
    elif stage == Stage.COLLECT_MASKED_VECTORS:
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        content = reply.content
        update = content.array_records.pop(UPDATE_RECORD)["update"].numpy()
        own_count = int(protocol.number(content.metric_records[protocol.METRICS_RECORD][protocol.NUM_EXAMPLES]))
        answer = _collect_masked_vectors(state, configs, own_count, update)
        for arrays in content.array_records.values():
            arrays.clear()
    elif stage == Stage.UNMASK:
        answer = _unmask(state, configs)
    else:
        raise Refusal(f"unknown SecAgg+ stage {stage!r}")
    state.stage = stage
    context.state.config_records[RECORD_KEY_STATE] = state.record()
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(answer, False)
    return Message(content, reply_to=msg)


# ------------------------------------------------------------------ stage 0: setup
def _setup(state: SecureState, configs: ConfigRecord, nid: int) -> dict[str, Any]:
    """Check the round's parameters, make two key pairs, prove holding them."""
    missing = [key for key in _SETUP_KEYS if key not in configs]
    if missing:
        raise Refusal(f"setup: the server sent no {missing[0]}")
    if not all(_whole_numbers(configs[key]) for key in (protocol.SECAGG_NODES, protocol.SECAGG_COUNTS)):
        raise Refusal("setup: node ids or example counts that are not lists of whole numbers")
    number = protocol.number  # Flower's check_configs made the ints ints and the clipping range a float
    fresh = SecureState(nid=nid, sample_num=int(number(configs[Key.SAMPLE_NUMBER])),
                        share_num=int(number(configs[Key.SHARE_NUMBER])), threshold=int(number(configs[Key.THRESHOLD])),
                        clipping_range=number(configs[Key.CLIPPING_RANGE]),
                        target_range=int(number(configs[Key.TARGET_RANGE])), mod_range=int(number(configs[Key.MOD_RANGE])),
                        max_weight=number(configs[Key.MAX_WEIGHT]),
                        nodes=list(cast(list[int], configs[protocol.SECAGG_NODES])),
                        counts=list(cast(list[int], configs[protocol.SECAGG_COUNTS])),
                        max_share=protocol.number(configs[protocol.SECAGG_MAX_SHARE]),
                        weighting=str(configs[protocol.SECAGG_WEIGHTING]))
    problem = _setup_problem(fresh, configs)
    if problem:
        raise Refusal(f"setup: {problem}")
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    fresh.sk1, fresh.pk1 = private_key_to_bytes(sk1), public_key_to_bytes(pk1)
    fresh.sk2, fresh.pk2 = private_key_to_bytes(sk2), public_key_to_bytes(pk2)
    fresh.digest = secagg.transcript({key: configs[key] for key in _SETUP_KEYS})
    vars(state).update(vars(fresh))
    proof = secagg.possession_proof(nid, fresh.pk1, fresh.pk2, fresh.sk1, fresh.sk2,
                                    cast(bytes, configs[protocol.SECAGG_SERVER_KEY]))
    return {Key.PUBLIC_KEY_1: fresh.pk1, Key.PUBLIC_KEY_2: fresh.pk2, protocol.SECAGG_PROOF: proof}


def _whole_numbers(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _setup_problem(p: SecureState, configs: ConfigRecord) -> str:
    """Why this client will not take part in a round of these parameters ('' if it will)."""
    generator = configs[protocol.SECAGG_GENERATOR]
    if generator != secagg.MASK_GENERATOR:
        return f"the round masks with {generator!r}, this client only with {secagg.MASK_GENERATOR!r}"
    if not 2 <= p.share_num <= p.sample_num or not 2 <= p.threshold <= p.share_num:
        return f"{p.share_num} shares and threshold {p.threshold} for {p.sample_num} clients"
    if 2 * p.threshold <= p.share_num and configs[protocol.SECAGG_LOW_THRESHOLD] is not True:
        return f"threshold {p.threshold} is not above half of the {p.share_num} shares"
    M, T = p.mod_range, p.target_range
    if not 2 <= M <= 2**32 or M & (M - 1) or not 1 <= T or p.sample_num * T >= M:
        return f"modulus {M} and quantization range {T} for {p.sample_num} clients"
    if not (0 < p.clipping_range < float("inf") and 0 < p.max_weight < float("inf") and 0 < p.max_share <= 1):
        return "a clipping range, largest weight or share bound that is not a positive finite number"
    if p.weighting not in secagg.WEIGHTINGS:
        return f"unknown weighting {p.weighting!r}"
    if len(p.nodes) != p.sample_num or len(set(p.nodes)) != len(p.nodes) or p.nid not in p.nodes:
        return "a table of sampled clients that does not list this client once among sample_num clients"
    if len(p.counts) != len(p.nodes) or not all(0 <= c <= protocol.MAX_COUNT for c in p.counts):
        return f"example counts that are not one whole number in [0, {protocol.MAX_COUNT:.0e}] per sampled client"
    if secagg.public_key_problem(configs[protocol.SECAGG_SERVER_KEY]):
        return "the server's key is " + secagg.public_key_problem(configs[protocol.SECAGG_SERVER_KEY])
    return ""


# ------------------------------------------------------------------ stage 1: share keys
def _share_keys(state: SecureState, configs: ConfigRecord) -> dict[str, Any]:
    """Flower's checks of the neighbours' keys, then shares of the mask seed and the first private
    key for each neighbour, each committed to, encrypted with the digest of the round inside."""
    keys = {int(sid): (pk1, pk2) for sid, (pk1, pk2) in cast(Mapping[str, tuple[bytes, bytes]], configs).items()}
    if not state.threshold <= len(keys) <= state.share_num:
        raise Refusal(f"share keys: {len(keys)} neighbours for threshold {state.threshold} and {state.share_num} shares")
    flat = [pk for pair in keys.values() for pk in pair]
    if len(set(flat)) != len(flat):
        raise Refusal("share keys: some public keys are identical")
    if keys.get(state.nid) != (state.pk1, state.pk2):
        raise Refusal("share keys: this client's own public keys are not the ones it sent")
    if not set(keys) <= set(state.nodes) or any(secagg.public_key_problem(pk) for pk in flat):
        raise Refusal("share keys: a neighbour that was not sampled, or a key that is no SECP384R1 public key")
    state.neighbours, state.pk1s, state.pk2s = list(keys), [k[0] for k in keys.values()], [k[1] for k in keys.values()]
    state.rd_seed = os.urandom(secagg.KEY_BYTES)
    seed_shares = create_shares(state.rd_seed, state.threshold, state.share_num)
    key_shares = create_shares(state.sk1, state.threshold, state.share_num)
    sk2 = bytes_to_private_key(state.sk2)
    dsts, ciphertexts, commitments = [], [], []
    for idx, (nid, (_, pk2)) in enumerate(keys.items()):
        commitments.append(secagg.share_commitment("seed", state.nid, nid, seed_shares[idx])
                           + secagg.share_commitment("key", state.nid, nid, key_shares[idx]))
        if nid == state.nid:
            state.seed_shares[nid], state.key_shares[nid] = seed_shares[idx], key_shares[idx]
            continue
        plaintext = pack_shares(state.nid, nid, seed_shares[idx], key_shares[idx], state.digest)
        dsts.append(nid)
        ciphertexts.append(encrypt(generate_shared_key(sk2, bytes_to_public_key(pk2)), plaintext))
    return {Key.DESTINATION_LIST: dsts, Key.CIPHERTEXT_LIST: ciphertexts, protocol.SECAGG_HOLDERS: list(keys),
            protocol.SECAGG_COMMITMENTS: commitments,
            protocol.SECAGG_SEED_COMMITMENT: secagg.seed_commitment(state.nid, state.rd_seed)}


def pack_shares(src: int, dst: int, seed_share: bytes, key_share: bytes, digest: bytes) -> bytes:
    """The plaintext of one encrypted pair of shares: source, destination, the two shares with their
    lengths, the digest of the round's parameters (Flower's layout, plus the second length and the
    digest)."""
    return b"".join([src.to_bytes(8, "little"), dst.to_bytes(8, "little"), len(seed_share).to_bytes(4, "little"),
                     seed_share, len(key_share).to_bytes(4, "little"), key_share, digest])


def unpack_shares(plaintext: bytes) -> tuple[int, int, bytes, bytes, bytes]:
    """:func:`pack_shares`' fields; ValueError when the bytes are not such a plaintext."""
    src, dst = int.from_bytes(plaintext[:8], "little"), int.from_bytes(plaintext[8:16], "little")
    at = 20 + int.from_bytes(plaintext[16:20], "little")
    seed_share = plaintext[20:at]
    end = at + 4 + int.from_bytes(plaintext[at:at + 4], "little")
    key_share, digest = plaintext[at + 4:end], plaintext[end:]
    if len(digest) != secagg.DIGEST_BYTES or len(key_share) != end - at - 4:
        raise ValueError("not a plaintext of shares")
    return src, dst, seed_share, key_share, digest


# ------------------------------------------------------------------ stage 2: mask
def _collect_masked_vectors(state: SecureState, configs: ConfigRecord, own_count: int,
                            update: np.ndarray) -> dict[str, Any]:
    """Open each source's shares (set aside and complained about when bad), check the round's
    parameters and this client's weight, then quantise, mask and return the update."""
    srcs = cast(list[int], configs[Key.SOURCE_LIST])
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    commitments = configs.get(protocol.SECAGG_COMMITMENTS, [])
    keys = state.public_keys()
    if not isinstance(commitments, list) or not len(srcs) == len(ciphertexts) == len(commitments):
        raise Refusal("masking: sources, ciphertexts and commitments of different lengths")
    if len(set(srcs)) != len(srcs) or not set(srcs) <= set(keys) - {state.nid}:
        raise Refusal("masking: a source that is not one of this client's neighbours, or one twice")
    if len(ciphertexts) + 1 < state.threshold:
        raise Refusal("masking: not enough available neighbour clients")  # Flower's check
    complaints, agreeing = [], 1
    for src, ciphertext, commitment in zip(srcs, ciphertexts, commitments, strict=True):
        opened = _open(state, src, ciphertext, commitment)
        if opened is None:
            complaints.append(src)
            continue
        agreeing += 1
        state.seed_shares[src], state.key_shares[src] = opened
    if agreeing < state.threshold:
        raise Refusal(f"masking: only {agreeing - 1} of its neighbours sent shares made for the round parameters "
                      f"this client was sent, fewer than threshold {state.threshold} with itself")
    factor = _own_factor(state, configs, own_count)
    quantized = quantize([update * (factor / state.target_range)], state.clipping_range, state.target_range)[0]
    masked = quantized.astype(np.int64) + secagg.mask(state.rd_seed, state.mod_range, update.size)
    sk1 = bytes_to_private_key(state.sk1)
    for src in srcs:  # the pairwise masks: every source, whatever its shares
        pairwise = secagg.mask(generate_shared_key(sk1, bytes_to_public_key(keys[src][0])), state.mod_range, update.size)
        masked = masked + pairwise if state.nid > src else masked - pairwise
    state.sources = list(srcs)
    masked = np.mod(masked, state.mod_range)
    return {Key.MASKED_PARAMETERS: [ndarray_to_bytes(np.array([factor], np.int64)), ndarray_to_bytes(masked)],
            protocol.SECAGG_COMPLAINTS: complaints}


def _open(state: SecureState, src: int, ciphertext: bytes, commitment: object) -> tuple[bytes, bytes] | None:
    """``src``'s shares for this client, or None when they cannot be used: the ciphertext does not
    decrypt, names another source or destination or another round's parameters, or the shares do
    not match ``src``'s commitments."""
    try:
        shared = generate_shared_key(bytes_to_private_key(state.sk2), bytes_to_public_key(state.public_keys()[src][1]))
        actual_src, dst, seed_share, key_share, digest = unpack_shares(decrypt(shared, ciphertext))
    except (InvalidToken, ValueError, TypeError):
        return None
    if (actual_src, dst, digest) != (src, state.nid, state.digest) or commitment != (
            secagg.share_commitment("seed", src, state.nid, seed_share)
            + secagg.share_commitment("key", src, state.nid, key_share)):
        return None
    return seed_share, key_share


def _own_factor(state: SecureState, configs: ConfigRecord, own_count: int) -> int:
    """The weight factor of this client's own example count under the round's share rule (what
    the server's weight must give, else the client refuses)."""
    index = state.nodes.index(state.nid)
    if state.counts[index] != own_count:
        raise Refusal(f"masking: the server lists {state.counts[index]} examples for this client, which holds {own_count}")
    ratio = secagg.weight_ratio(state.counts, index, state.max_share, state.weighting)
    factor = round(ratio * state.target_range)
    weight = configs.get(protocol.SECAGG_WEIGHT)
    told = -1 if not isinstance(weight, (int, float)) or isinstance(weight, bool) else secagg.weight_factor(
        float(weight), state.max_weight, state.target_range)
    if abs(told - factor) > 1:  # the server computes the same factor from the same counts (1: float rounding)
        raise Refusal(f"masking: the server's weight for this client ({weight!r} of {state.max_weight:.6g}) departs "
                      f"from the weight of its own {own_count} examples ({ratio:.6g} of the largest)")
    return factor


# ------------------------------------------------------------------ stage 3: unmask
def _unmask(state: SecureState, configs: ConfigRecord) -> dict[str, Any]:
    """The verified shares the server asks for: of the mask seed of each node it says was summed,
    of the first private key of each node it says dropped out; never both for one node. For a
    dropped node too few neighbours hold valid shares of (``secagg-reveal``), the pairwise mask key
    this client shares with it instead (what the dropped node's key would give for this pair)."""
    active = cast(list[int], configs[Key.ACTIVE_NODE_ID_LIST])
    dead = cast(list[int], configs[Key.DEAD_NODE_ID_LIST])
    reveal = configs.get(protocol.SECAGG_REVEAL, [])
    if not isinstance(reveal, list) or any(isinstance(n, bool) or not isinstance(n, int) for n in reveal):
        raise Refusal("unmask: the nodes to reveal pairwise keys with are not node ids")
    dropped = set(dead) | set(cast(list[int], reveal))
    if set(active) & dropped or state.nid not in active or len(set(reveal)) != len(reveal):
        raise Refusal("unmask: a node both summed and dropped, or this client among the dropped")
    if len(active) < state.threshold:
        raise Refusal("unmask: available neighbours number smaller than threshold")  # Flower's check
    if not set(active) | dropped <= set(state.sources) | {state.nid}:
        raise Refusal("unmask: shares asked of nodes this client did not mask with")
    nids = [n for n in active if n in state.seed_shares] + [n for n in dead if n in state.key_shares]
    shares = [state.seed_shares[n] for n in active if n in state.seed_shares]
    shares += [state.key_shares[n] for n in dead if n in state.key_shares]
    sk1, keys = bytes_to_private_key(state.sk1), state.public_keys()
    revealed = [generate_shared_key(sk1, bytes_to_public_key(keys[n][0])) for n in cast(list[int], reveal)]
    return {Key.NODE_ID_LIST: nids, Key.SHARE_LIST: shares, protocol.SECAGG_REVEALED: revealed}
