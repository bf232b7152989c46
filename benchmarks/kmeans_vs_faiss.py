"""Product-quantizer fitting: million-jax k-means vs faiss-cpu ProductQuantizer.

Same data, same number of Lloyd iterations, one init each. The data mimics
real key/value vectors: Gaussian rows with a few heavy-tailed outlier channels
(Student-t, large scale), which is what makes KV quantization hard.

faiss subsamples to 256 points per centroid by default; here it is told to use
every point (``max_points_per_centroid``), so both fit the same data.

Real-model rows (``--real``): post-RoPE keys and values of SmolLM2-135M over 16,384 tokens
of the built-in calibration text, 9 (layer, KV head) sets of each (layers 0-2), every set a
[16384, 64] problem split into M subspaces. There the fit is also timed against a plain
batched C Lloyd (``c_lloyd.py``: random init, exact assignment, OpenMP over problems) and a
plain NumPy Lloyd, on the same problems and iterations, plus a grid of K (16..4096) and
sub-vector widths (2, 4) against the C Lloyd.

    python benchmarks/kmeans_vs_faiss.py --json results.json
    python benchmarks/kmeans_vs_faiss.py --small     # quick case only
    python benchmarks/kmeans_vs_faiss.py --real --json benchmarks/results/kmeans_real_cpu.json
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from _results import write_results
from c_lloyd import c_lloyd
from million_jax.quant.kmeans import assign, kmeans
from million_jax.quant.pq import encode, decode, fit_codebooks


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


def numpy_lloyd(x: np.ndarray, k: int, iters: int, seed: int) -> np.ndarray:
    """Plain Lloyd in NumPy, one problem at a time: x float32[P, N, d] -> float32[P, k, d]."""
    rng = np.random.default_rng(seed)
    out = []
    for xp in x:
        c = xp[rng.choice(len(xp), size=k, replace=False)].copy()
        for _ in range(iters):
            d2 = (xp * xp).sum(1)[:, None] - 2 * xp @ c.T + (c * c).sum(1)[None, :]
            idx = d2.argmin(1)
            counts = np.bincount(idx, minlength=k)
            sums = np.zeros_like(c)
            np.add.at(sums, idx, xp)
            keep = counts > 0
            c[keep] = sums[keep] / counts[keep, None]
        out.append(c)
    return np.stack(out)


def sub_mse(x: np.ndarray, c: np.ndarray) -> float:
    """Mean squared error per element of x float[P, N, d] against its nearest of c [P, K, d]."""
    mind = jax.jit(jax.vmap(lambda a, b: assign(a, b)[1]))(jnp.asarray(x), jnp.asarray(c))
    return float(jnp.sum(mind)) / x.size


def real_kv(tokens: int = 16384) -> tuple[np.ndarray, np.ndarray]:
    """SmolLM2's post-RoPE keys / values of layers 0-2: float32[9, tokens, 64] each."""
    from million_app.calibrate import collect_model_kv
    from million_app.corpus import read_text
    from million_app.loading import open_model, tokenize

    model = open_model("smollm2")
    k, v = collect_model_kv(model, tokenize(model, read_text("builtin:calib")), max_tokens=tokens)
    return k[:3].reshape(9, -1, k.shape[-1]), v[:3].reshape(9, -1, v.shape[-1])


def subspaces(x: np.ndarray, dsub: int) -> np.ndarray:
    """float[S, N, d] -> float[S * d / dsub, N, dsub] (one k-means problem per set and subspace)."""
    s, n, d = x.shape
    return np.ascontiguousarray(x.reshape(s, n, d // dsub, dsub).transpose(0, 2, 1, 3).reshape(-1, n, dsub))


def _timed(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def run_real(seed: int, iters: int = 25, grid_iters: int = 10, grid_only: bool = False) -> list[dict]:
    """Rows on SmolLM2 keys/values: ours vs faiss vs C Lloyd vs NumPy Lloyd, then the K x dsub grid."""
    rows = []
    keys, values = real_kv()
    for kind, x in () if grid_only else (("keys", keys), ("values", values)):
        M, nbits = 32, 8
        probs = subspaces(x, x.shape[-1] // M)
        fit = lambda s: kmeans(jnp.asarray(probs), 2**nbits, key=jax.random.PRNGKey(s), iters=iters).centroids  # noqa: E731
        fit(seed + 1)  # compile
        ours, s_ours = _timed(lambda: fit(seed))
        c_c, s_c = _timed(lambda: c_lloyd(probs, 2**nbits, iters=iters, seed=seed))
        sub = probs[:M]  # NumPy is slow: one set (M problems), time scaled per problem
        c_np, s_np = _timed(lambda: numpy_lloyd(sub, 2**nbits, iters, seed))
        mse_faiss, s_faiss = 0.0, 0.0
        for i in range(x.shape[0]):
            m, s = fit_faiss(np.ascontiguousarray(x[i]), M, nbits, iters, seed)
            mse_faiss, s_faiss = mse_faiss + m / x.shape[0], s_faiss + s
        rows.append({"case": f"smollm2-{kind}", "sets": x.shape[0], "n": x.shape[1], "d": x.shape[2], "M": M,
                     "nbits": nbits, "iters": iters, "problems": probs.shape[0],
                     "mse_ours": sub_mse(probs, ours), "mse_c_lloyd": sub_mse(probs, c_c), "mse_faiss": mse_faiss,
                     "mse_numpy_lloyd_first_set": sub_mse(sub, c_np), "mse_ours_first_set": sub_mse(sub, ours[:M]),
                     "seconds_ours": s_ours, "seconds_c_lloyd": s_c, "seconds_faiss": s_faiss,
                     "seconds_numpy_lloyd_scaled": s_np * probs.shape[0] / M,
                     "time_ratio_c_lloyd": s_ours / s_c, "time_ratio_faiss": s_ours / s_faiss})
        print(rows[-1], flush=True)
    for dsub in (2, 4):
        for nbits in (4, 8, 12):
            probs = subspaces(keys[:1], dsub)          # one key set
            k = 2**nbits
            fit = lambda s: kmeans(jnp.asarray(probs), k, key=jax.random.PRNGKey(s), iters=grid_iters).centroids  # noqa: E731,B023
            fit(seed + 1)
            ours, s_ours = _timed(lambda: fit(seed))  # noqa: B023
            c_c, s_c = _timed(lambda: c_lloyd(probs, k, iters=grid_iters, seed=seed))  # noqa: B023
            rows.append({"case": f"grid-dsub{dsub}-K{k}", "problems": probs.shape[0], "n": probs.shape[1],
                         "d": dsub, "nbits": nbits, "iters": grid_iters,
                         "mse_ours": sub_mse(probs, ours), "mse_c_lloyd": sub_mse(probs, c_c),
                         "seconds_ours": s_ours, "seconds_c_lloyd": s_c, "time_ratio_c_lloyd": s_ours / s_c})
            print(rows[-1], flush=True)
    return rows


CASES = {
    "small": dict(n=20_000, d=64, M=32, nbits=6, iters=25),
    "large": dict(n=200_000, d=128, M=64, nbits=8, iters=25),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write results to this JSON file")
    ap.add_argument("--small", action="store_true", help="run only the small case")
    ap.add_argument("--real", action="store_true", help="SmolLM2 keys/values + C / NumPy Lloyd + K grid")
    ap.add_argument("--grid-only", action="store_true", help="with --real: only the K x sub-vector grid")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import faiss  # noqa: F401
    except ImportError:
        print("faiss-cpu is not installed: pip install faiss-cpu", file=sys.stderr)
        return 2
    if args.real:
        rows = run_real(args.seed, grid_only=args.grid_only)
        if args.json:
            write_results(args.json, rows, load_avg_1min=os.getloadavg()[0])
        return 0
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
