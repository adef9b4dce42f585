"""One FlexLoRA aggregation round on a LLaMA-7B-shaped adapter set: factor space vs dense SVD.

Default shape: 64 modules of 4096 x 4096 (32 layers x q, v), 20 clients of rank 16, float32
(stacked rank R = 320). Both paths compute, per module, the SVD of G = sum_k p_k s_k B_k A_k and
hand every client its rank-16 factors (B_k = U_r S_r / s_k, A_k = V_r^T):

- factor space: :func:`fedlora.methods.flexlora.flexlora_aggregate` (what the strategy runs:
  leading r_max = r components only, with ``strategy.svd_dtype = float32``) and
  :func:`fedlora.lora.leading_factors`: Gram matrices of the stacked factors, R x R
  eigendecompositions, never a d_out x d_in matrix. Timed on every module.
- dense: what the reference implementations do: form G (d_out x d_in) and take its SVD
  (``numpy.linalg.svd``, float32). Timed on ``--dense-modules`` modules (the dense SVD of one
  4096 x 4096 matrix takes about half a minute on 2 cores) and scaled to the full module count.

The two arms run interleaved through :mod:`harness` (benchmarks/harness.py; one warm-up each, then
factor dense factor dense ..., ``--repeat`` times, default 5); the report gives min / median / max
per arm, and the JSON record (``benchmarks/results/aggregation.json`` by default) every run and the
machine. The last line is ``factor_seconds=<median> dense_seconds=<median> speedup=<ratio of the
medians> spread=<max/min of the per-pair speedups>``.

    python benchmarks/aggregation.py                # 7B shape: 6 runs per arm; the dense SVD of one module
                                                    # took 18 s on 2 idle cores (docs/results/baselines.md)
    python benchmarks/aggregation.py --quick        # 8 modules of 512 x 512, 5 clients of rank 8 (seconds)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the repository, then benchmarks/ (for harness)

import harness

from fedlora.lora import Factors, LowRankSVD, leading_factors
from fedlora.methods.flexlora import flexlora_aggregate

Clients = list[dict[str, Factors]]


def make_clients(modules: int, d: int, rank: int, clients: int, seed: int) -> Clients:
    """Random float32 client factors (B scaled as after a few local steps)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(clients):
        A = rng.standard_normal((modules, rank, d), dtype=np.float32) / np.float32(np.sqrt(d))
        B = rng.standard_normal((modules, d, rank), dtype=np.float32) * np.float32(0.01)
        out.append({f"layer.{m}": Factors(A[m], B[m]) for m in range(modules)})
    return out


def factor_round(clients: Clients, weights: np.ndarray, scale: float,
                 rank: int) -> tuple[dict[str, LowRankSVD], dict[str, Factors]]:
    """What the strategy runs: factor-space SVD of every module, then every client's download."""
    svds = flexlora_aggregate(clients, weights, [scale] * len(clients), dtype=np.float32, rank=rank)
    pushed = {m: leading_factors(svd, rank, scale) for m, svd in svds.items()}  # one rank: shared by clients
    return svds, pushed


def dense_module(clients: Clients, module: str, weights: np.ndarray, scale: float,
                 rank: int) -> tuple[np.ndarray, Factors]:
    """The reference implementations' path for one module: form G, full SVD, rank-r factors."""
    G = np.zeros((clients[0][module].B.shape[0], clients[0][module].A.shape[1]), dtype=np.float32)
    for w, c in zip(weights, clients, strict=True):
        G += np.float32(w * scale) * (c[module].B @ c[module].A)  # (d_out, d_in)
    U, S, Vt = np.linalg.svd(G, full_matrices=False)
    return S, Factors(Vt[:rank], U[:, :rank] * (S[:rank] / scale))


def agreement(clients: Clients, weights: np.ndarray, scale: float, rank: int,
              modules: list[str]) -> tuple[float, float]:
    """Untimed check that both paths agree on ``modules``: the worst relative difference of the top
    singular values, and of the pushed rank-r update B A."""
    svds, pushed = factor_round(clients, weights, scale, rank)
    worst_sv = worst_fit = 0.0
    for module in modules:
        S, ref = dense_module(clients, module, weights, scale, rank)
        top = min(rank, len(S))
        worst_sv = max(worst_sv, float(np.max(np.abs(svds[module].S[:top] - S[:top]) / S[0])))
        delta_ref = ref.B.astype(np.float64) @ ref.A
        fast = pushed[module]
        gap = np.linalg.norm(fast.B.astype(np.float64) @ fast.A - delta_ref) / np.linalg.norm(delta_ref)
        worst_fit = max(worst_fit, float(gap))
    return worst_sv, worst_fit


def blas_threads() -> int:
    """The threads numpy's BLAS / LAPACK runs on (threadpoolctl; 0 when it cannot tell)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return 0
    return max((int(pool.get("num_threads", 0)) for pool in threadpool_info() if pool.get("user_api") == "blas"),
               default=0)


# what the arms may differ in: the method, and how many modules the dense arm times (then scaled)
VARIES = ("method", "modules_timed")


def arms(clients: Clients, weights: np.ndarray, scale: float, rank: int,
         dense_modules: int) -> dict[str, harness.Arm]:
    """The two arms: ``factor`` times every module, ``dense`` times ``dense_modules`` modules and
    scales to all of them (``seconds`` is comparable across arms, ``measured_seconds`` is raw);
    each run reports what it ran at (harness.Run: shape, dtype, BLAS threads)."""
    modules = list(clients[0])
    first = clients[0][modules[0]]
    shape = {"modules": len(modules), "d_out": int(first.B.shape[0]), "d_in": int(first.A.shape[1]), "rank": rank,
             "clients": len(clients), "dtype": str(first.A.dtype)}

    def settings(method: str, timed: int) -> dict[str, object]:
        return {"method": method, "modules_timed": timed, "threads": blas_threads(), **shape}

    def factor() -> harness.Run:
        started = time.perf_counter()
        factor_round(clients, weights, scale, rank)
        return harness.Run({"seconds": time.perf_counter() - started}, settings("factor space", len(modules)))

    def dense() -> harness.Run:
        started = time.perf_counter()
        for module in modules[:dense_modules]:
            dense_module(clients, module, weights, scale, rank)
        measured = time.perf_counter() - started
        return harness.Run({"seconds": measured / dense_modules * len(modules), "measured_seconds": measured},
                           settings("dense SVD", dense_modules))

    return {"factor": factor, "dense": dense}


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
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.modules, args.dim, args.rank, args.clients, args.dense_modules = 8, 512, 8, 5, 2
    harness.settle(args, "aggregation", quick=args.quick)
    env = harness.environment(args.note)
    dense_modules = min(args.dense_modules, args.modules)
    scale = args.alpha / args.rank
    print(f"shape: {args.modules} modules of {args.dim} x {args.dim}, {args.clients} clients of rank {args.rank}, "
          f"float32, stacked rank {args.clients * args.rank}; dense timed on {dense_modules} module(s) and scaled "
          f"x{args.modules / dense_modules:g}; {args.warmup} warm-up + {args.repeat} interleaved runs per arm",
          flush=True)
    clients = make_clients(args.modules, args.dim, args.rank, args.clients, args.seed)
    weights = np.random.default_rng(args.seed + 1).uniform(0.5, 1.5, args.clients)
    weights /= weights.sum()

    measured = harness.run_interleaved(arms(clients, weights, scale, args.rank, dense_modules),
                                       repeat=args.repeat, warmup=args.warmup, varies=VARIES)
    worst_sv, worst_fit = agreement(clients, weights, scale, args.rank, list(clients[0])[:dense_modules])
    comparison = harness.compare(measured, "dense", "factor", "seconds")
    print(harness.report(measured, comparison))
    print(f"agreement on the dense-timed modules: top-{args.rank} singular values max rel. diff {worst_sv:.1e}, "
          f"pushed rank-{args.rank} update rel. diff {worst_fit:.1e}")
    last = (f"factor_seconds={comparison.denominator_median:.3f} dense_seconds={comparison.numerator_median:.1f} "
            f"speedup={comparison.ratio:.0f} spread={comparison.spread:.2f}")
    extra = {"singular_values_max_rel_diff": worst_sv, "pushed_update_rel_diff": worst_fit}
    return harness.finish("aggregation", args, measured, comparison, last, extra, env)


if __name__ == "__main__":
    raise SystemExit(main())
