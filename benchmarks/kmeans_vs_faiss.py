"""Product-quantizer fitting: million-jax k-means vs faiss-cpu ProductQuantizer.

Same data, same number of Lloyd iterations, one init each. The data mimics
real key/value vectors: Gaussian rows with a few heavy-tailed outlier channels
(Student-t, large scale), which is what makes KV quantization hard.

faiss subsamples to 256 points per centroid by default; here it is told to use
every point (``max_points_per_centroid``), so both fit the same data.

    python benchmarks/kmeans_vs_faiss.py --json results.json
    python benchmarks/kmeans_vs_faiss.py --small     # quick case only
"""
from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from _results import write_results
from million_jax.pq import encode, decode, fit_codebooks


def kv_like(n: int, d: int, seed: int, outlier_channels: int = 4) -> np.ndarray:
    """float32[n, d]: N(0,1) channels with per-channel scales, plus heavy-tailed outliers."""
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.5, 2.0, size=d)
    x = rng.standard_normal((n, d)) * scales
    chans = rng.choice(d, size=min(outlier_channels, d), replace=False)
    x[:, chans] = rng.standard_t(df=2.0, size=(n, len(chans))) * 8.0 + 5.0
    return x.astype(np.float32)


def fit_ours(x: np.ndarray, M: int, nbits: int, iters: int, seed: int):
    key = jax.random.PRNGKey(seed)
    t0 = time.perf_counter()
    cb = fit_codebooks(x, M, nbits, key=key, iters=iters)
    codes = encode(cb, x)
    jax.block_until_ready(codes)
    secs = time.perf_counter() - t0
    mse = float(np.mean((decode(cb, codes) - x) ** 2))
    return mse, secs


def fit_faiss(x: np.ndarray, M: int, nbits: int, iters: int, seed: int):
    import faiss

    n, d = x.shape
    t0 = time.perf_counter()
    pq = faiss.ProductQuantizer(d, M, nbits)
    pq.cp.niter = iters
    pq.cp.seed = seed
    pq.cp.max_points_per_centroid = max(1, n // (2**nbits) + 1)  # use all points
    pq.verbose = False
    pq.train(x)
    codes = pq.compute_codes(x)
    secs = time.perf_counter() - t0
    mse = float(np.mean((pq.decode(codes) - x) ** 2))
    return mse, secs


def run_case(name: str, n: int, d: int, M: int, nbits: int, iters: int, seed: int) -> dict:
    x = kv_like(n, d, seed)
    # Compile once on the same shapes so the timing is of the fit, not of XLA.
    t0 = time.perf_counter()
    fit_ours(x, M, nbits, iters, seed + 1)
    compile_and_first = time.perf_counter() - t0
    mse_ours, s_ours = fit_ours(x, M, nbits, iters, seed)
    mse_faiss, s_faiss = fit_faiss(x, M, nbits, iters, seed)
    return {
        "case": name,
        "n": n,
        "d": d,
        "M": M,
        "nbits": nbits,
        "iters": iters,
        "mse_ours": mse_ours,
        "mse_faiss": mse_faiss,
        "mse_ratio": mse_ours / mse_faiss,
        "seconds_ours": s_ours,
        "seconds_ours_first_call": compile_and_first,
        "seconds_faiss": s_faiss,
        "time_ratio": s_ours / s_faiss,
    }


CASES = {
    "small": dict(n=20_000, d=64, M=32, nbits=6, iters=25),
    "large": dict(n=200_000, d=128, M=64, nbits=8, iters=25),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write results to this JSON file")
    ap.add_argument("--small", action="store_true", help="run only the small case")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import faiss  # noqa: F401
    except ImportError:
        print("faiss-cpu is not installed: pip install faiss-cpu", file=sys.stderr)
        return 2
    names = ["small"] if args.small else ["small", "large"]
    rows = [run_case(n, seed=args.seed, **CASES[n]) for n in names]
    hdr = f"{'case':6} {'N':>8} {'d':>4} {'M':>3} {'bits':>4} {'mse ours':>10} {'mse faiss':>10} {'ratio':>6} {'s ours':>8} {'s faiss':>8} {'t ratio':>7}"
    print(hdr)
    for r in rows:
        print(
            f"{r['case']:6} {r['n']:8d} {r['d']:4d} {r['M']:3d} {r['nbits']:4d} {r['mse_ours']:10.5f} "
            f"{r['mse_faiss']:10.5f} {r['mse_ratio']:6.3f} {r['seconds_ours']:8.2f} {r['seconds_faiss']:8.2f} {r['time_ratio']:7.2f}"
        )
    if args.json:
        write_results(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
