"""Factor-space SVD of sum_k w_k B_k A_k for many modules of one shape at once.

Same result as :func:`fedlora.lora.factor_svd` (and as the dense SVD), for a stack of modules,
computed through the R x R Gram matrices instead of QR: with Bs = [w_k B_k] (d_out, R) and
As = [A_k] (R, d_in), write Bs^T Bs = W_b L_b W_b^T and As As^T = W_a L_a W_a^T (symmetric
eigendecompositions). Then Q_b = Bs W_b L_b^-1/2 and Q_a = As^T W_a L_a^-1/2 have orthonormal
columns and G = Bs As = Q_b C Q_a^T with the small core C = L_b^1/2 W_b^T W_a L_a^1/2 (R, R).
The SVD C = X S Y^T gives G = (Q_b X) S (Q_a Y)^T. Cost O(d R^2) per module, one BLAS-3 Gram
product per side instead of a Householder QR (about 20x faster on 4096 x 320 stacks), and
directions with a zero eigenvalue (rank-deficient stacks, e.g. clients that share A) drop out
exactly. Precision: the arithmetic runs in the inputs' dtype; float32 keeps singular values
above ~1e-3 of the largest to float32 accuracy (the Gram matrix squares the condition number).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
    U (M, d_out, k), S (M, k), Vt (M, k, d_in) with k = ``rank`` (default R) leading components;
    asking for fewer components saves the back-rotation of the rest.
    """
    R = B.shape[-1]
    k = R if rank is None else min(rank, R)
    gram_B = np.matmul(B.transpose(0, 2, 1), B)  # (M, R, R)
    gram_A = np.matmul(A, A.transpose(0, 2, 1))  # (M, R, R)
    lam_B, W_B = np.linalg.eigh(gram_B)  # ascending eigenvalues, (M, R), (M, R, R)
    lam_A, W_A = np.linalg.eigh(gram_A)
    root_B, inv_B = _roots(lam_B)
    root_A, inv_A = _roots(lam_A)
    core = np.matmul(root_B[:, :, None] * W_B.transpose(0, 2, 1), W_A * root_A[:, None, :])  # (M, R, R)
    X, S, Yt = np.linalg.svd(core)  # (M, R, R), (M, R), (M, R, R)
    U = np.matmul(B, np.matmul(W_B * inv_B[:, None, :], X[:, :, :k]))  # (M, d_out, k)
    Vt = np.matmul(np.matmul(Yt[:, :k, :], inv_A[:, :, None] * W_A.transpose(0, 2, 1)), A)  # (M, k, d_in)
    return LowRankSVD(U, S[:, :k], Vt)


def _roots(lam: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(lambda) and its inverse, with eigenvalues at round-off level treated as exact zeros."""
    lam = np.maximum(lam, 0.0)
    tol = lam.max(axis=-1, keepdims=True) * lam.shape[-1] * np.finfo(lam.dtype).eps
    keep = lam > tol
    root = np.where(keep, np.sqrt(lam), 0.0).astype(lam.dtype)
    inv = np.where(keep, 1.0 / np.where(keep, root, 1.0), 0.0).astype(lam.dtype)
    return root, inv
