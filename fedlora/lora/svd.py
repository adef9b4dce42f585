"""SVD of a weighted sum of low-rank products, in factor space (one implementation, the fast one).

G = sum_k w_k B_k A_k is never formed when the stacked rank R = sum r_k is below min(d_out, d_in).
With Bs = [w_k B_k] (d_out, R) and As = [A_k] (R, d_in), so that G = Bs As:

1. Bs^T Bs = W L W^T (symmetric eigendecomposition). Q = Bs W L^-1/2 has orthonormal columns
   and G = Q C with C = L^1/2 W^T As (R, d_in).
2. C C^T = L^1/2 W^T (As As^T) W L^1/2 = X S^2 X^T (R x R, symmetric): only the k leading
   eigenpairs are computed (LAPACK's subset driver), so the k leading singular triplets of G are
   U_k = Q X_k, S_k and V_k^T = S_k^-1 X_k^T C.

Cost O(d R^2) per module: two BLAS-3 Gram products, one full and one partial R x R
eigendecomposition, and two thin back-projections (about 3x faster than a QR of the stacks plus
an SVD of the core on 4096 x 320 stacks, see benchmarks/aggregation.py). Directions with a zero
eigenvalue (rank-deficient stacks: zero B at the start, clients that share A) drop out exactly.
Precision: the arithmetic runs in the inputs' dtype; since the singular values come out squared,
float32 gives singular values above ~1e-3 of the largest to float32 accuracy and treats smaller
ones as zero (float64: above ~1e-7). When R >= min(d_out, d_in) stacking buys nothing and the
dense SVD is taken instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import scipy.linalg

from fedlora import state
from fedlora.lora.factors import Factors, pad_rank


@state.register
class LowRankSVD(NamedTuple):
    """Thin SVD G = U diag(S) Vt with U (d_out, k), S (k,), Vt (k, d_in)."""

    U: np.ndarray
    S: np.ndarray
    Vt: np.ndarray


def stack_factors(
    Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """[w_k B_k] along the rank axis and [A_k] along it: (..., d_out, R) and (..., R, d_in)."""
    B = np.concatenate([np.float32(w) * B if B.dtype == np.float32 else w * B for w, B in zip(weights, Bs)], axis=-1)
    A = np.concatenate(list(As), axis=-2)
    return B, A


def factor_svd(
    Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float], rank: int | None = None
) -> LowRankSVD:
    """Thin SVD of G = sum_k w_k B_k A_k for one module (k = ``rank`` leading components, default
    all R). Weights may be negative (e.g. an "unbiased" update subtracting the previous push)."""
    w = np.asarray(weights, dtype=np.float64)
    B = np.concatenate([wk * np.asarray(Bk, np.float64) for wk, Bk in zip(w, Bs)], axis=1)  # (d_out, R)
    A = np.concatenate([np.asarray(Ak, np.float64) for Ak in As], axis=0)  # (R, d_in)
    if A.shape[0] >= min(B.shape[0], A.shape[1]):  # stacking buys nothing: the dense SVD is no bigger
        U, S, Vt = np.linalg.svd(B @ A, full_matrices=False)
        return LowRankSVD(U[:, :rank], S[:rank], Vt[:rank])
    svd = batched_factor_svd(B[None], A[None], rank)
    return LowRankSVD(svd.U[0], svd.S[0], svd.Vt[0])


def batched_factor_svd(B: np.ndarray, A: np.ndarray, rank: int | None = None) -> LowRankSVD:
    """Thin SVD of G_m = B_m A_m for every module m of a stack, never forming G_m.

    ``B`` (M, d_out, R) and ``A`` (M, R, d_in) are the stacked (already weighted) factors. Returns
    U (M, d_out, k), S (M, k) (descending), Vt (M, k, d_in) with k = ``rank`` (default R) leading
    components; asking for fewer components computes only those.
    """
    R = B.shape[-1]
    k = R if rank is None else min(rank, R)
    gram_B = np.matmul(B.transpose(0, 2, 1), B)  # (M, R, R)
    gram_A = np.matmul(A, A.transpose(0, 2, 1))  # (M, R, R)
    lam, W = _eigh_each(gram_B, R)  # Bs^T Bs = W L W^T
    root, inv_root = _roots(lam, R)
    W_root = W * root[:, None, :]  # W L^1/2
    core_gram = np.matmul(W_root.transpose(0, 2, 1), np.matmul(gram_A, W_root))  # C C^T, (M, R, R)
    S2, X = _eigh_each(core_gram, k)  # k leading eigenpairs: S^2, X (M, R, k)
    S, inv_S = _roots(S2, R)
    to_U = np.matmul(W * inv_root[:, None, :], X)  # U = Bs W L^-1/2 X, (M, R, k)
    to_Vt = (np.matmul(W_root, X) * inv_S[:, None, :]).transpose(0, 2, 1)  # V^T = S^-1 X^T L^1/2 W^T As
    return LowRankSVD(np.matmul(B, to_U), S, np.matmul(np.ascontiguousarray(to_Vt), A))


def _eigh_each(gram: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest eigenpairs of every symmetric matrix of a stack, in descending order.

    scipy's drivers, one matrix at a time: numpy's batched eigh has no subset option and its
    full driver is slower than 'evd' at R = 320 (benchmarks/aggregation.py).
    """
    M, R = gram.shape[0], gram.shape[-1]
    lam, vec = np.empty((M, k), gram.dtype), np.empty((M, R, k), gram.dtype)
    for m in range(M):
        if k == R:
            values, vectors = scipy.linalg.eigh(gram[m], driver="evd", check_finite=False)
        else:
            values, vectors = scipy.linalg.eigh(gram[m], subset_by_index=[R - k, R - 1], driver="evr", check_finite=False)
        lam[m], vec[m] = values[::-1], vectors[:, ::-1]
    return lam, vec


def _roots(lam: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(lambda) and its inverse, with eigenvalues at round-off level treated as exact zeros.

    ``lam`` holds (some of) the eigenvalues of size x size symmetric matrices, largest first.
    """
    lam = np.maximum(lam, 0.0)
    tol = lam[..., :1] * size * np.finfo(lam.dtype).eps
    keep = lam > tol
    root = np.where(keep, np.sqrt(lam), 0.0).astype(lam.dtype)
    inv = np.where(keep, 1.0 / np.where(keep, root, 1.0), 0.0).astype(lam.dtype)
    return root, inv


def dense_svd(Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float]) -> LowRankSVD:
    """Reference for tests: SVD of the dense d_out x d_in sum (what reference implementations do)."""
    G = sum(wk * (np.asarray(B, np.float64) @ np.asarray(A, np.float64)) for wk, B, A in zip(weights, Bs, As))
    U, S, Vt = np.linalg.svd(G, full_matrices=False)
    return LowRankSVD(U, S, Vt)


def trim(svd: LowRankSVD, rtol: float = 1e-8) -> LowRankSVD:
    """Drop the numerically zero singular components (keeps a global rank from growing)."""
    if len(svd.S) == 0 or svd.S[0] <= 0:
        return LowRankSVD(svd.U[:, :0], svd.S[:0], svd.Vt[:0])
    keep = int(np.sum(svd.S > rtol * svd.S[0]))
    return LowRankSVD(svd.U[:, :keep], svd.S[:keep], svd.Vt[:keep])


def split_spectrum(svd: LowRankSVD, rank: int, scale: float) -> Factors:
    """Rank-``rank`` factors with scale * B A = U_r S_r V_r^T, the spectrum split evenly:
    B = U_r diag(sqrt(S_r / s)), A = diag(sqrt(S_r / s)) V_r^T (FedHera's push)."""
    rank = min(rank, len(svd.S))
    root = np.sqrt(np.maximum(svd.S[:rank], 0.0) / scale)  # (rank,)
    B = (svd.U[:, :rank] * root).astype(np.float32)  # (d_out, rank)
    A = (root[:, None] * svd.Vt[:rank]).astype(np.float32)  # (rank, d_in)
    return Factors(A, B)


def leading_factors(svd: LowRankSVD, rank: int, scale: float) -> Factors:
    """Rank-``rank`` factors with B = U_r S_r / s, A = V_r^T, so s B A = U_r S_r V_r^T, zero-padded
    when G has fewer components (s B A unchanged): FlexLoRA's download."""
    r = min(rank, len(svd.S))
    B = (svd.U[:, :r] * (svd.S[:r] / scale)).astype(np.float32)  # (d_out, r)
    A = svd.Vt[:r].astype(np.float32)  # (r, d_in)
    return pad_rank(Factors(A, B), rank)
