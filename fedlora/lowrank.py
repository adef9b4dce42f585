"""Factor-space SVD of sum_k w_k B_k A_k for many modules of one shape at once.

Same result as :func:`fedlora.lora.factor_svd` (and as the dense SVD), for a stack of modules,
computed through R x R Gram matrices instead of QR. With Bs = [w_k B_k] (d_out, R) and
As = [A_k] (R, d_in), so that G = Bs As:

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
ones as zero (float64: above ~1e-7).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import scipy.linalg

from fedlora.lora import LowRankSVD


def stack_factors(
    Bs: Sequence[np.ndarray], As: Sequence[np.ndarray], weights: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """[w_k B_k] along the rank axis and [A_k] along it: (..., d_out, R) and (..., R, d_in)."""
    B = np.concatenate([np.float32(w) * B if B.dtype == np.float32 else w * B for w, B in zip(weights, Bs)], axis=-1)
    A = np.concatenate(list(As), axis=-2)
    return B, A


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
