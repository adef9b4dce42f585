"""Secure aggregation (SecAgg+): the parameters of a round and the arithmetic around the masks.

Pure functions, no Flower import: the protocol is Flower's SecAgg+ (its stages and messages, its
key agreement, Shamir sharing and quantisation), run by fedlora's ports of its two halves,
``strategies/secure.py`` on the server and ``clients/secure.py`` on the client
(docs/secure-aggregation.md). What is decided here:

- **the ranges of a round**: the quantization range T (the largest power of 2 with
  ``sampled * T < M`` and ``T <= 2**30``: the masked sum never wraps modulo M), the clipping
  range c (what a client's update may hold per entry), the largest weight W (the largest
  aggregation weight among the sampled clients, so every weight ratio is at most 1), the number
  of shares and the reconstruction threshold (Flower's ``SecAggPlusWorkflow`` rules);
- **the error bound** of the dequantised weighted mean against the plain one,
  ``3 c |S| / (T D)`` (:func:`error_bound`);
- **what a client masks**: its update (upload minus download), A rows and B columns zero-padded
  to the round's largest rank, flattened in a fixed key order into one vector
  (:func:`update_vector`), and the server's inverse (:func:`unflatten`);
- **the cryptography both sides must agree on** (fedlora's SecAgg+ port, docs/secure-aggregation.md):
  the masks, expanded by ChaCha20 keyed by the whole 256-bit shared key or seed (:func:`mask`;
  Flower's own generator folds the key into a 32-bit seed); the commitments a client publishes
  with its shares and its mask seed (:func:`share_commitment`, :func:`seed_commitment`); the proof
  that a client holds the private keys of the public keys it sends (:func:`possession_proof`); the
  digest of a round's public parameters its clients compare with each other (:func:`transcript`);
- **what an honest round can give**: the weight ratio a client derives from its own example count
  with the share rule (:func:`weight_ratio`), and the test of the unmasked mean against what
  clipped updates can sum to (:func:`mean_problem`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload
from fedlora.shares import capped_weights

MAX_QUANTIZATION = 2**30  # T: Flower's stochastic rounding casts to int32 (T + 1 levels must fit)
MAX_MODULUS = 2**32  # M: masked values are int64; a sum of up to 2**31 of them cannot overflow
DEFAULT_CLIPPING_RANGE = 8.0  # c when neither clip_norm nor clipping_range is set (Flower's default)
# The mask generator every client of a secure federation uses (declared in its profile, ClientProfile.secure_masks):
# ChaCha20 keyed by the whole 32-byte shared key or seed. A client that would use Flower's pseudo_rand_gen
# (MT19937 seeded with 32 bits of the key) cannot join.
MASK_GENERATOR = "chacha20-256"
SECURITY_BITS = 128  # the weakest primitive of the protocol: Fernet's AES-128 around the shares (docs)
KEY_BYTES = 32  # a mask key: a pairwise key (HKDF-SHA256 of the ECDH secret) or a private mask seed
DIGEST_BYTES = 32  # SHA-256: a commitment, a transcript, a proof of possession
MAX_CIPHERTEXT_BYTES = 4096  # an encrypted pair of shares of 32-byte secrets is about 300 bytes
WEIGHTINGS = ("examples", "uniform")  # how a secure round weighs its clients (what a client can check)
_MASK_NONCE = (0).to_bytes(4, "little") + b"fedlora-mask"  # ChaCha20's 16 bytes: block counter 0 + a 12-byte label

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class SecAggParams:
    """The SecAgg+ parameters of one round (the setup stage sends them to every sampled client).

    Parameters
    ----------
    sampled : int
        Clients sampled for the round (N).
    num_shares : int
        Neighbours each client secret-shares its mask seed and key with, itself included.
    threshold : int
        Shares needed to reconstruct a secret (t): fewer surviving neighbours halt the round.
    clipping_range : float
        c: each entry of a client's (weighted) update lies in [-c, c].
    quantization_range : int
        T: [-c, c] is quantised to the integers 0..T.
    modulus_range : int
        M: masks and sums are taken modulo M (a power of 2).
    max_weight : float
        W: the largest aggregation weight of the round; a client's weight enters as w_k / W <= 1.
    """

    sampled: int
    num_shares: int
    threshold: int
    clipping_range: float
    quantization_range: int
    modulus_range: int
    max_weight: float


def power(value: int) -> str:
    """``2^k`` for a power of 2, the number otherwise (for messages)."""
    return f"2^{value.bit_length() - 1}" if value > 0 and value & (value - 1) == 0 else str(value)


def resolve_shares(num_shares: float, sampled: int) -> int:
    """Flower's rule (``SecAggPlusWorkflow.setup_stage``): a float is a fraction of the sampled
    clients, rounded, made odd when below ``sampled``, and all of them when that leaves 2 or
    fewer; an int is a count. Unlike Flower, an even count below ``sampled`` is made odd before it
    is sent (Flower sends the even count and builds neighbourhoods of the odd one, so its clients
    make one share too few), and a count is at most ``sampled``."""
    fraction = isinstance(num_shares, float) or num_shares == 1
    shares = round(float(num_shares) * sampled) if fraction else int(num_shares)
    if shares < sampled and shares % 2 == 0:
        shares += 1
    if fraction and shares <= 2:
        shares = sampled
    return min(shares, sampled)


def resolve_threshold(threshold: float, num_shares: int) -> int:
    """0 (the default): the smallest count above half of the shares, ``num_shares // 2 + 1`` (at
    least 2). Otherwise Flower's rule: a float is a fraction of the shares, rounded, at least 2; an
    int is a count (1 means all the shares, as Flower reads it)."""
    if threshold == 0:
        return max(num_shares // 2 + 1, 2)
    if isinstance(threshold, float) or threshold == 1:
        return max(round(float(threshold) * num_shares), 2)
    return int(threshold)


def threshold_problem(threshold: int, num_shares: int, allow_low: bool) -> str:
    """Why ``threshold`` of ``num_shares`` is refused ('' if it is not): at most half of the shares
    (a server that lies about who dropped out could then get a client's mask seed from one half of
    its neighbours and its mask key from the other) unless ``allow_low``, or above the shares."""
    if threshold > num_shares:
        return f"reconstruction threshold {threshold} is above the {num_shares} shares: no secret could be reconstructed"
    if 2 * threshold <= num_shares and not allow_low:
        return (f"reconstruction threshold {threshold} is not above half of the {num_shares} shares; set "
                "secure_aggregation.reconstruction_threshold = 0 (the smallest count above half) or "
                "secure_aggregation.allow_low_threshold = true")
    return ""


def quantization_range(sampled: int, modulus_range: int, cap: int = MAX_QUANTIZATION) -> int:
    """T: the largest power of 2 with ``sampled * T < modulus_range`` and ``T <= cap`` (0 when
    none is: fewer than 2 levels)."""
    T = 1 << (cap.bit_length() - 1)  # the largest power of 2 <= cap
    while T > 1 and sampled * T >= modulus_range:
        T >>= 1
    return T if sampled * T < modulus_range and T > 1 else 0


def wrap_problem(sampled: int, quantization: int, modulus_range: int) -> str:
    """Why the masked sum of ``sampled`` clients could wrap modulo M ('' if it cannot): every
    summed entry (the weight factor too) lies in [0, T], so the true sum is below M when
    ``sampled * T < M`` (at ``sampled * T = M`` a full column wraps to 0)."""
    if sampled * quantization < modulus_range:
        return ""
    return (f"{sampled} clients x quantization_range {power(quantization)} >= modulus_range "
            f"{power(modulus_range)}: the masked sum would wrap; set secure_aggregation.quantization_range "
            "= 0 (the largest that fits) or raise modulus_range")


def error_bound(clipping_range: float, survivors: int, quantization: int, total_weight: float) -> float:
    """Largest per-entry difference between the securely aggregated weighted mean and the plain
    one: ``3 c |S| / (T D)``, with |S| the clients summed and D = sum of their quantised weight
    ratios (1 <= D <= |S| when W is the largest weight). Stochastic rounding moves each client's
    entry by less than one quantum 2c/T, rounding its weight ratio by at most 1/(2T), and an
    update entry differs from the mean by at most 2c (docs/secure-aggregation.md)."""
    return 3.0 * clipping_range * survivors / (quantization * total_weight)


def clipping_range(clip_norm: float, configured: float) -> float:
    """c: ``configured`` when set, else the clip norm (an update of L2 norm <= C has no entry
    beyond C), else :data:`DEFAULT_CLIPPING_RANGE`."""
    return configured or clip_norm or DEFAULT_CLIPPING_RANGE


def weight_factor(weight: float, max_weight: float, quantization: int) -> int:
    """The integer weight a client adds to the masked sum, as Flower's mod computes it:
    ``round(weight / max_weight * T)``."""
    return round(weight / max_weight * quantization)


def flower_problem(num_shares: float, threshold: float, quantization: int, modulus_range: int) -> str:
    """Flower's checks of its SecAgg+ parameters (``SecAggPlusWorkflow._check_init_params``), as a
    sentence ('' when they pass); plus a threshold of at least 2 (Flower lets 0 and negative
    integers through; 0 is fedlora's default, :func:`resolve_threshold`)."""
    if isinstance(num_shares, bool) or not isinstance(num_shares, (int, float)):
        return "num_shares must be an int or a float"
    if isinstance(num_shares, int) and num_shares != 1 and num_shares <= 2:
        return f"num_shares as an integer must be greater than 2, got {num_shares}"
    if isinstance(num_shares, float) and not 0 < num_shares <= 1:
        return f"num_shares as a float is a fraction of the sampled clients, in (0, 1], got {num_shares}"
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        return "reconstruction_threshold must be an int or a float"
    if isinstance(threshold, int) and threshold not in (0, 1):  # 0: fedlora's default (above half of the shares)
        if threshold < 2:
            return f"reconstruction_threshold as an integer must be at least 2, got {threshold}"
        if isinstance(num_shares, int) and num_shares != 1 and threshold >= num_shares:
            return f"reconstruction_threshold ({threshold}) must be less than num_shares ({num_shares})"
    if isinstance(threshold, float) and not 0 < threshold <= 1:
        return f"reconstruction_threshold as a float must be in (0, 1], got {threshold}"
    if quantization <= 0:
        return f"quantization_range must be greater than 0, got {quantization}"
    if modulus_range <= quantization:
        return f"modulus_range ({modulus_range}) must be greater than quantization_range ({quantization})"
    if modulus_range & (modulus_range - 1):
        return f"modulus_range must be a power of 2, got {modulus_range}"
    return ""


def choose_params(weights: Sequence[float], num_shares: float, threshold: float, clip_norm: float,
                  configured_clipping: float, configured_quantization: int, modulus_range: int) -> SecAggParams:
    """The parameters of a round whose sampled clients weigh ``weights`` (the server's aggregation
    weights, one per sampled client): W = max weight, T = ``configured_quantization`` or
    :func:`quantization_range`, c = :func:`clipping_range`, shares and threshold by Flower's rules."""
    sampled = len(weights)
    shares = resolve_shares(num_shares, sampled)
    return SecAggParams(
        sampled=sampled,
        num_shares=shares,
        threshold=resolve_threshold(threshold, shares),
        clipping_range=clipping_range(clip_norm, configured_clipping),
        quantization_range=configured_quantization or quantization_range(sampled, modulus_range),
        modulus_range=modulus_range,
        max_weight=float(max(weights)),
    )


def neighbours(ring: Sequence[int], num_shares: int) -> dict[int, set[int]]:
    """Flower's neighbourhoods: each node of ``ring`` (the shuffled node ids) with the
    ``num_shares >> 1`` nodes on either side of it, itself included (all of them when the ring
    is shorter)."""
    half, size = num_shares >> 1, len(ring)
    return {node: {ring[(i + offset) % size] for offset in range(-half, half + 1)} for i, node in enumerate(ring)}


# ------------------------------------------------------------------ what a client masks
def factor_rank(key: str, shape: tuple[int, ...]) -> int:
    """The LoRA rank an array of the payload holds (A: rows, B: columns; 0 for a head)."""
    if key.endswith(A_SUFFIX):
        return int(shape[0])
    if key.endswith(B_SUFFIX):
        return int(shape[1])
    return 0


def canonical_shapes(shapes: Shapes, pad_rank: int) -> dict[str, tuple[int, ...]]:
    """The shapes a client masks, in the fixed order both sides flatten in (sorted keys): A rows
    and B columns zero-padded to ``pad_rank`` (0: as they are), every other array as it is."""
    out: dict[str, tuple[int, ...]] = {}
    for key in sorted(shapes):
        shape = tuple(int(d) for d in shapes[key])
        if pad_rank and key.endswith(A_SUFFIX):
            shape = (max(pad_rank, shape[0]), *shape[1:])
        elif pad_rank and key.endswith(B_SUFFIX):
            shape = (shape[0], max(pad_rank, shape[1]), *shape[2:])
        out[key] = shape
    return out


def padded(payload: Payload, shapes: Shapes) -> dict[str, np.ndarray]:
    """``payload`` in float64, each array zero-padded at its end to its canonical shape."""
    out = {}
    for key, shape in shapes.items():
        value = np.asarray(payload[key], dtype=np.float64)
        if value.ndim != len(shape) or any(have > want for have, want in zip(value.shape, shape)):
            raise ValueError(f"{key} has shape {value.shape}, which does not fit {shape}")
        out[key] = np.pad(value, [(0, want - have) for have, want in zip(value.shape, shape)])
    return out


def flatten(payload: Payload, shapes: Shapes) -> np.ndarray:
    """One float64 vector of ``payload``'s arrays in the order of ``shapes`` (:func:`padded`)."""
    arrays = padded(payload, shapes)
    return np.concatenate([arrays[key].ravel() for key in shapes]) if shapes else np.zeros(0)


def unflatten(vector: np.ndarray, shapes: Shapes) -> dict[str, np.ndarray]:
    """The arrays of ``shapes`` from a vector :func:`flatten` made."""
    sizes = [int(np.prod(shape)) for shape in shapes.values()]
    if vector.shape != (sum(sizes),):
        raise ValueError(f"a vector of shape {vector.shape} for {sum(sizes)} values")
    out, start = {}, 0
    for (key, shape), size in zip(shapes.items(), sizes):
        out[key] = vector[start:start + size].reshape(shape)
        start += size
    return out


def update_vector(upload: Payload, download: Payload, pad_rank: int, clip_norm: float, clip_range: float) -> np.ndarray:
    """What a client masks: its update, ``upload - download`` per array (same keys and shapes),
    :func:`flatten`-ed with A and B padded to ``pad_rank``; scaled down to L2 norm ``clip_norm``
    when above it (0: never). ValueError (the client refuses to take part, a dropout the protocol
    absorbs) when the arrays do not match, an entry is not finite, or an entry is beyond
    ``clip_range`` (c: honest updates are never cut silently)."""
    if set(upload) != set(download):
        raise ValueError(f"the upload's arrays {sorted(upload)[:3]} are not the download's {sorted(download)[:3]}")
    shapes = canonical_shapes({k: tuple(np.shape(v)) for k, v in upload.items()}, pad_rank)
    update = {}
    for key, value in upload.items():
        if np.shape(value) != np.shape(download[key]):
            raise ValueError(f"{key}: uploaded shape {np.shape(value)}, downloaded {np.shape(download[key])}")
        update[key] = np.asarray(value, np.float64) - np.asarray(download[key], np.float64)
    vector = flatten(update, shapes)
    if not np.all(np.isfinite(vector)):
        raise ValueError("the update holds NaN or Inf")
    norm = float(np.linalg.norm(vector))
    if clip_norm and norm > clip_norm:
        vector *= clip_norm / norm
    largest = float(np.max(np.abs(vector))) if vector.size else 0.0
    if largest > clip_range:
        raise ValueError(f"an update entry of {largest:.4g} is beyond secure_aggregation's clipping range "
                         f"{clip_range:g}: raise secure_aggregation.clipping_range or set clip_norm")
    return vector


# ------------------------------------------------------------------ the cryptography both sides agree on
def raw_key(key: bytes) -> bytes:
    """The 32 bytes of a mask key: a private mask seed as it is, a pairwise key as Flower's
    ``generate_shared_key`` returns it (the URL-safe base64 of 32 bytes of HKDF-SHA256 output)
    decoded. ValueError for anything else."""
    raw = key if len(key) == KEY_BYTES else base64.urlsafe_b64decode(key) if len(key) == 44 else b""
    if len(raw) != KEY_BYTES:
        raise ValueError(f"a mask key must be {KEY_BYTES} bytes (or their URL-safe base64), got {len(key)} bytes")
    return raw


def mask(key: bytes, modulus_range: int, size: int) -> np.ndarray:
    """The mask of ``size`` entries a key expands to, int64 uniform on [0, M): the ChaCha20
    keystream under the whole 256-bit key (:func:`raw_key`; nonce: block counter 0 and a fixed
    label, every key being used for one mask only), read as little-endian 32-bit words, each
    reduced modulo M (a power of 2 <= 2^32, so the reduction keeps them uniform)."""
    if not 2 <= modulus_range <= 2**32 or modulus_range & (modulus_range - 1):
        raise ValueError(f"modulus_range must be a power of 2 in [2, 2^32], got {modulus_range}")
    encryptor = Cipher(algorithms.ChaCha20(raw_key(key), _MASK_NONCE), mode=None).encryptor()
    words = np.frombuffer(encryptor.update(bytes(4 * size)), dtype="<u4")
    return (words & np.uint32(modulus_range - 1)).astype(np.int64)


def _node(node: int) -> bytes:
    return int(node).to_bytes(8, "little", signed=False)  # Flower's node ids are unsigned 64-bit


def share_commitment(kind: str, owner: int, holder: int, share: bytes) -> bytes:
    """SHA-256 commitment to the share of ``owner``'s secret (``kind``: 'seed' for the private mask
    seed, 'key' for the first private key) that ``holder`` holds. The owner publishes it with its
    encrypted shares; the holder checks the share it decrypts against it, the server every share
    it receives at the unmask stage. A share of a 32-byte secret carries 384 random bits: the hash
    hides it."""
    return hashlib.sha256(b"fedlora-secagg-share\0" + kind.encode() + b"\0" + _node(owner) + _node(holder)
                          + share).digest()


def seed_commitment(owner: int, seed: bytes) -> bytes:
    """SHA-256 commitment to ``owner``'s private mask seed: a reconstruction that does not hash to it
    comes from shares the owner dealt inconsistently."""
    return hashlib.sha256(b"fedlora-secagg-seed\0" + _node(owner) + seed).digest()


def transcript(entries: Mapping[str, Any]) -> bytes:
    """SHA-256 of a round's public parameters as the setup stage sent them (canonical JSON, bytes
    as hex): every client puts it inside the shares it encrypts for its neighbours and compares
    theirs with its own, so that a server cannot give clients different counts, weights or ranges
    without their noticing."""
    def plain(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()
        return [plain(v) for v in value] if isinstance(value, list) else value

    text = json.dumps({str(k): plain(v) for k, v in entries.items()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(b"fedlora-secagg-transcript\0" + text.encode()).digest()


def public_key_problem(pem: object) -> str:
    """Why ``pem`` is not a public key of SecAgg+'s curve, SECP384R1 ('' if it is)."""
    if not isinstance(pem, bytes) or len(pem) > 1024:
        return "not a PEM public key"
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        return "not a PEM public key"
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != ec.SECP384R1().name:
        return "not a public key of curve SECP384R1"
    return ""


def _exchange(private_pem: bytes, public_pem: bytes) -> bytes:
    private = serialization.load_pem_private_key(private_pem, password=None)
    public = serialization.load_pem_public_key(public_pem)
    if not isinstance(private, ec.EllipticCurvePrivateKey) or not isinstance(public, ec.EllipticCurvePublicKey):
        raise TypeError("not elliptic-curve keys")
    return private.exchange(ec.ECDH(), public)


def possession_proof(node: int, pk1: bytes, pk2: bytes, sk1: bytes, sk2: bytes, server_pk: bytes) -> bytes:
    """A client's proof that it holds the private keys of its two public keys (PEM): an HMAC-SHA256
    of its node id and both public keys under a key derived from ECDH(sk1, S) and ECDH(sk2, S),
    S the server's one-round key. The server computes the same from its own private key; a client
    that copies another's public keys (or sends a point whose private key nobody holds) cannot."""
    secret = _exchange(sk1, server_pk) + _exchange(sk2, server_pk)
    return _proof(secret, node, pk1, pk2)


def check_possession(node: int, pk1: bytes, pk2: bytes, proof: object, server_sk: bytes) -> bool:
    """Whether ``proof`` is :func:`possession_proof` of ``node`` for these keys (the server's side)."""
    if not isinstance(proof, bytes) or len(proof) != DIGEST_BYTES:
        return False
    expected = _proof(_exchange(server_sk, pk1) + _exchange(server_sk, pk2), node, pk1, pk2)
    return hmac.compare_digest(expected, proof)


def _proof(secret: bytes, node: int, pk1: bytes, pk2: bytes) -> bytes:
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"fedlora-secagg-possession").derive(secret)
    return hmac.new(key, _node(node) + pk1 + pk2, hashlib.sha256).digest()


def weight_ratio(counts: Sequence[float], index: int, max_share: float, weighting: str) -> float:
    """A client's aggregation weight over the round's largest, w_k / W in (0, 1]: 1 when the round
    weighs its clients alike (``weighting = 'uniform'``), else its example count capped by the share
    rule (:func:`fedlora.shares.capped_weights` over the round's declared ``counts``) over the largest
    capped count. The server computes the weights it sends from the same; a client computes its own
    from its own count and refuses a server weight that departs from it."""
    if weighting == "uniform":
        return 1.0
    capped = capped_weights(counts, max_share)
    largest = float(capped.max()) if capped.size else 0.0
    return float(capped[index]) / largest if largest > 0 else 0.0


def clip_bound(clip_norm: float, max_update_norm: float) -> float:
    """C, the L2 norm every client clips its update to before masking (0: none): ``clip_norm``,
    else ``faults.max_update_norm`` (the norm above which the server would reject a plain update),
    the smaller of the two when both are set."""
    bounds = [b for b in (clip_norm, max_update_norm) if b > 0]
    return min(bounds) if bounds else 0.0


def mean_problem(mean: np.ndarray, clip_norm: float, clip_range: float, entry_error: float) -> str:
    """Why ``mean`` (the unmasked weighted mean of the summed updates, flat) cannot be a weighted
    mean of honest updates ('' if it can): an entry beyond the clipping range c, or an L2 norm
    beyond C (``clip_norm``, 0: no norm bound), each with the quantisation's slack (``entry_error``
    per entry, :func:`error_bound`). A weighted mean of vectors of norm <= C has norm <= C."""
    largest = float(np.max(np.abs(mean))) if mean.size else 0.0
    if not np.isfinite(largest) or largest > clip_range + entry_error:
        return (f"an entry of the unmasked mean is {largest:.4g}, beyond the clipping range c = {clip_range:g} "
                "that every client's update lies in")
    norm = float(np.linalg.norm(mean))
    slack = entry_error * float(np.sqrt(mean.size))
    if clip_norm and norm > clip_norm + slack:
        return (f"the unmasked mean has L2 norm {norm:.4g}, beyond the {clip_norm:g} that clipped updates can "
                "average to")
    return ""
