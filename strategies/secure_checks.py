"""The server's checks of each client's SecAgg+ contribution, one function per stage
(``strategies/secure.py`` calls them on each reply on its own). Each returns what is wrong with
the contribution as a phrase ('' when nothing is; the round then names its sender), never raises
on what a client sent:

- setup (:func:`keys_problem`): both public keys SECP384R1 keys, different, and proven held
  (:func:`fedlora.secagg.check_possession`): a bad, copied or shared key;
- share keys (:func:`shares_problem`): the encrypted shares addressed to exactly the sender's
  neighbours, one each, with a commitment to every share and to its mask seed: a wrong, missing or
  duplicate destination (its sender leaves before anyone masks with it);
- masking (:func:`read_masked`, :func:`copies`): the weight factor in the clear and the one of the
  client's declared examples (a tampered weight), the masked vector of the right shape and range
  and never seen before (a replay); such a client is treated as dropped out: its masks are removed
  with its key's shares. Which clients can be unmasked (:func:`unmaskable`): those whose shares
  threshold-many summed neighbours could use;
- unmask (:func:`read_shares`, :func:`reconstruct`): each share checked against its owner's
  commitment before use (a random, copied or duplicated share), any threshold-many valid shares
  reconstruct a secret, the reconstruction checked against the owner's seed commitment or public key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
from flwr.app import ConfigRecord
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, public_key_to_bytes

from fedlora import protocol, secagg

COMMITMENT_PAIR = 2 * secagg.DIGEST_BYTES  # a holder's seed-share and key-share commitments
REVEALED_KEY_BYTES = 44  # a pairwise key as Flower's key agreement returns it (URL-safe base64 of 32 bytes)


def keys_problem(node: int, record: ConfigRecord, server_sk: bytes) -> str:
    """Setup: ``node``'s two public keys must be SECP384R1 keys, different, and proven held
    (:func:`fedlora.secagg.check_possession` under the server's one-round key)."""
    pk1, pk2 = record.get(Key.PUBLIC_KEY_1), record.get(Key.PUBLIC_KEY_2)
    problem = secagg.public_key_problem(pk1) or secagg.public_key_problem(pk2)
    if problem:
        return f"sent a public key that is {problem}"
    if pk1 == pk2:
        return "sent the same public key twice"
    try:
        proven = secagg.check_possession(node, cast(bytes, pk1), cast(bytes, pk2), record.get(protocol.SECAGG_PROOF),
                                         server_sk)
    except (ValueError, TypeError):
        proven = False
    return "" if proven else "sent public keys it cannot prove it holds (another client's, or made up)"


def _ids(values: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def shares_problem(src: int, record: ConfigRecord, keyed: set[int]) -> str:
    """Share keys: ``src``'s encrypted shares must go to exactly its neighbours that were sent keys
    (``keyed``, itself included), one each, each a ciphertext of bounded size, with a commitment for
    every holder and one for its mask seed."""
    dsts, ciphertexts = record.get(Key.DESTINATION_LIST), record.get(Key.CIPHERTEXT_LIST)
    holders, commitments = record.get(protocol.SECAGG_HOLDERS), record.get(protocol.SECAGG_COMMITMENTS)
    if not (isinstance(dsts, list) and isinstance(ciphertexts, list) and isinstance(holders, list)
            and isinstance(commitments, list)):
        return "sent no lists of destinations, ciphertexts, holders and commitments"
    expected = sorted(keyed - {src})
    if not _ids(dsts) or sorted(cast(list[int], dsts)) != expected:
        return (f"addressed its shares to {sorted(set(map(str, dsts)))[:6]}, not once to each of its neighbours "
                f"{expected[:6]} (a wrong, missing or duplicate destination)")
    if len(ciphertexts) != len(dsts) or not all(
            isinstance(c, bytes) and 0 < len(c) <= secagg.MAX_CIPHERTEXT_BYTES for c in ciphertexts):
        return f"sent {len(ciphertexts)} ciphertexts for {len(dsts)} destinations, or one that is no ciphertext"
    if not _ids(holders) or sorted(cast(list[int], holders)) != sorted(keyed):
        return "committed to shares for other holders than its neighbours"
    if len(commitments) != len(holders) or not all(
            isinstance(c, bytes) and len(c) == COMMITMENT_PAIR for c in commitments):
        return "sent commitments that are not one 64-byte pair per holder"
    seed = record.get(protocol.SECAGG_SEED_COMMITMENT)
    if not isinstance(seed, bytes) or len(seed) != secagg.DIGEST_BYTES:
        return "sent no commitment to its mask seed"
    return ""


def read_masked(record: ConfigRecord | None, size: int, modulus: int, factor: int,
                sources: set[int]) -> tuple[np.ndarray, set[int]] | str:
    """Masking: the reply's masked entries (int64 in [0, M), ``size`` of them) and the sources it
    could not use the shares of, or what is wrong: no vector, unreadable bytes, a wrong shape or
    range, a clear weight factor that is not ``factor`` (the one of its declared examples),
    complaints about nodes that are not among its ``sources``."""
    raw = None if record is None else record.get(Key.MASKED_PARAMETERS)
    if not isinstance(raw, list) or len(raw) != 2 or not all(isinstance(b, bytes) for b in raw):
        return "sent no masked vector"
    try:
        told, entries = (bytes_to_ndarray(cast(bytes, b)) for b in raw)
    except Exception as error:  # noqa: BLE001 - whatever a client's bytes make numpy raise
        return f"sent a masked vector that cannot be read ({type(error).__name__})"
    if told.shape != (1,) or entries.shape != (size,) or not told.dtype == entries.dtype == np.int64:
        return f"sent a masked vector of shapes {[told.shape, entries.shape]}, not [(1,), ({size},)] int64"
    if int(told[0]) != factor:
        return f"sent the weight factor {int(told[0])}, not the {factor} of the examples it declared (a tampered weight)"
    if entries.min(initial=0) < 0 or entries.max(initial=0) >= modulus:
        return "sent masked values outside [0, modulus_range)"
    complaints = cast(ConfigRecord, record).get(protocol.SECAGG_COMPLAINTS, [])
    if not isinstance(complaints, list) or not _ids(complaints) or not set(cast(list[int], complaints)) <= sources:
        return "complained about nodes that sent it no shares"
    return entries, set(cast(list[int], complaints))


def copies(vectors: Mapping[int, np.ndarray], history: set[str]) -> dict[int, str]:
    """Masking: node -> why its masked vector was seen before: in an earlier round (``history``, a
    replay) or from another node this round (one copied the other: both). A fresh masked vector
    repeats another with probability 2^-32 per entry."""
    seen: dict[str, list[int]] = {}
    for node, vector in vectors.items():
        seen.setdefault(hashlib.sha256(vector.tobytes()).hexdigest(), []).append(node)
    found = {}
    for digest, nodes in seen.items():
        for node in nodes:
            if digest in history:
                found[node] = "sent a masked vector of an earlier round (a replay)"
            elif len(nodes) > 1:
                found[node] = f"sent the same masked vector as node(s) {sorted(set(nodes) - {node})} (a copy)"
    return found


def read_shares(holder: int, record: ConfigRecord, asked: set[int], summed: set[int],
                commitments: Mapping[int, Mapping[int, bytes]]) -> tuple[dict[int, bytes], str]:
    """Unmask: ``holder``'s shares (owner -> share), each matching its owner's commitment (of the
    seed share for a summed owner, of the key share for a dropped one); none and what is wrong when
    one does not (random, or another's), an owner comes twice, or one was not asked for."""
    nids, values = record.get(Key.NODE_ID_LIST, []), record.get(Key.SHARE_LIST, [])
    if not isinstance(nids, list) or not isinstance(values, list) or len(nids) != len(values):
        return {}, "sent no aligned lists of node ids and shares"
    shares: dict[int, bytes] = {}
    for owner, share in zip(nids, values):
        if isinstance(owner, bool) or not isinstance(owner, int) or owner not in asked or not isinstance(share, bytes):
            return {}, f"sent a share of node {owner!r}, which it was not asked for"
        if owner in shares:
            return {}, f"sent two shares of node {owner} (a duplicate)"
        kind, half = ("seed", 0) if owner in summed else ("key", 1)
        committed = commitments[owner].get(holder, b"")[half * secagg.DIGEST_BYTES:(half + 1) * secagg.DIGEST_BYTES]
        if secagg.share_commitment(kind, owner, holder, share) != committed:
            return {}, f"sent a share of node {owner}'s {kind} that does not match its commitment (random, or another's)"
        shares[owner] = share
    return shares, ""


def read_revealed(record: ConfigRecord, reveal: list[int]) -> tuple[dict[int, bytes], str]:
    """Unmask: the holder's pairwise key with each node of ``reveal``, in that order. Nothing can
    check such a key on its own: a wrong one makes the unmasked mean garbage, which
    :func:`fedlora.secagg.mean_problem` refuses."""
    keys = record.get(protocol.SECAGG_REVEALED, [])
    if not isinstance(keys, list) or len(keys) != len(reveal) or not all(
            isinstance(k, bytes) and len(k) == REVEALED_KEY_BYTES for k in keys):
        return {}, f"revealed {len(keys) if isinstance(keys, list) else 0} pairwise keys for {len(reveal)} dropped nodes"
    return dict(zip(reveal, cast(list[bytes], keys))), ""


def reconstruct(owner: int, shares: list[bytes], threshold: int, seed_commitment: bytes | None,
                public_key: bytes) -> bytes | None:
    """``owner``'s secret from ``threshold`` of its valid ``shares``: its mask seed, checked against
    its ``seed_commitment``, or (None there) its first private key, checked against its
    ``public_key``; None when it does not reconstruct (the owner dealt inconsistent shares)."""
    try:
        secret = combine_shares(shares[:threshold])
        if seed_commitment is not None:
            good = secagg.seed_commitment(owner, secret) == seed_commitment
        else:
            good = public_key_to_bytes(bytes_to_private_key(secret).public_key()) == public_key
    except (ValueError, TypeError):
        good = False
    return secret if good else None


def holders(owner: int, summed: set[int], neighbours: Mapping[int, set[int]],
            complaints: Mapping[int, set[int]]) -> set[int]:
    """The summed neighbours of ``owner`` holding shares of its secrets they could use."""
    return {w for w in neighbours[owner] & summed if owner not in complaints.get(w, set())}


def unmaskable(candidates: set[int], neighbours: Mapping[int, set[int]], complaints: Mapping[int, set[int]],
               threshold: int) -> tuple[set[int], dict[int, int]]:
    """The candidates whose mask seed threshold-many summed neighbours can help reconstruct, to a
    fixed point (leaving one out can leave another short), and node -> how many neighbours refused
    its shares, for each node left out that any neighbour refused (it is named)."""
    summed, refused = set(candidates), {}
    changed = True
    while changed:
        changed = False
        for node in sorted(summed):
            if len(holders(node, summed, neighbours, complaints)) < threshold:
                summed.discard(node)
                count = sum(node in complaints.get(w, set()) for w in neighbours[node] & candidates)
                if count:
                    refused[node] = count
                changed = True
    return summed, refused
