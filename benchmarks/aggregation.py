"""One FlexLoRA aggregation round on a LLaMA-7B-shaped adapter set: factor space vs dense SVD.

Default shape: 64 modules of 4096 x 4096 (32 layers x q, v), 20 clients of rank 16, float32
(stacked rank R = 320). Both paths compute, per module, the SVD of G = sum_k p_k s_k B_k A_k and
hand every client its rank-16 factors (B_k = U_r S_r / s_k, A_k = V_r^T):

- factor space: ``strategies.flexlora.flexlora_aggregate`` (what the strategy runs: leading r_max = r
  components only, with
  ``strategy.svd_dtype = float32``): Gram matrices of the stacked factors, R x R
  eigendecompositions and SVD, never a d_out x d_in matrix. Timed on every module.
- dense: what the reference implementations do: form G (d_out x d_in) and take its SVD
  (``numpy.linalg.svd``, float32). Timed on ``--dense-modules`` modules (the dense SVD of one
  4096 x 4096 matrix takes about a minute on 2 cores) and scaled to the full module count.

The last line is ``factor_seconds=<total> dense_seconds=<total> speedup=<ratio>``.

    python benchmarks/aggregation.py            # 7B shape (~2 minutes on 2 cores)
    python benchmarks/aggregation.py --quick    # 8 modules of 512 x 512, 5 clients of rank 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedlora.lora import Factors
from strategies.flexlora import flexlora_aggregate, flexlora_factors


def make_clients(modules: int, d: int, rank: int, clients: int, seed: int) -> list[dict[str, Factors]]:
    """Random float32 client factors (B scaled as after a few local steps)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clients):
        A = rng.standard_normal((modules, rank, d), dtype=np.float32) / np.float32(np.sqrt(d))
        B = rng.standard_normal((modules, d, rank), dtype=np.float32) * np.float32(0.01)
        out.append({f"layer.{m}": Factors(A[m], B[m]) for m in range(modules)})
    return out


def factor_round(clients: list[dict[str, Factors]], weights: np.ndarray, scale: float, rank: int):
    svds = flexlora_aggregate(clients, weights, [scale] * len(clients), dtype=np.float32, rank=rank)
    pushed = {m: flexlora_factors(svd, rank, scale) for m, svd in svds.items()}  # one rank: shared by clients
    return svds, pushed


def dense_module(clients: list[dict[str, Factors]], module: str, weights: np.ndarray, scale: float, rank: int):
    G = np.zeros((clients[0][module].B.shape[0], clients[0][module].A.shape[1]), dtype=np.float32)
    for w, c in zip(weights, clients):
        G += np.float32(w * scale) * (c[module].B @ c[module].A)  # (d_out, d_in)
    U, S, Vt = np.linalg.svd(G, full_matrices=False)
    return S, Factors(Vt[:rank], U[:, :rank] * (S[:rank] / scale))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shape: 8 modules of 512 x 512, 5 clients, rank 8")
    parser.add_argument("--modules", type=int, default=64)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--dense-modules", type=int, default=1, help="modules the dense path is timed on")
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.modules, args.dim, args.rank, args.clients, args.dense_modules = 8, 512, 8, 5, 2
    dense_modules = min(args.dense_modules, args.modules)
    scale = args.alpha / args.rank
    print(f"shape: {args.modules} modules of {args.dim} x {args.dim}, {args.clients} clients of rank {args.rank}, "
          f"float32, stacked rank {args.clients * args.rank}")
    clients = make_clients(args.modules, args.dim, args.rank, args.clients, args.seed)
    weights = np.random.default_rng(args.seed + 1).uniform(0.5, 1.5, args.clients)
    weights /= weights.sum()

    warm = make_clients(2, 64, 2, 2, args.seed)  # first LAPACK calls pay a one-off set-up: not timed
    factor_round(warm, np.array([0.5, 0.5]), scale, 2), dense_module(warm, "layer.0", np.array([0.5, 0.5]), scale, 2)

    started = time.perf_counter()
    svds, pushed = factor_round(clients, weights, scale, args.rank)
    factor_seconds = time.perf_counter() - started
    print(f"factor space: {factor_seconds:.2f} s for all {args.modules} modules")

    dense_measured, worst_sv, worst_fit = 0.0, 0.0, 0.0
    for module in list(svds)[:dense_modules]:
        started = time.perf_counter()
        S, dense_factors = dense_module(clients, module, weights, scale, args.rank)
        dense_measured += time.perf_counter() - started
        top = min(args.rank, len(S))
        worst_sv = max(worst_sv, float(np.max(np.abs(svds[module].S[:top] - S[:top]) / S[0])))
        fast, ref = pushed[module], dense_factors
        delta_ref = ref.B.astype(np.float64) @ ref.A
        gap = np.linalg.norm(fast.B.astype(np.float64) @ fast.A - delta_ref) / np.linalg.norm(delta_ref)
        worst_fit = max(worst_fit, float(gap))
    dense_seconds = dense_measured / dense_modules * args.modules
    print(f"dense SVD: {dense_measured:.2f} s measured on {dense_modules} of {args.modules} modules, "
          f"scaled x{args.modules / dense_modules:g} to {dense_seconds:.1f} s")
    print(f"agreement on the measured modules: top-{args.rank} singular values max rel. diff {worst_sv:.1e}, "
          f"pushed rank-{args.rank} update rel. diff {worst_fit:.1e}")
    print(f"factor_seconds={factor_seconds:.2f} dense_seconds={dense_seconds:.1f} speedup={dense_seconds / factor_seconds:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
