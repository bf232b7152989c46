"""A plain batched Lloyd k-means in C (OpenMP over problems): the speed bar for our k-means.

Random init (K distinct points of each problem), exact assignment by full distance
evaluation, mean update, empty clusters keep their centroid; no bounds, no subsampling.
Compiled on first use with the system's C compiler (``cc -O3 -march=native -fopenmp``) into
a temporary directory and loaded with ctypes. Benchmark-only code, not part of the package.

    from c_lloyd import c_lloyd
    centroids = c_lloyd(x, k, iters=25, seed=0)      # x float32[P, N, d] -> float32[P, K, d]
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import tempfile

import numpy as np

_SOURCE = r"""
#include <float.h>
#include <stdlib.h>
#include <string.h>

/* x: [P, N, D] row-major, c: [P, K, D] (in: init, out: result), iters Lloyd steps.
   Centroids are kept transposed ([D][K]) so the distance loop over k is contiguous (SIMD). */
void lloyd(const float *x, float *c, int P, int N, int D, int K, int iters) {
    #pragma omp parallel for schedule(dynamic)
    for (int p = 0; p < P; ++p) {
        const float *xp = x + (size_t)p * N * D;
        float *cp = c + (size_t)p * K * D;
        float *ct = malloc(sizeof(float) * K * D);
        double *sums = malloc(sizeof(double) * K * D);
        long *counts = malloc(sizeof(long) * K);
        float *dist = malloc(sizeof(float) * K);
        for (int it = 0; it < iters; ++it) {
            for (int k = 0; k < K; ++k)
                for (int d = 0; d < D; ++d) ct[(size_t)d * K + k] = cp[(size_t)k * D + d];
            memset(sums, 0, sizeof(double) * K * D);
            memset(counts, 0, sizeof(long) * K);
            for (int n = 0; n < N; ++n) {
                const float *xn = xp + (size_t)n * D;
                #pragma omp simd
                for (int k = 0; k < K; ++k) { const float t = xn[0] - ct[k]; dist[k] = t * t; }
                for (int d = 1; d < D; ++d) {
                    const float v = xn[d];
                    const float *cd = ct + (size_t)d * K;
                    #pragma omp simd
                    for (int k = 0; k < K; ++k) { const float t = v - cd[k]; dist[k] += t * t; }
                }
                int best = 0;
                float bd = FLT_MAX;
                for (int k = 0; k < K; ++k) if (dist[k] < bd) { bd = dist[k]; best = k; }
                counts[best] += 1;
                for (int d = 0; d < D; ++d) sums[(size_t)best * D + d] += xn[d];
            }
            for (int k = 0; k < K; ++k)
                if (counts[k] > 0)
                    for (int d = 0; d < D; ++d) cp[(size_t)k * D + d] = (float)(sums[(size_t)k * D + d] / counts[k]);
        }
        free(ct); free(sums); free(counts); free(dist);
    }
}
"""


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    tmp = tempfile.mkdtemp(prefix="c_lloyd_")
    src, lib = os.path.join(tmp, "lloyd.c"), os.path.join(tmp, "lloyd.so")
    with open(src, "w") as f:
        f.write(_SOURCE)
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", lib], check=True)
    dll = ctypes.CDLL(lib)
    dll.lloyd.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5
    return dll


def c_lloyd(x: np.ndarray, k: int, *, iters: int = 25, seed: int = 0) -> np.ndarray:
    """float32[P, N, d] -> centroids float32[P, k, d] (random init, ``iters`` Lloyd steps)."""
    x = np.ascontiguousarray(x, np.float32)
    p, n, d = x.shape
    rng = np.random.default_rng(seed)
    init = np.stack([x[i, rng.choice(n, size=k, replace=False)] for i in range(p)])
    c = np.ascontiguousarray(init, np.float32)
    _library().lloyd(x.ctypes.data, c.ctypes.data, p, n, d, k, iters)
    return c
